"""Partial allreduce at run time (eager-SGD §4): a persistent schedule on the progress thread.

    res = comm.partial_allreduce(grad, quorum="solo")     # or "majority"
    res.tensor, res.contributed, res.active, res.round

One :class:`PartialAllreduce` per (quorum, size, dtype, algorithm, op) lives on the
communicator's progress thread for the communicator's lifetime. It keeps one execution of
the schedule from ``collectives/partial.py`` armed at all times, so that a rank which has not
called yet still takes part when a peer's activation message arrives: it contributes its
*send buffer* — the sum of what the application handed in since its last contribution
(nothing, or stale gradients) — and the application finds the result when it calls.

Rounds. Executions are numbered 0, 1, 2...; a call asks for round ``r`` (default: one after
the last round this rank saw). If execution ``r`` has not started on this rank, the call's
tensor joins the send buffer (*fresh*), and the rank activates it — always with ``solo``, only
if it is round ``r``'s initiator with ``majority`` (drawn from a seed every rank shares,
eager-SGD §4.2; any other majority rank *joins*: its part of the reduction starts with its
fresh data, and the round completes once the initiator's activation has reached the ranks
that have not called) — and the call returns execution ``r``'s result (``contributed=True``). If
execution ``r`` already started, the tensor is kept for the next execution and the call
returns the latest result (``contributed=False``): a rank several rounds behind catches up
in one call. ``quorum="all"`` waits for every rank, a synchronous allreduce that survives
failures like the partial ones. A rank takes part from its first call on (that call
registers the collective on its progress thread): until every rank has called once, the
first round waits for the latecomers.

End of a run with ``majority``: a rank that stops calling may be the initiator another rank
waits for. Either end every rank at the same *round* (loop until ``res.round`` reaches the
last one: every rank then stops on the same execution), or do as ``EagerSGD.synchronize``
does and keep calling with zeros until every rank has arrived.

Every execution reduces one extra element, 1 on ranks whose fresh data is in, so every rank
learns ``active``, the number of ranks that contributed fresh data.

Failures. When a member is lost, the survivors re-form the group: they abandon the
execution in flight (putting their snapshot back into the send buffer, so nothing is lost
locally), agree on the round to resume at (the largest round any survivor had armed), and
go on with a schedule over the survivors (a new *epoch*, which scopes the tags). A survivor
that had not finished the abandoned round skips its result. A rank that closes its
communicator leaves the group the same way. ``res.lost`` names the ranks that left.

Exercise it with ``python -m pytest tests/unit/test_partial.py``.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from mlfabric.collectives.partial import INTERNAL_ACTIVATION, JOIN, QUORUMS, activation_op_count, partial_allreduce
from mlfabric.errors import CollectiveError, CollectiveTimeoutError
from mlfabric.schedule import Recv, Schedule

from .executor import Executor, RunInfo, Waiter, _Run, host_array, message_tag

log = logging.getLogger("mlfabric.runtime.partial")

QUORUM_CHOICES = (*QUORUMS, "all")
# Sequence numbers of partial collectives live in their own space above the communicator's
# (bit 39 set): handle id, epoch and round share the remaining bits.
_PARTIAL_SEQ = 1 << 39
_HANDLE_SHIFT, _EPOCH_SHIFT = 31, 25
_MAX_HANDLES, _MAX_EPOCHS, _MAX_ROUNDS = 1 << 8, 1 << 6, 1 << 25
_AGREE_ROUND = _MAX_ROUNDS - 1  # the round slot of an epoch's agreement messages
_KEEP_DRAINING = 16  # executions whose late activation messages are still discarded
_DRAW_BLOCK = 256  # majority's initiators are drawn this many rounds at a time
# A completed round's rank arms the next round in the first pass at least this long after the
# completion, unless a call or the next round's activation needs it sooner (see _rearm).
_REARM_DELAY_S = 0.005


@dataclass(frozen=True)
class PartialResult:
    """What one call of ``partial_allreduce`` returns."""

    tensor: torch.Tensor       # the reduced result of execution ``round``, same on every rank
    contributed: bool          # this call's tensor is in ``tensor`` (else it waits in the send buffer)
    active: int                # ranks whose fresh data is in ``tensor``
    round: int                 # the execution ``tensor`` comes from
    lost: frozenset[int] = frozenset()  # ranks lost so far (the group shrank without them)


class _HostBuffer:
    """A tensor and the view of its memory the progress thread works on (executor.host_array)."""

    __slots__ = ("tensor", "host")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.host = host_array(tensor)


@dataclass
class _Call:
    future: torch.futures.Future | Waiter
    deadline: float
    fresh: bool


@functools.lru_cache(maxsize=64)
def _schedule(world_size: int, rank: int, count: int, algorithm: str, op: str,
              members: tuple[int, ...], external_activation: bool) -> tuple[Schedule, int]:
    """The persistent schedule and the index of its reduction's start, built once per group
    (re-arming must cost no Python work)."""
    schedule = partial_allreduce(world_size, rank, count, algorithm=algorithm, op=op, members=members,
                                 external_activation=external_activation)
    return schedule, activation_op_count(schedule) - 1


class _Execution(_Run):
    """One execution of a partial schedule: triggers wait for the application, the run is done
    when the reduction is (activation ops may stay unmatched), and the start of the reduction
    fills ``data`` from the send buffer."""

    # Activation receives may still be pending when the round is done (see _Run).
    offers_destinations = False

    def __init__(self, owner: "PartialAllreduce", schedule: Schedule, reduction_start: int,
                 work: torch.Tensor, info: RunInfo) -> None:
        self.owner = owner
        self.reduction_start = reduction_start  # the "activate reduction" Nop
        # Done when the reduction is (the activation's receives may stay open); the reduction's
        # start fills the buffer (on_fire_hook).
        self.required_from = self.hook_index = reduction_start
        super().__init__(owner.executor, schedule, {"data": work}, info, math.inf,
                         torch.futures.Future(), lambda: None)

    def _initial_state(self) -> tuple[tuple[bool, ...], tuple[int, ...]]:
        # The triggers wait for the application's call.
        fired, ready = super()._initial_state()
        triggers = self.schedule.triggers
        return (tuple(f and i not in triggers for i, f in enumerate(fired)),
                tuple(i for i in ready if i not in triggers))

    def start(self, info: RunInfo, deadline: float) -> None:
        super().start(info, deadline)
        self.activated = False

    def trigger(self, initiate: bool = True) -> None:
        """The application called: start the activation broadcast and the reduction
        (``initiate``), or only this rank's part of the reduction (the join trigger: a
        majority rank that is not the round's initiator; schedules without an activation
        broadcast have no join, and their one trigger starts the reduction)."""
        index = INTERNAL_ACTIVATION if initiate or len(self.schedule.triggers) == 1 else JOIN
        if not self.fired[index]:
            self.fired[index] = True
            self.ready.append(index)

    def on_fire_hook(self) -> None:
        self.activated = True
        self.owner._fill(self.arrays["data"])


class PartialAllreduce:
    """A persistent partial allreduce, driven by the executor's progress thread (see module)."""

    tolerates_lost_peers = True
    finished = False
    deadline = math.inf  # the persistent collective never times out; its calls do

    @property
    def wake_at(self) -> float:
        """The earliest deadline of the calls waiting (Executor._pass sleeps until then)."""
        if not self.calls:  # most passes: no call waits
            return math.inf
        return min(call.deadline for call in self.calls)

    def __init__(self, executor: Executor, handle_id: int, *, quorum: str, count: int,
                 dtype: torch.dtype, algorithm: str, op: str, seed: int, description: str) -> None:
        if quorum not in QUORUM_CHOICES:
            raise ValueError(f"unknown quorum {quorum!r}; choose one of {', '.join(QUORUM_CHOICES)}")
        if not 0 <= handle_id < _MAX_HANDLES:
            raise ValueError(f"at most {_MAX_HANDLES} partial collectives per communicator")
        self.executor = executor
        self.transport = executor.transport
        self.rank = executor.rank
        self.handle_id = handle_id
        self.quorum, self.count, self.dtype = quorum, count, dtype
        self.algorithm, self.op, self.seed = algorithm, op, seed
        self.description = description
        self.info = RunInfo(seq=self._seq(0, 0), description=description)
        self.members = tuple(range(self.transport.world_size))
        self.lost: frozenset[int] = frozenset()
        self.epoch = 0
        self._send = _HostBuffer(torch.zeros(count, dtype=dtype))
        self._spare: _HostBuffer | None = _HostBuffer(torch.zeros(count, dtype=dtype))  # the next send buffer, zeroed
        self._snapshot: _HostBuffer | None = None
        self.fresh = False
        self.calls: list[_Call] = []
        # (round, result, active); the result is a numpy copy until a call asks for it.
        self.latest: tuple[int, torch.Tensor | np.ndarray, int] | None = None
        self.round = 0
        self.execution: _Execution | None = None
        # (epoch, (schedule, reduction start)) of the group the last round ran in, and the
        # (channel, tag) of its activation receives.
        self._group: tuple[int, tuple[Schedule, int]] | tuple[None, None] = (None, None)
        self._activation_keys: list[tuple[str, int]] = []
        # Set when a round completed and the next one is not armed yet: from when _rearm may
        # run without being asked. None while a round is armed.
        self._rearm_after: float | None = None
        self._used: _HostBuffer | None = None  # the completed round's send buffer, to zero
        self.agreeing: dict[int, int] | None = None  # peer -> its armed round, while re-forming
        self._commands: deque[tuple[torch.Tensor | np.ndarray, int | None, _Call]] = deque()
        self._lock = threading.Lock()
        # Keys of the activation messages that finished executions may still receive: the
        # mailbox drops them on arrival (Mailbox.discard) for _KEEP_DRAINING executions.
        self._discarding: deque[list[tuple[str, int, int]]] = deque()
        self._broken: CollectiveError | None = None
        self.last_seen = -1  # application side: the last round a call returned
        self._drawn: tuple[tuple[int, int] | None, list[int]] = (None, [])  # ((epoch, block), draws)
        self._arm(0)

    # -- application side (any thread) -------------------------------------------------------

    def call(self, tensor: torch.Tensor, round: int | None, timeout: float, *,
             blocking: bool = False) -> torch.futures.Future | Waiter:
        """Hand ``tensor`` in for round ``round``; the returned future resolves to a
        :class:`PartialResult` (a :class:`~mlfabric.runtime.executor.Waiter` if ``blocking``:
        the caller waits on it at once)."""
        future: torch.futures.Future | Waiter = Waiter() if blocking else torch.futures.Future()
        if self._broken is not None:
            future.set_exception(self._broken)
            return future
        flat = self._host_copy(tensor)
        call = _Call(future, time.monotonic() + timeout, fresh=False)
        with self._lock:
            self._commands.append((flat, round, call))
        self.executor.kick()
        return future

    @property
    def send_buffer(self) -> torch.Tensor:
        """What this rank contributes to the next execution (stale data, or fresh waiting)."""
        return self._send.tensor

    @property
    def snapshot(self) -> torch.Tensor | None:
        """The send buffer the execution in flight contributed (None between executions)."""
        return None if self._snapshot is None else self._snapshot.tensor

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor | np.ndarray:
        """A flat copy of the caller's tensor, as the progress thread works on it (numpy where
        the dtype allows: see executor.host_array). The copy is what lets the caller reuse its
        tensor at once."""
        if tensor.dtype == self.dtype:
            try:  # the common case, a CPU tensor numpy can view; each torch call costs here
                return tensor.numpy().reshape(-1).copy()
            except (TypeError, RuntimeError):  # on a GPU, requires grad, or bfloat16
                pass
        return host_array(tensor.detach().reshape(-1).to("cpu", self.dtype, copy=True))

    # -- progress thread ---------------------------------------------------------------------

    def _seq(self, epoch: int, round: int) -> int:
        return _PARTIAL_SEQ | (self.handle_id << _HANDLE_SHIFT) | (epoch << _EPOCH_SHIFT) | round

    def _initiates(self, round: int) -> bool:
        """Whether this rank's call starts the activation broadcast of ``round``: always with
        solo, only as the round's initiator with majority (else the call joins: see
        ``collectives/partial.py``)."""
        return self.quorum != "majority" or self._initiator(round) == self.rank

    def _initiator(self, round: int) -> int:
        """Majority's designated initiator of ``round``: same seed, same draw on every rank.
        Rounds are drawn in blocks of :data:`_DRAW_BLOCK` (a generator costs more than the
        rest of a call), each block from its own seed, so any round's draw is direct."""
        block, offset = divmod(round, _DRAW_BLOCK)
        key = (self.epoch, block)
        if self._drawn[0] != key:
            rng = np.random.default_rng([self.seed, self.handle_id, self.epoch, block])
            self._drawn = (key, rng.integers(len(self.members), size=_DRAW_BLOCK).tolist())
        return self.members[self._drawn[1][offset]]

    def _arm(self, round: int) -> None:
        if round >= _AGREE_ROUND:
            raise CollectiveError(f"rank {self.rank}: partial allreduce ran out of rounds", rank=self.rank)
        self.round = round
        if self._group[0] != self.epoch:  # the group changed: its schedule (cached per group)
            schedule, start = _schedule(self.transport.world_size, self.rank, self.count + 1, self.algorithm,
                                        self.op, self.members, self.quorum != "all")
            self._group = (self.epoch, (schedule, start))
            self._activation_keys = [(op.channel, op.tag) for op in schedule.ops[:start] if isinstance(op, Recv)]
        schedule, start = self._group[1]
        info = RunInfo(seq=self._seq(self.epoch, round), description=self.description)
        execution = self.execution
        if execution is not None and execution.schedule is schedule and execution.finished:
            # The next round of the same group re-arms the finished execution: its buffer and
            # views are reused (the round's result was copied out), which keeps a round's
            # fixed cost low enough for 32 ranks sharing two cores.
            execution.start(info, math.inf)
        else:
            work = torch.empty(self.count + 1, dtype=self.dtype)
            self.execution = _Execution(self, schedule, start, work, info)

    def _fill(self, work: torch.Tensor | np.ndarray) -> None:
        """The reduction starts: contribute the send buffer, flag whether it holds fresh data."""
        # The spare was zeroed when the previous round completed, off the critical path.
        spare = self._spare if self._spare is not None else _HostBuffer(torch.zeros(self.count, dtype=self.dtype))
        self._snapshot, self._send, self._spare = self._send, spare, None
        work[:self.count] = self._snapshot.host
        work[self.count] = 1 if self.fresh else 0

    def advance(self, version: int) -> bool:
        execution = self.execution
        transport = self.transport
        if (execution is not None and not self.calls and not self._commands and self._rearm_after is None
                and self.agreeing is None and not execution.arrived and not execution.ready
                and not execution.pending_sends and not transport.mailbox.queued
                and not transport.lost_peers and not transport.departed_peers):
            # Nothing can have happened to this collective: no call, no message for it (routed
            # or queued), no send to complete, no peer gone. Most passes are for another
            # collective, and this test is cheaper than looking.
            return False
        if self._rearm_after is not None and (time.monotonic() >= self._rearm_after or self._next_round_arrived()):
            self._rearm(version)
        # While the group re-forms the next round is unknown: calls wait in the queue.
        progressed = self._take_commands() if self.agreeing is None else False
        transport = self.transport
        if (transport.lost_peers or transport.departed_peers) and transport.gone_peers & set(self.members):
            self._reform()
            progressed = True
        if self.agreeing is not None:
            return self._agree() or progressed
        execution = self.execution
        assert execution is not None
        if self._rearm_after is None:
            progressed |= execution.advance(version)
            if execution.finished:
                self._complete_round(execution)
                progressed = True
        if self.calls:
            self._expire_calls()
        return progressed

    def _next_round_arrived(self) -> bool:
        """Whether an activation message of the round after the completed one is queued."""
        queued = self.transport.mailbox.queued
        base = message_tag(self._seq(self.epoch, self.round + 1), 0)
        return any((channel, base | tag) in queued for channel, tag in self._activation_keys)

    def _rearm(self, version: int) -> None:
        """Arm the round after the completed one and post its activation receives.

        Why not at completion: a round completes on every rank within a few milliseconds, in
        a wave bound by the CPU the ranks spend (32 processes on 2 cores), and what a rank
        does there delays the ranks still waiting for the result. So the work that is not
        urgent — dropping the round's late activations, zeroing its send buffer, arming and
        posting the next round's receives — is left to the first pass :data:`_REARM_DELAY_S`
        after the completion (passes come with every message and call; none is added for
        it), unless a call or the next round's activation needs it sooner."""
        execution = self.execution
        assert execution is not None and self._rearm_after is not None
        self._rearm_after = None
        self._discard_late_messages(execution)
        self._recycle_used()
        self._arm(self.round + 1)
        # Post the next round's activation receives now, instead of when its activation
        # arrives (on the critical path).
        assert self.execution is not None
        self.execution.advance(version)

    def _recycle_used(self) -> None:
        if self._used is not None:
            self._used.host[:] = 0
            self._spare, self._used = self._used, None

    def _take_commands(self) -> bool:
        if not self._commands:  # lock-free test first: most wake-ups bring no call
            return False
        if self._rearm_after is not None:  # a call is for the next round: arm it now
            self._rearm(self.transport.mailbox.version)
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for flat, round, call in commands:
            try:
                self._accept(flat, round, call)
            except Exception as exc:  # a bad argument fails this call only
                call.future.set_exception(exc)
        return bool(commands)

    def _accept(self, flat: torch.Tensor | np.ndarray, round: int | None, call: _Call) -> None:
        if len(flat) != self.count:
            raise ValueError(f"partial_allreduce of {len(flat)} elements on a collective of {self.count}")
        wanted = self.last_seen + 1 if round is None else round
        if wanted < 0:
            raise ValueError(f"round must be >= 0, got {round}")
        if wanted > self.round:
            raise ValueError(f"rank {self.rank}: round {wanted} requested but round {self.round} has not "
                             "executed yet; call rounds in order")
        execution = self.execution
        self._send.host += flat
        if wanted < self.round and self.latest is not None and self.latest[0] >= wanted:
            # Too late for the execution that round named: the latest result answers, the
            # data waits for the next execution.
            self._resolve(call, contributed=False)
            return
        if execution is not None and execution.activated:
            self.calls.append(call)  # the execution in flight answers it; the data waits
            return
        # The round armed now (also when the round asked for was skipped by a re-formation).
        call.fresh = True
        self.fresh = True
        self.calls.append(call)
        assert execution is not None
        execution.trigger(initiate=self._initiates(self.round))

    def _resolve(self, call: _Call, *, contributed: bool) -> None:
        assert self.latest is not None
        round, result, active = self.latest
        if isinstance(result, np.ndarray):  # made a tensor once, when the first call takes it
            result = torch.from_numpy(result)
            self.latest = (round, result, active)
        self.last_seen = max(self.last_seen, round)
        if not call.future.done():
            call.future.set_result(PartialResult(tensor=result, contributed=contributed, active=active,
                                                 round=round, lost=self.lost))

    def _complete_round(self, execution: _Execution) -> None:
        work = execution.arrays["data"]
        # A copy: the buffer is the next round's (and the caller may keep the result). The
        # tensor around a numpy copy is made by the call that takes it (_resolve): a rank that
        # has not called yet spends no torch op on the round's critical path.
        result = work[:self.count].copy() if isinstance(work, np.ndarray) else work[:self.count].clone()
        self.latest = (self.round, result, int(work[self.count]))
        self.fresh = False
        calls, self.calls = self.calls, []
        for call in calls:
            # A fresh call was accepted before the reduction started, so its data is in.
            self._resolve(call, contributed=call.fresh)
        # Zeroing the round's send buffer and arming the next round wait (_rearm).
        self._used, self._snapshot = self._snapshot, None  # (None if the group re-formed after the fill)
        self._rearm_after = time.monotonic() + _REARM_DELAY_S

    def _discard_late_messages(self, execution: _Execution) -> None:
        """Activation messages a finished execution did not take (several initiators) may
        still arrive: the mailbox drops them, so no progress-loop wake-up polls for them."""
        if not execution.pending_recvs:
            return
        ops, base = execution.schedule.ops, execution.tag_base
        keys = [(ops[i].channel, base | ops[i].tag, ops[i].peer) for i in execution.pending_recvs]
        mailbox = self.transport.mailbox
        mailbox.discard(keys)
        self._discarding.append(keys)
        if len(self._discarding) > _KEEP_DRAINING:
            mailbox.forget(self._discarding.popleft())

    def _expire_calls(self) -> None:
        now = time.monotonic()
        for call in [c for c in self.calls if now > c.deadline]:
            self.calls.remove(call)
            call.future.set_exception(CollectiveTimeoutError(
                f"rank {self.rank}: partial allreduce round {self.round} ({self.quorum}) timed out; "
                f"{'waiting for the initiator, rank ' + str(self._initiator(self.round)) if self.quorum == 'majority' else 'no activation arrived'}",
                rank=self.rank))

    # -- failures ----------------------------------------------------------------------------

    def _reform(self) -> None:
        """Drop the lost members, abandon the execution in flight, start agreeing on a round."""
        gone = self.transport.gone_peers
        crashed = sorted(peer for peer in gone & set(self.members) if peer in self.transport.lost_peers)
        self.lost = frozenset(gone)
        self.members = tuple(m for m in self.members if m not in self.lost)
        # A crash is worth a warning; a rank that closed its communicator (the normal end of
        # a job, ranks finishing at different times) is not.
        log.log(logging.WARNING if crashed else logging.INFO,
                "rank %d: %s continues without rank(s) %s (%s)", self.rank, self.description, sorted(self.lost),
                f"lost: {crashed}" if crashed else "they closed their communicators")
        if self._snapshot is not None:
            self._send.host += self._snapshot.host  # the abandoned contribution is not lost
            self._snapshot.host[:] = 0
            self._spare, self._snapshot = self._snapshot, None
        if self._rearm_after is not None:
            # The last round completed here and the next is not armed yet: it is the round
            # this rank reports (the agreement resumes at the largest round armed).
            self._rearm_after = None
            if self.execution is not None:
                self._discard_late_messages(self.execution)
            self._recycle_used()
            self.round += 1
        if self.execution is not None:
            self.execution.unpost()
        self.execution = None
        self.epoch += 1
        if self.epoch >= _MAX_EPOCHS:
            raise CollectiveError(f"rank {self.rank}: too many group changes", rank=self.rank)
        self.agreeing = {}
        tag = message_tag(self._seq(self.epoch, _AGREE_ROUND), 0)
        payload = struct.pack("<q", self.round)
        for peer in self.members:
            if peer != self.rank:
                self.transport.send(peer, tag, payload, channel=self.transport.channels[0])

    def _agree(self) -> bool:
        assert self.agreeing is not None
        tag = message_tag(self._seq(self.epoch, _AGREE_ROUND), 0)
        progressed = False
        for peer in self.members:
            if peer == self.rank or peer in self.agreeing:
                continue
            msg = self.transport.mailbox.take(self.transport.channels[0], tag, peer)
            if msg is not None:
                self.agreeing[peer] = struct.unpack("<q", bytes(msg.payload))[0]
                progressed = True
        self._expire_calls()
        if len(self.agreeing) < len(self.members) - 1:
            return progressed
        resume = max([self.round, *self.agreeing.values()])
        self.agreeing = None
        if resume > self.round and self.latest is not None:
            # This rank had not finished the abandoned round: it skips it; its calls get the
            # latest result it has and their data stays in the send buffer.
            calls, self.calls = self.calls, []
            for call in calls:
                self._resolve(call, contributed=False)
        # Every call still waiting is answered by the resumed round, which contributes its data
        # (in the send buffer, with the abandoned snapshot): it is fresh there. Calls that were
        # waiting on the abandoned execution count too — else, with majority, an initiator
        # whose application is blocked in such a call would never activate the resumed round
        # and every survivor would time out (regression: test_partial.py, re-formation tests).
        for call in self.calls:
            call.fresh = True
        self._arm(resume)
        self.fresh = bool(self.calls)
        if self.calls:
            assert self.execution is not None
            self.execution.trigger(initiate=self._initiates(resume))
        return True

    # -- executor protocol -------------------------------------------------------------------

    def fail(self, error: CollectiveError) -> None:
        self._broken = error
        if self.execution is not None:
            self.execution.unpost()
        calls, self.calls = self.calls, []
        with self._lock:
            calls += [call for _, _, call in self._commands]
            self._commands.clear()
        for call in calls:
            if not call.future.done():
                call.future.set_exception(error)

    def waiting_on(self) -> str:
        return f"partial allreduce round {self.round}"
