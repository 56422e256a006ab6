"""The ``scheduled`` policy on a worker: ask the scheduler, wait for the decision, carry it out.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py -q

Runs in the pushing thread (:meth:`ScheduledWorkerSide.send_push`): a request per update to
the scheduler beside server 0, its decision awaited at most ``decision_timeout_s`` (then the
update is pushed unscheduled, a fallback), each component sent at its planned start, paced at
its planned rate, to its next hop (a server, or an aggregator). The worker's
:class:`~mlfabric.ps.policies.scheduled.aggregator.Aggregator` thread starts with the first push.
#36: a member of a tree sends its update chunk by chunk to its node (:func:`tree_chunks`);
co-located workers hand theirs to the host request's leading worker, which pushes the sum
(``ScheduledWorkerSide._host_sum``; ``tests/unit/test_ps_trees_runtime.py``).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mlfabric.transport.base import SendHandle, tensor_bytes

from ... import protocol
from ...protocol import payload_tensor
from ...waits import wait_until
from .aggregator import Aggregator, wait_sent
from .cutthrough import chunk_count, chunk_elems, chunk_span, decode_tree, tree_root
from .settings import ScheduledSettings

if TYPE_CHECKING:
    from mlfabric.ps.policy import WorkerPort

log = logging.getLogger("mlfabric.ps")

_LOST = object()  # the scheduler was lost while a worker waited for its decision


@dataclass
class DaemonStats:
    """A worker's scheduled pushes: counts, and where a push's time went (summed over pushes):
    waiting for the decision (the batching interval plus the round trip to the scheduler),
    for the planned start, and handing the update to the transport (paced)."""

    requested: int = 0
    dropped: int = 0
    fallbacks: int = 0
    aggregated: int = 0
    decision_wait_s: float = 0.0
    start_wait_s: float = 0.0
    send_s: float = 0.0
    host_parts: int = 0  # updates handed to the host's leading worker (#36)
    host_sums: int = 0   # host sums this worker pushed as its host's leader

    def as_dict(self) -> dict[str, Any]:
        return {"requested": self.requested, "dropped_by_scheduler": self.dropped, "fallbacks": self.fallbacks,
                "sent_to_aggregators": self.aggregated, "decision_wait_s": self.decision_wait_s,
                "start_wait_s": self.start_wait_s, "send_s": self.send_s, "host_parts": self.host_parts,
                "host_sums": self.host_sums}


def tree_chunks(model: str, decision: dict[str, Any], server: int, component: torch.Tensor,
                push: protocol.ScheduledPush) -> list[tuple[protocol.TreeChunk, torch.Tensor]]:
    """One member's component as the chunks its tree node sums (framing: :mod:`.aggregator`,
    "aggregation trees"); ``push``: the update's (rank, id, version, clock; a host sum's members)."""
    elems = chunk_elems(int(decision.get("chunk_bytes", 0)), component.element_size())
    numel = component.numel()
    root = tree_root(decode_tree(decision["tree"]), int(decision["hop"][server]))
    members = ([[int(r), int(i), int(v)] for (r, i), v in zip(push.members, push.versions or [])]
               if push.members is not None else [[push.rank, push.id, push.version]])
    member = members[0]
    out = []
    for index in range(chunk_count(numel, elems)):
        start, length = chunk_span(index, numel, elems)
        out.append((protocol.TreeChunk(model=model, batch=int(decision["batch"]), slot=int(decision["group"]),
                                       server=server, chunk=index, elems=elems, source=["m", member[0], member[1]],
                                       members=members, clock=push.clock, root=root), component[start:start + length]))
    return out


class ScheduledWorkerSide:
    """The worker side of the ``scheduled`` policy (module docstring)."""

    def __init__(self, settings: ScheduledSettings) -> None:
        self.settings = settings
        self.stats = DaemonStats()
        self._aggregator: Aggregator | None = None
        self._ids = itertools.count(1)

    def _start(self, worker: "WorkerPort") -> None:
        if self._aggregator is None:
            self._worker = worker
            self._aggregator = Aggregator(worker, self.settings)
            self._aggregator.start()

    def send_push(self, worker: "WorkerPort", model: str, components: list[torch.Tensor],
                  pushes: list[protocol.Push]) -> list[SendHandle] | None:
        """Ask the scheduler, wait for the decision and carry it out: returns once the update
        was handed to the transport at its planned start (a push is then where the schedule
        wants it, like a direct push once the transport has it; nothing is left for the
        caller to wait on), or None once the scheduler dropped it."""
        self._start(worker)
        return [] if self._push(model, components, pushes) else None

    def flush(self, timeout: float) -> None:
        """A worker leaving: its aggregator forwards what is complete or due, then stops."""
        if self._aggregator is not None:
            self._aggregator.stop(timeout)

    def _push(self, model: str, components: list[torch.Tensor], pushes: list[protocol.Push]) -> bool:
        """Carry out one push; False if the scheduler dropped it."""
        w = self._worker
        transport, session = w.transport, w.config.session
        first = pushes[0]
        request_id = next(self._ids)
        self.stats.requested += 1
        # Network replication: the copy is kept before the scheduler can ask for it (its
        # "replicate" may reach the aggregator thread before this thread has the decision).
        keeping = self.settings.replication == "network" and w.layout.replicas > 0 and self._aggregator is not None
        if keeping:
            self._aggregator.keep(model, request_id, components)
        asked = time.monotonic()
        transport.send(w.server_rank(0), protocol.tag(protocol.SCHEDULE, session), b"", channel=w.channel,
                       meta=protocol.ScheduleRequest(id=request_id, model=model, version=first.version,
                                                     norm=float(first.norm or 0.0), clock=first.clock,
                                                     sizes=[c.numel() * c.element_size() for c in components]).encode())
        decision = self._decision(request_id)
        decided = time.monotonic()
        self.stats.decision_wait_s += decided - asked
        if (decision is None or decision["drop"]) and keeping:  # not a unit: no replica asks for it
            self._aggregator.forget(model, request_id)
        if decision is None:  # no answer in time: push unscheduled (the server bounds its delay)
            self.stats.fallbacks += 1
            # Withdraw the request; if it was planned already, its entry is skipped at the server.
            transport.send(w.server_rank(0), protocol.tag(protocol.SCHEDULE, session), b"", channel=w.channel,
                           meta=protocol.Cancel(id=request_id, model=model).encode())
            handles = [transport.send(w.server_rank(j), protocol.request_tag(session), tensor_bytes(c),
                                      meta=p.encode(), channel=w.channel) for j, (c, p) in enumerate(zip(components, pushes))]
            wait_sent(transport, handles, w.config.timeout_s)
            return True
        if decision["drop"]:
            self.stats.dropped += 1
            return False
        if "host" in decision:  # host-local aggregation: the host's leading worker pushes the sum
            self._hand_to_host(decision, request_id, components, first)
            return True
        host: dict[str, Any] = {}
        if decision.get("host_members"):
            components, host = self._host_sum(decision, request_id, components, first)
        time.sleep(float(decision["start_in"]))
        started = time.monotonic()
        self.stats.start_wait_s += started - decided
        handles, paced = [], []
        for j, (component, push, hop) in enumerate(zip(components, pushes, decision["hop"])):
            scheduled = protocol.ScheduledPush(**push.body(), batch=decision["batch"], id=request_id,
                                               rank=transport.rank, **host)
            rate = decision["rates"][j] if j < len(decision["rates"]) else None
            if hop != transport.rank and rate is not None and transport.pace_connection(hop, w.channel, rate):
                paced.append(hop)
            if hop in w.serving:  # a server (or the replica that took over one), else an aggregator
                handles.append(transport.send(hop, protocol.request_tag(session), tensor_bytes(component),
                                              meta=scheduled.encode(), channel=w.channel))
            elif "tree" in decision:  # a node of a multi-level (or cut-through) tree: chunk by chunk
                self.stats.aggregated += 1
                assert self._aggregator is not None
                handles += self._aggregator.contribute(model, j, hop, decode_tree(decision["tree"]),
                                                       tree_chunks(model, decision, j, component, scheduled),
                                                       float(decision.get("hold_in", w.config.timeout_s)))
            else:
                self.stats.aggregated += 1
                member = protocol.Member(**scheduled.body(), slot=decision["group"], server=j)
                if hop == transport.rank:
                    assert self._aggregator is not None
                    self._aggregator.add_member(member.fields(), component)
                else:
                    handles.append(transport.send(hop, protocol.tag(protocol.AGGREGATE, session),
                                                  tensor_bytes(component), meta=member.encode(),
                                                  channel=w.channel))
        wait_sent(transport, handles, w.config.timeout_s)
        for hop in paced:
            transport.pace_connection(hop, w.channel, None)
        self.stats.send_s += time.monotonic() - started
        return True

    def _hand_to_host(self, decision: dict[str, Any], request_id: int, components: list[torch.Tensor],
                      first: protocol.Push) -> None:
        """A co-located member's update goes to its host's leading worker (#36; the
        transport's link between two ranks of one host is shared memory: no NIC)."""
        w = self._worker
        tag = protocol.tag(protocol.DECISION, w.config.session, int(decision["host_id"]))
        handles = [w.transport.send(int(decision["host"]), tag, tensor_bytes(c), channel=w.channel,
                                    meta=protocol.HostPart(server=j, rank=w.transport.rank, id=request_id,
                                                           version=first.version, clock=first.clock).encode())
                   for j, c in enumerate(components)]
        self.stats.host_parts += 1
        wait_sent(w.transport, handles, w.config.timeout_s)

    def _host_sum(self, decision: dict[str, Any], request_id: int, components: list[torch.Tensor],
                  first: protocol.Push) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The host's leading worker sums its co-located members' updates into its own (each
        component, in the members' order), waiting for them at most ``decision_timeout_s``
        (a member that does not come is left out, and named); returns the sums and the push
        fields naming every update in them (``workers``, ``versions``, ``members``)."""
        w = self._worker
        transport = w.transport
        tag = protocol.tag(protocol.DECISION, w.config.session, request_id)
        totals = [c.detach().clone() for c in components]
        ranks, ids, versions = [transport.rank], [request_id], [int(first.version)]
        deadline = time.monotonic() + self.settings.decision_timeout_s
        for rank, rid in decision["host_members"]:
            parts: list[tuple[dict[str, Any], Any]] = []
            for _ in components:
                msg = wait_until(transport, lambda r=int(rank): transport.mailbox.take(w.channel, tag, r), deadline,
                                 who=w.who, what=f"the update of co-located {w.layout.describe(int(rank))}",
                                 required=False, poll=0.05)
                if msg is None:
                    break
                parts.append((protocol.decode(msg.meta), msg))
            if len(parts) < len(components):
                log.warning("%s: host-local aggregation: the update of %s did not come within %.1f s; the host's "
                            "sum goes without it", w.who, w.layout.describe(int(rank)), self.settings.decision_timeout_s)
                continue
            for header, msg in parts:
                j = int(header["server"])
                totals[j].add_(payload_tensor(msg.payload, totals[j].dtype, totals[j].numel(),
                                              f"host part of {w.layout.describe(int(rank))}").view_as(totals[j]))
            ranks.append(int(rank))
            ids.append(int(rid))
            versions.append(int(parts[0][0]["version"]))
        self.stats.host_sums += 1
        return totals, {"workers": [w.layout.worker_index(r) for r in ranks], "versions": versions,
                        "members": [[r, i] for r, i in zip(ranks, ids)]}

    def _decision(self, request_id: int) -> dict[str, Any] | None:
        w = self._worker
        transport = w.transport
        tag = protocol.tag(protocol.DECISION, w.config.session, request_id)

        def decided() -> Any:
            scheduler = w.server_rank(0)  # the scheduler lives beside server 0
            msg = transport.mailbox.take(w.channel, tag, scheduler)
            if msg is not None:
                return msg
            if scheduler in transport.lost_peers:
                w.fail_over(scheduler)  # a replica takes over (the fallback push goes to it)
                return _LOST
            return None

        msg = wait_until(transport, decided, time.monotonic() + self.settings.decision_timeout_s, who=w.who,
                         what=f"the scheduler's decision for update {request_id}", required=False, poll=0.05)
        if msg is _LOST:
            return None
        if msg is not None:
            return protocol.decode(msg.meta)
        log.warning("%s: no decision from the scheduler within %.1f s for update %d: pushing it unscheduled",
                    w.who, self.settings.decision_timeout_s, request_id)
        return None

