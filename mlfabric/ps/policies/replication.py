"""The replication feeds: what a server sends its replicas after each update it applies.

    .venv/bin/python -m pytest tests/unit/test_ps_replication.py tests/unit/test_ps_network_replication.py -q

* :class:`ChainFeed` (chain replication, the baseline): the server forwards every update it
  applies, in order; the replica applies it with the same rule (:mod:`mlfabric.ps.replica`).
* :class:`NetworkFeed` (MLfabric §5.3, the ``scheduled`` policy with
  ``ScheduledSettings(replication="network")``): the workers send the update itself as the
  scheduler planned it; the server only sends a small ``applied`` note per unit (its key, its
  version, its members), and holds a batch's last entry while applying it would leave a live
  replica beyond Div_max (eq. (11) on the replica's acked state), ``slack_s`` at most.

A feed is picked by the routing policy (:meth:`mlfabric.ps.policy.Policy.replication_feed`)
and reaches the server through its port (``replicas``, ``send_replica``, ``stats``,
``transport``); it keeps its own state (the replicas' acks and the lead).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from mlfabric.transport.base import tensor_bytes

from .. import protocol

if TYPE_CHECKING:
    from mlfabric.ps.divergence import DivergenceBound
    from mlfabric.ps.policy import ServerPort
    from mlfabric.ps.shard import Shard

log = logging.getLogger("mlfabric.ps")


class ChainFeed:
    """Chain replication: every applied update goes to every replica (module docstring).
    ``measure_divergence``: at a batch end the replicas get the server's model to measure
    how far theirs is (costs a model per batch on the server's NIC, counted apart)."""

    network = False

    def __init__(self, *, measure_divergence: bool = False) -> None:
        self.measure_divergence = measure_divergence

    def after_apply(self, server: "ServerPort", shard: "Shard", version: int, gradient: torch.Tensor,
                    workers: tuple[int, ...], computed_from: tuple[int, ...], weight: float, unit: int | None,
                    members: list[list[int]] | None, norm: float | None) -> None:
        norm = self._norm(shard, gradient, weight, norm)
        header = protocol.Applied(model=shard.spec.name, version=version, workers=list(workers),
                                  computed_from=list(computed_from), weight=weight, norm=norm,
                                  t=time.monotonic()).encode()  # once, for every replica
        for replica in server.replicas:
            server.send_replica(replica, header, gradient.clone())

    @staticmethod
    def _norm(shard: "Shard", gradient: torch.Tensor, weight: float, norm: float | None) -> float:
        """eq. (1): ||u|| = lr weight ||g|| (the replica's divergence estimate uses it)."""
        if norm is not None:
            return norm
        return abs(shard.lr * weight) * float(torch.linalg.vector_norm(gradient.double()))

    def on_ack(self, server: "ServerPort", replica: int, header: dict[str, Any]) -> None:
        """A replica's ack (network replication's); chain replication needs none."""

    def refusal(self, server: "ServerPort", replica: int) -> str | None:
        return None

    def hold_last(self, server: "ServerPort", shard: "Shard", norm: float | None, now: float) -> bool:
        return False

    def probe(self, server: "ServerPort", shard: "Shard", batch: int) -> None:
        """At a batch's end, with ``measure_divergence``: the replicas get this server's model
        (and its time and version) to measure how far theirs is (:class:`mlfabric.ps.replica.Replica`)."""
        if not server.replicas or not self.measure_divergence:
            return
        for replica in server.replicas:
            if server.transport.is_gone(replica):
                continue
            values = shard.values.clone()
            handle = server.transport.send(replica, protocol.tag(protocol.REPLICATE, server.config.session),
                                           tensor_bytes(values), channel=server.channel, meta=protocol.Probe(
                                               model=shard.spec.name, batch=batch,
                                               version=shard.version, t=time.monotonic()).encode())
            server.track(handle, values)
            server.stats.probe_bytes += values.numel() * values.element_size()


class NetworkFeed(ChainFeed):
    """MLfabric §5.3's network replication (module docstring). ``bound``: Div_max (None: no
    wait); ``slack_s``: the longest a batch's last entry waits for a replica."""

    network = True

    def __init__(self, *, bound: "DivergenceBound | None", slack_s: float, measure_divergence: bool = False) -> None:
        super().__init__(measure_divergence=measure_divergence)
        self.bound, self.slack_s = bound, slack_s
        #: Per replica and model, the version it has applied and its history norm there (its
        #: acks); per model, (version, versions spanned, norm bound) of what this server
        #: applied since -- the lead eq. (11) is computed on.
        self.replica_at: dict[int, dict[str, tuple[int, float]]] = {}
        self.lead: dict[str, list[tuple[int, int, float]]] = {}
        self._held_since: float | None = None  # when the batch's last entry began waiting for replicas

    def after_apply(self, server: "ServerPort", shard: "Shard", version: int, gradient: torch.Tensor,
                    workers: tuple[int, ...], computed_from: tuple[int, ...], weight: float, unit: int | None,
                    members: list[list[int]] | None, norm: float | None) -> None:
        norm = self._norm(shard, gradient, weight, norm)
        lead = self.lead.setdefault(shard.spec.name, [])
        lead.append((version, shard.version - version, norm))
        gone = server.transport.gone_peers
        # what every live replica has applied is never needed again (none live: nothing is)
        acked = min((self.replica_at.get(r, {}).get(shard.spec.name, (0, 0.0))[0] for r in server.replicas
                     if r not in gone), default=shard.version)
        while lead and lead[0][0] < acked:
            lead.pop(0)
        fields = dict(model=shard.spec.name, version=version, workers=list(workers),
                      computed_from=list(computed_from), weight=weight, norm=norm, t=time.monotonic())
        # each header encoded once, for every replica
        chain = protocol.Applied(**fields).encode()
        network = protocol.AppliedUnit(**fields, unit=unit, members=members).encode() if unit is not None else None
        for replica in server.replicas:
            if network is not None:
                # the update itself reaches the replica from the workers (the scheduler planned
                # it); the server only says where it stands in its order (with the unit's
                # members, (rank, update id): a replica that takes over asks them for the
                # copies of units the network had not delivered yet)
                server.send_replica(replica, network, b"")
            else:  # what the network did not carry goes the chain way
                server.send_replica(replica, chain, gradient.clone())

    def on_ack(self, server: "ServerPort", replica: int, header: dict[str, Any]) -> None:
        self.replica_at.setdefault(replica, {})[header["model"]] = (int(header["version"]),
                                                                    float(header["history_norm"]))

    def refusal(self, server: "ServerPort", replica: int) -> str | None:
        """The scheduler plans units for the replicas of the layout (``PSLayout.replicas_of``):
        one that claims another server's slot would never get its updates."""
        if server.layout.replicated_server(replica) == server.server:
            return None
        return (f"{server.who}: {server.layout.describe(replica)} asked to replicate server {server.server}, but "
                f"under network replication it is server {server.layout.replicated_server(replica)}'s replica "
                f"(replica i mirrors server i % {server.layout.servers}); register without a server, or use "
                "replication 'chain'")

    def hold_last(self, server: "ServerPort", shard: "Shard", norm: float | None, now: float) -> bool:
        """§5.3 step 3 with the replicas' own word: the batch's last entry waits while applying
        it would leave a live replica further than Div_max behind (eq. (11) on the acked version
        and history norm, and the norms of what this server applied since, this entry included),
        at most ``slack_s``; then it goes on, counted and warned (``bound_overruns``)."""
        bound = self.bound
        if bound is None or norm is None:
            return False
        name = shard.spec.name
        lead = self.lead.get(name, [])
        gone = server.transport.gone_peers
        far = []
        for replica in server.replicas:
            if replica in gone:
                continue
            version, history_norm = self.replica_at.get(replica, {}).get(name, (0, 0.0))
            behind = [n for v, _, n in lead if v >= version]
            # waiting helps only while the replica has not got everything before this entry
            # (one update over Div_max alone is the scheduler's 'violated', warned there)
            if behind and not bound.allows(history_norm, behind + [norm], shard.momentum):
                far.append(replica)
        stats = server.stats
        if not far:
            if self._held_since is not None:
                stats.replica_wait_s += now - self._held_since
                self._held_since = None
            return False
        if self._held_since is None:
            self._held_since = now
            stats.replica_waits += 1
        if now - self._held_since < self.slack_s:
            return True
        stats.bound_overruns += 1
        stats.replica_wait_s += now - self._held_since
        self._held_since = None
        log.warning("%s: %s still beyond Div_max %s after %.1f s; the batch's last update goes on (the bound is "
                    "overrun: the replica's network path is slower than planned)", server.who,
                    ", ".join(server.layout.describe(r) for r in far), bound, self.slack_s)
        return False


__all__ = ["ChainFeed", "NetworkFeed"]
