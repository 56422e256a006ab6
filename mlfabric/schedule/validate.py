"""Prove a set of per-rank schedules well-formed before anything runs them.

Checks, in order:

1. the set is complete (one schedule per rank, all of the same collective and world size);
2. every send has exactly one matching recv — same (source, destination, channel, tag) —
   of the same size, and every recv has a matching send;
3. no rank has two ops that may run concurrently and touch overlapping memory with at least
   one write (a race the executor's parallel progress would expose);
4. the set cannot deadlock: executing it with eager (buffered) sends, every op completes.

Given the host of every rank (``hosts=``), it also knows the host-internal hop: it counts
what stays on a host (shared memory) and what crosses the network, and checks each rank's
stated ``Cost.elements_across_hosts`` against its ops (hierarchical collectives promise that
only the inter-host part reaches the network).

Any-of dependencies are honoured in step 4. Sends are modelled as eager (buffered), which is
what every mlfabric transport provides.

Exercise it with ``python -m pytest tests/unit/test_schedule.py``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from .ir import DepMode, Op, Recv, Schedule, Send


class ScheduleError(ValueError):
    """A schedule set is malformed; the message names the rank and op."""


@dataclass(frozen=True, kw_only=True)
class ValidationReport:
    world_size: int
    ops: int
    messages: int
    elements_moved: int
    #: With ``hosts``: elements moved between ranks of one host, and between hosts.
    elements_within_hosts: int | None = None
    elements_across_hosts: int | None = None


MessageKey = tuple[int, int, str, int]  # (src, dst, channel, tag)


def validate(schedules: Sequence[Schedule], *, check_races: bool = True,
             hosts: Sequence[int] | None = None) -> ValidationReport:
    """Raise :class:`ScheduleError` unless ``schedules`` (index = rank) is well-formed;
    ``hosts[r]``, the host of rank ``r``, adds the per-hop counts and checks (module docstring)."""
    world_size = len(schedules)
    if world_size == 0:
        raise ScheduleError("empty schedule set")
    names = {sched.name for sched in schedules}
    if len(names) > 1:
        raise ScheduleError(f"schedules of different collectives in one set: {sorted(names)}")
    for rank, sched in enumerate(schedules):
        if sched.rank != rank or sched.world_size != world_size:
            raise ScheduleError(
                f"schedule at index {rank} claims rank {sched.rank} of {sched.world_size}; "
                f"expected rank {rank} of {world_size}"
            )
    sends, recvs = _match_messages(schedules)
    if check_races:
        for sched in schedules:
            _check_races(sched)
    _check_progress(schedules)
    within = across = None
    if hosts is not None:
        within, across = _check_hops(schedules, hosts)
    return ValidationReport(
        world_size=world_size,
        ops=sum(len(s.ops) for s in schedules),
        messages=len(sends),
        elements_moved=sum(schedules[src].ops[i].src.length for (src, _, _, _), i in sends.items()),
        elements_within_hosts=within,
        elements_across_hosts=across,
    )


def _check_hops(schedules: Sequence[Schedule], hosts: Sequence[int]) -> tuple[int, int]:
    """Elements moved within hosts and across them; raises where a rank's stated
    ``elements_across_hosts`` differs from what its sends carry off its host."""
    if len(hosts) != len(schedules):
        raise ScheduleError(f"hosts names {len(hosts)} ranks' hosts for {len(schedules)} schedules")
    within = across = 0
    for rank, sched in enumerate(schedules):
        mine, theirs = sched.elements_sent_by_hop(hosts)
        stated = sched.cost.elements_across_hosts
        if stated is not None and stated != theirs:
            raise ScheduleError(
                f"{sched.name} rank {rank} (host {hosts[rank]}): states {stated} elements sent to other hosts, "
                f"but its sends carry {theirs} off the host ({mine} stay on it)")
        within += mine
        across += theirs
    return within, across


def _match_messages(
    schedules: Sequence[Schedule],
) -> tuple[dict[MessageKey, int], dict[MessageKey, int]]:
    sends: dict[MessageKey, int] = {}
    recvs: dict[MessageKey, int] = {}
    for rank, sched in enumerate(schedules):
        for index, op in enumerate(sched.ops):
            if isinstance(op, Send):
                key = (rank, op.peer, op.channel, op.tag)
                table = sends
            elif isinstance(op, Recv):
                key = (op.peer, rank, op.channel, op.tag)
                table = recvs
            else:
                continue
            if key in table:
                raise ScheduleError(
                    f"{sched.name} rank {rank}: ops {table[key]} and {index} both "
                    f"{type(op).__name__.lower()} tag {op.tag} on channel {op.channel!r} "
                    f"with peer {op.peer}; tags must be unique per peer and channel"
                )
            table[key] = index
    for key, index in sends.items():
        src, dst, channel, tag = key
        if key not in recvs:
            raise ScheduleError(
                f"rank {src} op {index} sends tag {tag} to rank {dst} on channel {channel!r}, "
                f"but rank {dst} never receives it"
            )
        send_len = schedules[src].ops[index].src.length
        recv_len = schedules[dst].ops[recvs[key]].dst.length
        if send_len != recv_len:
            raise ScheduleError(
                f"size mismatch: rank {src} op {index} sends {send_len} elements (tag {tag}, "
                f"channel {channel!r}) but rank {dst} op {recvs[key]} receives {recv_len}"
            )
    for key, index in recvs.items():
        if key not in sends:
            src, dst, channel, tag = key
            raise ScheduleError(
                f"rank {dst} op {index} receives tag {tag} from rank {src} on channel "
                f"{channel!r}, but rank {src} never sends it"
            )
    return sends, recvs


def _check_races(sched: Schedule) -> None:
    """Two ops touching overlapping memory (one writing) must be ordered by dependencies."""
    n = len(sched.ops)
    # ancestors[i]: bitset of ops that certainly complete before op i starts. Any-of deps give
    # only the ancestors common to all alternatives.
    ancestors: list[int] = [0] * n
    for i, op in enumerate(sched.ops):
        if not op.deps:
            continue
        sets = [ancestors[d] | (1 << d) for d in op.deps]
        if op.mode is DepMode.ALL:
            acc = 0
            for s in sets:
                acc |= s
        else:
            acc = sets[0]
            for s in sets[1:]:
                acc &= s
        ancestors[i] = acc
    regions = []  # (op index, slice, is_write)
    for i, op in enumerate(sched.ops):
        for sl in op.writes():
            regions.append((i, sl, True))
        for sl in op.reads():
            regions.append((i, sl, False))
    by_buffer: dict[str, list] = {}
    for entry in regions:
        by_buffer.setdefault(entry[1].buffer, []).append(entry)
    for entries in by_buffer.values():
        entries.sort(key=lambda e: e[1].offset)
        # Sweep: only compare entries whose intervals overlap.
        for a in range(len(entries)):
            i, sa, wa = entries[a]
            for b in range(a + 1, len(entries)):
                j, sb, wb = entries[b]
                if sb.offset >= sa.end:
                    break
                if i == j or not (wa or wb) or not sa.overlaps(sb):
                    continue
                lo, hi = min(i, j), max(i, j)
                if not (ancestors[hi] >> lo) & 1:
                    raise ScheduleError(
                        f"{sched.name} rank {sched.rank}: ops {lo} ({_describe(sched.ops[lo])}) and "
                        f"{hi} ({_describe(sched.ops[hi])}) touch overlapping memory "
                        f"{sa} / {sb} without a dependency between them"
                    )


def walk(schedules: Sequence[Schedule],
         on_fire: Callable[[int, int, Op], None] | None = None, *,
         triggered: Callable[[int, int], bool] | None = None) -> list[list[bool]]:
    """Execute a schedule set in one thread with eager (buffered) sends.

    Trigger ops (:attr:`Schedule.triggers`) fire when ``triggered(rank, index)`` says so
    (default: all of them, i.e. every rank initiating).

    Fires every op whose all-of / any-of dependencies are met — each op once (consumable) —
    and a receive only after its matching send. ``on_fire(rank, index, op)`` is called as
    each op fires, in an order that respects those rules (the reference interpreter moves
    data there). Returns, per rank, which ops ran; an op that never ran is deadlocked.
    """
    done = [[False] * len(s.ops) for s in schedules]
    waiting_deps = [[len(op.deps) for op in s.ops] for s in schedules]
    dependents = [s.dependents() for s in schedules]
    sent: set[MessageKey] = set()
    # Recvs whose deps are satisfied but whose message has not been sent yet.
    parked: dict[MessageKey, tuple[int, int]] = {}
    ready: deque[tuple[int, int]] = deque(
        (rank, i) for rank, s in enumerate(schedules) for i, op in enumerate(s.ops)
        if not op.deps and (triggered is None or i not in s.triggers or triggered(rank, i))
    )
    while ready:
        rank, i = ready.popleft()
        if done[rank][i]:
            continue  # consumable: an any-of op fires once
        op = schedules[rank].ops[i]
        if isinstance(op, Recv):
            key = (op.peer, rank, op.channel, op.tag)
            if key not in sent:
                parked[key] = (rank, i)
                continue
        done[rank][i] = True
        if on_fire is not None:
            on_fire(rank, i, op)
        if isinstance(op, Send):
            key = (rank, op.peer, op.channel, op.tag)
            sent.add(key)
            if key in parked:
                ready.append(parked.pop(key))
        for j in dependents[rank][i]:
            dep_op = schedules[rank].ops[j]
            if dep_op.mode is DepMode.ANY:
                ready.append((rank, j))
            else:
                waiting_deps[rank][j] -= 1
                if waiting_deps[rank][j] == 0:
                    ready.append((rank, j))
    return done


def _check_progress(schedules: Sequence[Schedule]) -> None:
    """Run the set to completion with eager sends; anything left over is a deadlock."""
    done = walk(schedules)
    stuck = [
        (rank, i) for rank, flags in enumerate(done) for i, flag in enumerate(flags) if not flag
    ]
    if stuck:
        shown = "; ".join(
            f"rank {r} op {i} ({_describe(schedules[r].ops[i])})" for r, i in stuck[:6]
        )
        raise ScheduleError(
            f"deadlock: {len(stuck)} ops can never run, e.g. {shown}"
        )


def _describe(op: Op) -> str:
    if isinstance(op, Send):
        return f"send tag {op.tag} to {op.peer} on {op.channel!r}"
    if isinstance(op, Recv):
        return f"recv tag {op.tag} from {op.peer} on {op.channel!r}"
    return type(op).__name__.lower()
