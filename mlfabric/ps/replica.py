"""A replica: a standby copy of one server's shards, fed the updates that server applies.

    python -m pytest tests/unit/test_ps.py -k replica

``register_as_replica(server)`` (MLfabric Table 1; by default replica ``i`` mirrors server
``i % S``, :class:`mlfabric.ps.layout.PSLayout`) asks the server for a copy: it sends each
model as it is then (values, version, and the rule's update history so that the next updates
give identical values), and afterwards every model it initialises and every update it
applies, in the order it applies them; the replica applies them with the same rule, so its
versions follow the server's exactly. That is chain replication.

Under MLfabric's network replication (§5.3, ``ScheduledSettings(replication="network")``,
:mod:`mlfabric.ps.policies.scheduled`, :mod:`mlfabric.ps.policies.replication`) the updates themselves come from the workers (or a replica
aggregator's sum of a unit), sent when the scheduler planned them; the server only sends a
small ``applied`` note per update, saying which unit it applied at which version, so the
replica applies the units in exactly the server's order, each once its note and its payload
are both in (a unit the network did not carry -- an unscheduled push, a group forwarded
incomplete -- comes from the server as under chain). A payload that never comes is waited
for ``timeout_s`` at most, then the replica stops with an error naming the unit.

Divergence measurement (``measure_divergence``): at each of its batch ends the server sends
its model, version and time; the replica compares it with its own model *as it was at that
time* (it keeps its models since the last probe) -- the true ``||w_s - w_r||`` -- and puts
the eq. (11) estimate beside it (its history norm then, the norms of the units the server
led by): :class:`ReplicaStats`.

    .venv/bin/python -m pytest tests/unit/test_ps_network_replication.py -q
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any


import torch

from mlfabric.transport.base import Transport

from . import protocol
from .config import PSConfig
from .divergence import estimate_divergence
from .layout import PSLayout
from .model import ModelSpec
from .failover import PROMOTION_GRACE_S, failover_refusal, live_replicas
from .policy import make_policy
from .protocol import payload_tensor
from .rules import SGDMomentum, UpdateInfo
from .server import UpdateCallback
from .shard import Shard
from .waits import wait_until

if TYPE_CHECKING:
    from .server import ParameterServer, ServerStats

log = logging.getLogger("mlfabric.ps")


@dataclass
class ReplicaStats:
    """What a replica measured. ``divergence``: per server batch end, ``(batch, true ||w_s -
    w_r||, eq. (11) estimate, lead in versions)``."""

    updates_applied: int = 0          # versions applied (chain updates and network units)
    from_network: int = 0             # of which, units whose payload came from the workers
    bytes_in: int = 0                 # payload bytes it got to replicate (models, updates, units)
    probe_bytes: int = 0              # and the servers' models for measuring (apart)
    divergence: list[tuple[int, float, float, int]] = field(default_factory=list)
    #: Failover: when this replica took over its lost server (wall clock, ``time.time()``), the
    #: worker updates the server had applied that never reached it (notes whose payload did not
    #: come within PROMOTION_GRACE_S; what the server applied without a note reaching the
    #: replica cannot be counted), and how many times it followed a new primary.
    promoted_at: float | None = None
    takeover_version: int | None = None
    lost_updates: int = 0
    recovery_asked: int = 0  # units asked of the workers again at the takeover
    followed: int = 0

    @property
    def max_divergence(self) -> float | None:
        return max((d[1] for d in self.divergence), default=None)

    @property
    def max_divergence_estimate(self) -> float | None:
        return max((d[2] for d in self.divergence), default=None)

    def as_dict(self) -> dict[str, Any]:
        return {"updates_applied": self.updates_applied, "from_network": self.from_network,
                "bytes_in": self.bytes_in, "probe_bytes": self.probe_bytes, "max_divergence": self.max_divergence,
                "max_divergence_estimate": self.max_divergence_estimate, "probes": len(self.divergence),
                "promoted_at": self.promoted_at, "takeover_version": self.takeover_version,
                "lost_updates": self.lost_updates, "recovery_asked": self.recovery_asked,
                "followed": self.followed}


class Replica:
    def __init__(self, transport: Transport, layout: PSLayout, config: PSConfig, *, server: int | None = None,
                 channel: str | None = None) -> None:
        self.transport, self.layout, self.config = transport, layout, config
        #: The job's routing policy: whether a server's updates count only with its clock note
        #: (mlnet), and its replication feed (whether this replica acks, network replication).
        self.policy = make_policy(config)
        self.feed = self.policy.replication_feed(config)
        self.server = layout.replicated_server(transport.rank) if server is None else layout.server_rank(server)
        #: The rank this replica mirrors: its server, or after a failover the replica that took over.
        self.primary = layout.server_rank(self.server)
        self.channel = channel or transport.channels[0]
        self.who = layout.describe(transport.rank)
        self.values: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        #: mlnet: each worker's clock as the server counted it, the updates it covers applied here
        self.clocks: dict[int, int] = {}
        self._uncommitted: list[tuple[dict, Any]] = []  # mlnet: sums whose clock has not come yet
        self._rules: dict[str, UpdateCallback] = {}
        self._callbacks: dict[str | None, UpdateCallback] = {}
        self._registered = False
        self._specs: dict[str, tuple[ModelSpec, float, float]] = {}  # name -> (spec, lr, momentum)
        self._priorities: dict[str, dict[str, int] | None] = {}  # name -> TicTac's, as registered
        self.promoted: "ParameterServer | None" = None
        #: After a takeover: each model as this replica took it over (what the lost work is
        #: measured against).
        self.takeover_values: dict[str, torch.Tensor] = {}
        self.stats = ReplicaStats()
        self._stop = threading.Event()
        # The server's notes and updates in its order, not applied yet: (header, payload or None,
        # when it got here); the units' payloads from the network, by (model, unit).
        self._queue: list[tuple[dict[str, Any], memoryview | None, float]] = []
        self._units: dict[tuple[str, int], torch.Tensor] = {}
        # Measuring (probes): per model, (time, version, values, history norm) since the last
        # probe, and per version applied by the server the norm of its update and how many
        # versions it spans.
        self._trail: dict[str, list[tuple[float, int, torch.Tensor, float]]] = {}
        self._norms: dict[str, dict[int, tuple[float, int]]] = {}

    def register_as_replica(self, server: int | None = None) -> None:
        """Start mirroring ``server`` (default: this replica's server in the layout)."""
        if self._registered:
            raise RuntimeError(f"{self.who}: already replicates server {self.server}")
        if server is not None:
            self.server = self.layout.server_rank(server)
            self.primary = self.server
        self.transport.send(self.primary, protocol.request_tag(self.config.session), b"",
                            meta=protocol.Register(server=self.server).encode(), channel=self.channel)
        self._registered = True

    def promote(self) -> "ParameterServer":
        """A server for this replica's shards, starting from the replica's models, versions and
        update histories (failover; the workers redirect to it, :class:`PSWorker`)."""
        from .server import ParameterServer

        server = ParameterServer(self.transport, self.layout, self.config, server=self.server, channel=self.channel)
        for name, values in self.values.items():
            spec, lr, momentum = self._specs[name]
            offset, length = spec.shards(self.layout.servers)[self.server]
            shard = Shard(spec, offset, length, values, self._rules[name], lr=lr, momentum=momentum)
            shard.version = self.versions[name]
            shard.priorities = self._priorities.get(name)  # ordered pulls go on after failover
            server.shards[name] = shard
        for worker, clock in self.clocks.items():  # mlnet: the clocks of what it holds (workers adopt otherwise)
            server.book.adopt(worker, clock)
        return server

    def stop(self) -> None:
        """End :meth:`serve` at its next turn (a replica going away)."""
        self._stop.set()
        self.transport.mailbox.notify()

    def register_update_callback(self, callback: UpdateCallback, model: str | None = None) -> None:
        """Must be the server's rule for the copies to stay equal."""
        self._callbacks[model] = callback

    def serve(self) -> "dict[str, int] | ServerStats":
        """Apply the server's updates until it ends; returns each model's version. If the
        server is lost where a failover can be done (:func:`failover_refusal`), the first live
        replica of the shard takes over (:meth:`promote`) and serves until the workers leave
        (returns the server statistics then); the others follow it as their new primary.
        Registers first if :meth:`register_as_replica` was not called."""
        if not self._registered:
            self.register_as_replica()
        mailbox = self.transport.mailbox
        ending: float | None = None
        while not self._stop.is_set():
            version = mailbox.version
            if self._take_all():
                ending = ending or time.monotonic()
            self._drain()
            server_rank = self.primary
            if ending is None and server_rank in self.transport.departed_peers:
                ending = time.monotonic()  # gone without its end: what is queued gets timeout_s
            if ending is not None:
                if not self._queue:
                    return dict(self.versions)
                if time.monotonic() - ending > self.config.timeout_s:
                    log.error("%s: server %d ended; %d of its updates never reached this replica within %.0f s "
                              "(first: %s); the replica stops at versions %s", self.who, self.server,
                              len(self._queue), self.config.timeout_s, self._queue[0][0], self.versions)
                    return dict(self.versions)
            promoted = self._after_loss(server_rank)
            if promoted is not None:
                return promoted
            self.transport.progress(version, 0.1)
        return dict(self.versions)

    def _take_all(self) -> bool:
        """File every message waiting (any source: the primary, the scheduler's unit plans,
        workers and replica aggregators with units); True if the primary's end was among them."""
        tag = protocol.tag(protocol.REPLICATE, self.config.session)
        ended = False
        while (msg := self.transport.mailbox.take(self.channel, tag)) is not None:
            ended = self._take(msg, self.primary) or ended
        return ended

    def _after_loss(self, server_rank: int) -> "dict[str, int] | ServerStats | None":
        """The primary is gone: take over (failover), follow the replica that does, or stop;
        None while it is there (or while following)."""
        if server_rank in self.transport.lost_peers:
            refusal = failover_refusal(self.config, self.layout)
            successors = live_replicas(self.layout, self.transport, self.server)
            if refusal is None and successors and successors[0] == self.transport.rank:
                return self._take_over()
            if refusal is None and successors:
                self._follow(successors[0])
                return None
            log.warning("%s: %s was lost; no failover (%s): the replica holds versions %s", self.who,
                        self.layout.describe(server_rank), refusal or "no live replica", self.versions)
            return dict(self.versions)
        if server_rank in self.transport.departed_peers and not self._queue:
            return dict(self.versions)
        return None

    def _take_over(self) -> "ServerStats":
        """Failover: apply what of the lost server's order is here (waiting up to
        PROMOTION_GRACE_S for units still on their way), count the rest as lost, and serve
        the shard from this model (MLfabric §3.3: fresh updates make up the lost work)."""
        self._recover_units()

        def caught_up() -> bool:
            if not self._waiting_for_units():
                return True
            self._take_all()
            self._drain()
            return not self._waiting_for_units()

        wait_until(self.transport, caught_up, time.monotonic() + PROMOTION_GRACE_S, who=self.who,
                   what="the units of the lost server's order", required=False, poll=0.02)
        lost = [h for h, _, _ in self._queue if h["op"] in ("applied", "update")]
        if self._uncommitted:  # mlnet: their clocks never came; the tree nodes send them again
            log.info("%s: %d tree sums without their clock left out (the nodes send them again)", self.who,
                     len(self._uncommitted))
            self._uncommitted.clear()
        self.stats.lost_updates = sum(len(h["workers"]) for h in lost)
        self._queue.clear()
        self.stats.promoted_at = time.time()
        self.stats.takeover_version = max(self.versions.values(), default=0)
        self.takeover_values = {name: values.clone() for name, values in self.values.items()}
        log.warning("%s: %s was lost; taking over server %d's shards at versions %s (%d of its updates lost)",
                    self.who, self.layout.describe(self.primary), self.server, self.versions,
                    self.stats.lost_updates)
        self.promoted = self.promote()
        return self.promoted.serve()

    def _recover_units(self) -> None:
        """Ask the workers for their copies of the units the lost server applied and this
        replica has not got (punted ones had not been sent at all): each member sends its copy
        here, or, for a unit of several updates, to its first member, which sums them in the
        unit's order (the replica-aggregator path: equal bits to the server's sum)."""
        tag = protocol.tag(protocol.AGGREGATE, self.config.session)
        me = self.transport.rank
        gone = self.transport.gone_peers
        for header, _, _ in self._queue:
            if header["op"] != "applied" or (header["model"], int(header["unit"])) in self._units:
                continue
            members = [(int(r), int(i)) for r, i in header.get("members") or []]
            if not members or any(rank in gone for rank, _ in members):
                continue
            unit, model = int(header["unit"]), header["model"]
            dest = me if len(members) == 1 else members[0][0]
            if len(members) > 1:
                self.transport.send(dest, tag, b"", channel=self.channel, meta=protocol.ReplicaUnit(
                    unit=unit, model=model, server=self.server, dest=me,
                    members=[list(m) for m in members], rate=None).encode())
            for rank, update_id in members:
                self.transport.send(rank, tag, b"", channel=self.channel, meta=protocol.Replicate(
                    unit=unit, model=model, id=update_id, server=self.server, dest=dest, replica=me,
                    start_in=0.0, rate=None, recovery=True).encode())
            self.stats.recovery_asked += 1

    def _waiting_for_units(self) -> bool:
        return bool(self._queue) and self._queue[0][0]["op"] == "applied"

    def _follow(self, successor: int) -> None:
        """Another replica took over: mirror it from its model (it sends a fresh copy)."""
        log.warning("%s: %s was lost; %s takes over, this replica follows it", self.who,
                    self.layout.describe(self.primary), self.layout.describe(successor))
        self.primary = successor
        self._queue.clear()
        self._units.clear()
        self._trail.clear()
        self._norms.clear()
        self._uncommitted.clear()
        self.stats.followed += 1
        self.transport.send(successor, protocol.request_tag(self.config.session), b"",
                            meta=protocol.Register(server=self.server).encode(), channel=self.channel)

    def _take(self, msg: Any, server_rank: int) -> bool:
        """File one message; True if it is the server's end."""
        header = protocol.decode(msg.meta)
        op = header["op"]
        if op == "probe":
            self.stats.probe_bytes += msg.payload.nbytes
        else:
            self.stats.bytes_in += msg.payload.nbytes
        if op == "refused":
            raise RuntimeError(header["message"])
        if op == "unit":  # a unit's payload, from a worker or a replica aggregator
            name = header["model"]
            spec = self._specs.get(name)
            if spec is None:
                log.error("%s: a unit of unknown model %r from %s dropped", self.who, name,
                          self.layout.describe(msg.src))
                return False
            _, length = spec[0].shards(self.layout.servers)[self.server]
            self._units[(name, int(header["unit"]))] = payload_tensor(msg.payload, spec[0].torch_dtype, length,
                                                                       "replica unit").clone()
            return False
        if op == "units":  # the scheduler's plan for this replica: informative (the server's notes rule)
            return False
        if msg.src != server_rank:
            log.error("%s: ignored %r from %s", self.who, op, self.layout.describe(msg.src))
            return False
        if op == "end":
            return True
        if op in ("applied", "update"):
            self._norms.setdefault(header["model"], {})[int(header["version"])] = (
                float(header.get("norm", 0.0)), len(header["workers"]) if self._async else 1)
        payload = memoryview(bytearray(msg.payload)) if msg.payload.nbytes else None
        self._queue.append((header, payload, time.monotonic()))
        return False

    @property
    def _async(self) -> bool:
        return self.config.consistency.kind != "bsp"  # an aggregate of m async updates is m versions

    def _drain(self) -> None:
        """Apply what is in the server's order and has its payload; under network replication,
        tell the server where this replica stands (it holds a batch's last update while that
        would put the replica beyond Div_max)."""
        before = dict(self.versions)
        try:
            self._apply_queued()
        finally:
            if (self.feed.network and not self._stop.is_set() and self.primary not in self.transport.lost_peers):
                for name in [n for n, v in self.versions.items() if before.get(n) != v]:
                    history = getattr(self._rules[name], "history", None)
                    h = float(torch.linalg.vector_norm(history.double())) if history is not None else 0.0
                    self.transport.send(self.primary, protocol.request_tag(self.config.session),
                                        b"", meta=protocol.Ack(model=name, version=self.versions[name], history_norm=h).encode(),
                                        channel=self.channel)

    def _apply_queued(self) -> None:
        while self._queue:
            header, payload, since = self._queue[0]
            op = header["op"]
            if op == "applied":
                unit = self._units.pop((header["model"], int(header["unit"])), None)
                if unit is None:
                    if time.monotonic() - since > self.config.timeout_s:
                        raise RuntimeError(
                            f"{self.who}: unit {header['unit']} (version {header['version']} of "
                            f"{header['model']!r}, workers {header['workers']}) never came from the network within "
                            f"{self.config.timeout_s:.0f} s: the replica can no longer follow server {self.server}; "
                            "check the workers' logs (a copy freed, a lost worker) and restart the replica")
                    return
                self.stats.from_network += 1
                self._apply(header, unit)
                # the server applies units in increasing key order: an earlier one still here was
                # skipped there (or came from the server itself), and is never needed
                for key in [k for k in self._units if k[0] == header["model"] and k[1] < int(header["unit"])]:
                    del self._units[key]
            elif op == "probe":
                self._measure(header, payload)
            elif op == "clock":  # mlnet: the server counted these workers' clock: its sums count here now
                for held, held_payload in self._uncommitted:
                    self._apply(held, held_payload)
                self._uncommitted.clear()
                for w in header["workers"]:
                    self.clocks[int(w)] = int(header["clock"]) + 1
            elif op == "update" and self.policy.commits_on_clock:
                # a tree node's sum: the server applies it when the node's clock comes and forwards
                # that clock after it; held until then, so a server that dies between the two
                # leaves nothing half-counted here (the node sends that clock again)
                self._uncommitted.append((header, payload if payload is not None else memoryview(b"")))
            else:
                self._apply(header, payload if payload is not None else memoryview(b""))
            self._queue.pop(0)

    def _apply(self, header: dict, payload: "memoryview | torch.Tensor") -> None:
        if header["op"] == "init":
            spec = ModelSpec.from_json(header["spec"])
            _, length = spec.shards(self.layout.servers)[self.server]
            with_history = bool(header.get("history"))
            data = payload_tensor(payload, spec.torch_dtype, 2 * length if with_history else length, "replica init")
            self.values[spec.name] = data[:length].clone()
            self._specs[spec.name] = (spec, float(header["lr"]), float(header["momentum"]))
            self._priorities[spec.name] = header.get("priorities")
            self.versions[spec.name] = int(header.get("version", 0))
            if self.policy.commits_on_clock:  # the clocks behind this copy (a follower's fresh one too)
                self.clocks = {w: int(c) for w, c in enumerate(header.get("clocks") or [])}
            rule = self._callbacks.get(spec.name) or self._callbacks.get(None)
            if rule is None:
                rule = SGDMomentum(float(header["lr"]), float(header["momentum"]))
                if with_history:
                    rule.history = data[length:].clone()
            self._rules[spec.name] = rule
            self._remember(spec.name)
            return
        name = header["model"]
        values = self.values[name]
        if int(header["version"]) != self.versions[name]:
            raise RuntimeError(f"{self.who}: update {header['version']} of {name!r} arrived at version "
                               f"{self.versions[name]}: the server's order was not kept")
        gradient = (payload if isinstance(payload, torch.Tensor)
                    else payload_tensor(payload, values.dtype, values.numel(), "replicated update"))
        info = UpdateInfo(model=name, server=self.server, version=self.versions[name],
                          workers=tuple(header["workers"]), computed_from=tuple(header["computed_from"]),
                          weight=float(header["weight"]))
        self._rules[name](values, gradient, info)
        # as the server counts: an aggregate of m asynchronous updates is m versions
        self.versions[name] += len(info.workers) if self._async else 1
        self.stats.updates_applied += 1
        self._remember(name)

    # -- measuring the divergence (probes) ---------------------------------------------------------

    def _remember(self, name: str) -> None:
        if not self.feed.measure_divergence:
            return
        history = getattr(self._rules[name], "history", None)
        h = float(torch.linalg.vector_norm(history.double())) if history is not None else 0.0
        self._trail.setdefault(name, []).append((time.monotonic(), self.versions[name], self.values[name].clone(), h))

    def _measure(self, header: dict[str, Any], payload: memoryview | None) -> None:
        """The server's model at one of its batch ends against this replica's at that time."""
        name = header["model"]
        trail = self._trail.get(name)
        if not trail or payload is None:
            return
        t_b, v_s = float(header["t"]), int(header["version"])
        at = max((i for i, (t, *_rest) in enumerate(trail) if t <= t_b), default=0)
        _, v_r, w_r, h_r = trail[at]
        w_s = payload_tensor(payload, w_r.dtype, w_r.numel(), "server model (probe)")
        true = float(torch.linalg.vector_norm((w_s.double() - w_r.double())))
        norms, v = [], v_r
        spans = self._norms.get(name, {})
        while v < v_s and v in spans:
            norm, span = spans[v]
            norms.append(norm)
            v += span
        momentum = self._specs[name][2]
        estimate = estimate_divergence(h_r, norms, momentum)
        self.stats.divergence.append((int(header["batch"]), true, estimate, v_s - v_r))
        # what the next probe (a later batch end) may still need: from this point on
        del trail[:at]
        for old in [k for k in spans if k < v_r]:
            del spans[old]


