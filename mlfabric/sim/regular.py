"""Task graphs of rank-symmetric collectives built from one rank's schedule (no schedule per rank).

:func:`~mlfabric.sim.graph.compile_schedules` walks every op of every rank's
:class:`~mlfabric.schedule.Schedule` in Python: a ring allreduce over 1,024 ranks is 4.2 M ops,
~90 s and ~5 GB of op objects before the engine starts (issue #37). A ring is the same schedule
on every rank up to a rotation: rank ``r``'s op ``i`` is rank 0's op ``i`` with its peer and
its data segment shifted by ``r``. :func:`ring_graph` builds rank 0's schedule (and ranks 1
and ``n-1``'s, to check the rotation holds), then writes the whole graph with numpy:
the same arrays, in the same order, as ``compile_schedules`` of every rank's schedule
(``tests/unit/test_sim_scale.py`` compares them field by field), in a few seconds for 1,024
ranks. :func:`digit_exchange_graph` does the same for BML's BCube exchange and the
hierarchical allreduce, whose ranks are rank 0 translated digit by digit (peers' digits moved,
slices the blocks the moved digits name): BCube(8,4)'s 4,096 ranks (1.8 M ops) in ~1 s instead
of ~26 s of CPU. Both write through one helper (``_template_graph``) and check the symmetry on
a few ranks' real schedules first. Anything they do not recognise returns None and the caller
compiles the schedules.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim_scale.py -q -k "regular or digit"
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mlfabric.collectives import build
from mlfabric.collectives.bcube import AGGREGATION, DigitExchange, decode_part_tag, exchange_parts
from mlfabric.collectives.partition import pieces, subdivide
from mlfabric.collectives.ring import default_chunks
from mlfabric.schedule import DepMode, Recv, Schedule, Send

from .compute import ComputeModel
from .graph import DELAY, TRANSFER, GraphBuilder, TaskGraph

__all__ = ["digit_exchange_graph", "ring_graph"]

# Below this many ranks compiling the schedules is fast enough, and the rotation check costs
# as much as it saves.
_MIN_WORLD = 64


def _nic_of(channel: str) -> int:
    return int(channel) if channel.isdigit() else -1


def _ring_segments(world: int, count: int, chunks: int) -> tuple[np.ndarray, list[list[Any]]]:
    segs = [subdivide(s, chunks) for s in pieces(count, world)]
    lengths = np.array([[c.length for c in seg] for seg in segs], dtype=np.int64)
    return lengths, segs


def _template(schedule: Schedule, world: int, chunks: int) -> dict[str, np.ndarray] | None:
    """Rank 0's ring ops as arrays, with each op's (segment, chunk) from the ring's layout;
    None if the schedule is not laid out as ``ring_allreduce`` lays it out."""
    ops = schedule.ops
    per_phase = (world - 1) * chunks
    if len(ops) != 4 * per_phase:
        return None
    owned = 1 % world
    i = np.arange(len(ops))
    pair, is_recv = i // 2, i % 2
    phase, within = pair // per_phase, pair % per_phase
    step, chunk = within // chunks, within % chunks
    # Reduce-scatter sends segment owned-1-step and receives owned-2-step; the allgather
    # sends owned-step and receives owned-1-step (mlfabric.collectives.ring).
    segment = (owned - 1 - step - is_recv + phase) % world
    peer = np.empty(len(ops), dtype=np.int64)
    tag = np.empty(len(ops), dtype=np.int64)
    for index, op in enumerate(ops):
        want = Recv if is_recv[index] else Send
        if type(op) is not want:
            return None
        peer[index] = op.peer
        tag[index] = op.tag
    return {"segment": segment, "chunk": chunk, "is_recv": is_recv.astype(bool), "peer": peer, "tag": tag}


def _rotated_matches(schedule: Schedule, base: Schedule, template: dict[str, np.ndarray], shift: int, world: int,
                     segs: list[list[Any]]) -> bool:
    """Rank ``shift``'s schedule is rank 0's rotated by ``shift`` (peers and segments)."""
    if len(schedule.ops) != len(base.ops):
        return False
    seg = (template["segment"] + shift) % world
    for index, (op, op0) in enumerate(zip(schedule.ops, base.ops)):
        if type(op) is not type(op0) or op.tag != op0.tag or op.channel != op0.channel or op.deps != op0.deps \
                or op.mode != op0.mode or op.peer != (op0.peer + shift) % world:
            return False
        data = op.dst if isinstance(op, Recv) else op.src
        if data != segs[seg[index]][template["chunk"][index]]:
            return False
        if isinstance(op, Recv) and op.reduce != op0.reduce:
            return False
    return True


def ring_graph(world: int, count: int, *, itemsize: int = 4, placement: Sequence[int] | np.ndarray | None = None,
               compute: ComputeModel | None = None, seed: int = 0, priority: int = 0, name: str = "allreduce:ring",
               chunks: int | None = None, min_world: int = _MIN_WORLD, **options: Any) -> TaskGraph | None:
    """``compile_schedules([build("allreduce:ring", world, r, count, ...) for r in range(world)], ...)``
    without the per-rank schedules; None when the ring's schedule is not the rotation this
    relies on (or ``world`` is small): the caller then compiles the schedules."""
    if world < max(min_world, 2) or set(options) - {"op", "channel"}:
        return None
    chunks = chunks or default_chunks(count, world)
    s0 = build("allreduce:ring", world, 0, count, chunks=chunks, **options)
    lengths, segs = _ring_segments(world, count, chunks)
    template = _template(s0, world, chunks)
    if template is None:
        return None
    # Rank 0's own layout, then the rotation on two more ranks.
    if not _rotated_matches(s0, s0, template, 0, world, segs):
        return None
    for shift in (1, world - 1):
        if not _rotated_matches(build("allreduce:ring", world, shift, count, chunks=chunks, **options), s0, template,
                                shift, world, segs):
            return None
    peer_rel = template["peer"]  # rank 0's peer = the offset of every rank's peer
    ranks = np.arange(world, dtype=np.int64)
    peer = (ranks[:, None] + peer_rel[None, :]) % world
    seg = (template["segment"][None, :] + ranks[:, None]) % world
    elements = lengths[seg, template["chunk"][None, :]]
    return _template_graph(s0.ops, peer, elements, lambda offset: (-offset) % world, placement=placement,
                           itemsize=itemsize, compute=compute, seed=seed, priority=priority, name=name)


def _template_graph(ops: Sequence[Any], peer: np.ndarray, elements: np.ndarray, inverse: Callable[[int], int], *,
                    placement: Sequence[int] | np.ndarray | None, itemsize: int, compute: ComputeModel | None,
                    seed: int, priority: int, name: str) -> TaskGraph | None:
    """The task graph of ``world = len(peer)`` ranks whose schedules are ``ops`` (rank 0's
    Sends and Recvs) with rank ``r``'s peers ``peer[r]`` and data lengths ``elements[r]``
    (the Send's source, the Recv's destination), written array for array as
    :func:`~mlfabric.sim.graph.compile_schedules` writes it. Rank 0 must be the identity of a
    group acting on the ranks (``peer[r, i]`` = rank ``r`` moved by rank 0's peer
    ``peer[0, i]``) and ``inverse`` the inverse of an element, so that the Send matching
    rank ``r``'s Recv from ``peer[r, i]`` is the Send to ``inverse(peer[0, i])`` on rank
    ``peer[r, i]``. None when a Recv has no partner (compiling the schedules names it)."""
    world, m = peer.shape
    hosts = np.arange(world, dtype=np.int64) if placement is None else np.asarray(placement, dtype=np.int64)
    if hosts.shape != (world,):
        raise ValueError(f"placement must give one host per rank ({world}), got {hosts.shape}")
    if itemsize <= 0:
        raise ValueError(f"itemsize must be > 0 bytes, got {itemsize}")
    ranks = np.arange(world, dtype=np.int64)
    is_recv = np.array([type(op) is Recv for op in ops], dtype=bool)
    is_send = ~is_recv
    peer_rel = peer[0]
    tags = [op.tag for op in ops]
    # Per-op facts of the template, then (rank, op) grids flattened rank-major (task r*m + i).
    size = np.where(is_send[None, :], elements * itemsize, 0).astype(np.float64).ravel()
    kinds = np.where(is_send, TRANSFER, DELAY).astype(np.int8)
    total = world * m
    duration = np.zeros((world, m))
    if compute is not None:
        speeds = compute.worker_speeds(world, seed)
        reduce_recv = np.array([isinstance(op, Recv) and op.reduce is not None for op in ops])
        if reduce_recv.any():
            nbytes = (elements[:, reduce_recv] * itemsize).astype(np.float64)
            duration[:, reduce_recv] = compute.op_seconds(nbytes, kind="reduce", speed=speeds[:, None])
    channels = [op.channel for op in ops]
    nic = np.array([_nic_of(c) if s else -1 for c, s in zip(channels, is_send)], dtype=np.int64)
    # Connections: each rank's (peer, channel) pairs in first-appearance order; rank r's are
    # numbered r*K.. as compile_schedules' global first-appearance order numbers them.
    local: dict[tuple[int, str], int] = {}
    conn_local = np.full(m, -1, dtype=np.int64)
    for index in np.flatnonzero(is_send).tolist():
        conn_local[index] = local.setdefault((int(peer_rel[index]), channels[index]), len(local))
    n_local = len(local)
    connection = np.where(is_send[None, :], ranks[:, None] * n_local + conn_local[None, :], -1).ravel()

    b = GraphBuilder(name)
    label_ids = {label: b._label(label) for label in ("Send", "Recv", "Reduce", "Copy", "Nop")}
    label = np.where(is_send, label_ids["Send"], label_ids["Recv"]).astype(np.int16)
    src = np.where(is_send[None, :], hosts[:, None], -1).ravel()
    dst = np.where(is_send[None, :], hosts[peer], -1).ravel()
    b._add(total, kind=np.tile(kinds, world), src=src, dst=dst, size_bytes=size, duration_s=duration.ravel(),
           nic=np.tile(nic, world), priority=np.tile(np.where(is_send, priority, 0), world), job=0,
           rank=np.repeat(ranks, m), peer=peer.ravel(), op=np.tile(np.arange(m), world),
           label=np.tile(label, world), connection=connection)

    # Edges in compile_schedules' order: compute starts, every op's own dependencies
    # (rank-major), the Send->Recv matches (in Recv order), any-of dependencies.
    dep_local_before, dep_local_after, any_local_before, any_local_after, roots = [], [], [], [], []
    for index, op in enumerate(ops):
        if op.deps:
            target = any_local_before if op.mode is DepMode.ANY else dep_local_before
            (any_local_after if op.mode is DepMode.ANY else dep_local_after).extend([index] * len(op.deps))
            target.extend(op.deps)
        else:
            roots.append(index)
    base = (ranks * m)[:, None]
    # The k-th Recv of rank r keyed (peer, channel, tag) takes the k-th Send of its peer keyed
    # (r, channel, tag): in template terms, a Send whose peer is the inverse of the Recv's.
    sends: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    for index in np.flatnonzero(is_send).tolist():
        sends[(int(peer_rel[index]), channels[index], tags[index])].append(index)
    seen: dict[tuple[int, str, int], int] = defaultdict(int)
    recv_ops, send_ops = [], []
    for index in np.flatnonzero(is_recv).tolist():
        key = (int(peer_rel[index]), channels[index], tags[index])
        partner = sends.get((inverse(key[0]), key[1], key[2]), [])
        if seen[key] >= len(partner):
            return None  # unmatched: compile_schedules names the op
        recv_ops.append(index)
        send_ops.append(partner[seen[key]])
        seen[key] += 1
    recv_ops_a, send_ops_a = np.array(recv_ops, dtype=np.int64), np.array(send_ops, dtype=np.int64)
    match_after = (base + recv_ops_a[None, :]).ravel()
    match_before = (peer[:, recv_ops_a] * m + send_ops_a[None, :]).ravel()
    if compute is not None:
        start_times = compute.compute_times(1, world, seed)[0]
        if roots:
            starts = b.add_delays(start_times, rank=ranks, label="compute")
            roots_a = np.array(roots, dtype=np.int64)
            b.add_edges(np.repeat(starts, roots_a.size), (base + roots_a[None, :]).ravel())
    before = np.concatenate([(base + np.array(dep_local_before, dtype=np.int64)[None, :]).ravel(), match_before])
    after = np.concatenate([(base + np.array(dep_local_after, dtype=np.int64)[None, :]).ravel(), match_after])
    if before.size:
        b.add_edges(before, after)
    if any_local_before:
        b.add_edges((base + np.array(any_local_before)[None, :]).ravel(), (base + np.array(any_local_after)[None, :]).ravel(),
                    any_of=True)
    graph = b.build()
    return replace(graph, flow_key=np.where(graph.connection >= 0, -1 - graph.connection, graph.flow_key))


def _digits(ranks: np.ndarray, radices: Sequence[int]) -> np.ndarray:
    """``(len(ranks), levels)`` digits, least significant first (``DigitExchange.digits``)."""
    out = np.empty((ranks.size, len(radices)), dtype=np.int64)
    rest = ranks.astype(np.int64)
    for level, radix in enumerate(radices):
        rest, out[:, level] = np.divmod(rest, radix)
    return out


def _number(digits: np.ndarray, radices: Sequence[int]) -> np.ndarray:
    """Inverse of :func:`_digits` over the last axis."""
    value = np.zeros(digits.shape[:-1], dtype=np.int64)
    for level in reversed(range(len(radices))):
        value = value * radices[level] + digits[..., level]
    return value


def _exchange_blocks(ops: Sequence[Any], parts: list[DigitExchange], peer: np.ndarray,
                     digits: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(offset, length)`` grids ``(world, ops)`` of the slice every rank's op ``i`` moves,
    from the layout of :mod:`mlfabric.collectives.bcube`; None if an op's tag is not one of it.

    An op of (thread ``t``, stage, step ``w``) moves the pieces of thread ``t`` whose digits
    ``j_0 .. j_{m-1}`` (thread ``t``'s correction order) are those of one host ``Y``: ``m = w+1``
    in the aggregation, ``m = L-w`` in the broadcast; ``Y`` is the peer for an aggregation
    Send and a broadcast Recv (the peer's pieces), the rank itself otherwise (its own). The
    peer differs from the rank only in digit ``j_{m-1}``, so both readings agree with the
    builder's ``block(t, fixed + [digit])``."""
    first_part = parts[0]
    levels, threads, radices = first_part.levels, first_part.threads, first_part.radices
    world = first_part.world_size
    offset = np.empty(peer.shape, dtype=np.int64)
    length = np.empty(peer.shape, dtype=np.int64)
    bounds_of = [np.asarray(ex._offsets, dtype=np.int64) for ex in parts]
    for index, op in enumerate(ops):
        part, thread, stage, step = decode_part_tag(op.tag, levels, threads)
        if not (0 <= part < len(parts) and 0 <= thread < threads and step < levels):
            return None
        ex = parts[part]
        m = step + 1 if stage == AGGREGATION else levels - step
        uses_peer = (stage == AGGREGATION) == (type(op) is Send)
        order = ex.order(thread)
        host_digits = digits[peer[:, index]] if uses_peer else digits
        position = np.zeros(world, dtype=np.int64)
        span = world
        for level in order[:m]:
            span //= radices[level]
            position += host_digits[:, level] * span
        bounds = bounds_of[part]
        first = thread * world + position
        offset[:, index] = ex.base + bounds[first]
        length[:, index] = bounds[first + span] - bounds[first]
    return offset, length


def digit_exchange_graph(kind: str, world: int, count: int, *, itemsize: int = 4,
                         placement: Sequence[int] | np.ndarray | None = None, compute: ComputeModel | None = None,
                         seed: int = 0, priority: int = 0, name: str | None = None, min_world: int = _MIN_WORLD,
                         checks: int = 8, **options: Any) -> TaskGraph | None:
    """``compile_schedules([build(kind, world, r, count, **options) for r in range(world)], ...)``
    for BML's ``allreduce:bcube`` and ``allreduce:hierarchical`` without the per-rank schedules.

    Both are the same digit exchange on every rank up to a translation: rank ``r``'s schedule
    is rank 0's with every peer's digits moved by ``r``'s (digit-wise, modulo each radix) and
    every slice the block of pieces those digits name. The graph is written from rank 0's
    schedule; rank 0's, the last rank's and ``checks`` more ranks' built schedules are compared
    op for op (type, tag, channel, dependencies, reduction, peer, slice) with what the
    translation predicts. None when they differ, when ``world`` is small or an option is not
    one this knows: the caller then compiles the schedules."""
    if world < max(min_world, 2):
        return None
    if kind == "allreduce:bcube":
        if set(options) - {"n", "k", "op", "channels", "parts"} or "n" not in options or "k" not in options:
            return None
        n, k = int(options["n"]), int(options["k"])
        if n < 2 or k < 1 or world != n**k:
            return None
        radices, threads = (n,) * k, k
    elif kind == "allreduce:hierarchical":
        if set(options) - {"radices", "op", "channel"} or "radices" not in options:
            return None
        radices, threads = tuple(int(r) for r in options["radices"]), 1  # type: ignore[union-attr]
        if not radices or min(radices) < 1 or int(np.prod(radices)) != world:
            return None
    else:
        return None
    s0 = build(kind, world, 0, count, **options)
    ops = s0.ops
    if any(type(op) not in (Send, Recv) for op in ops):
        return None
    parts = exchange_parts(radices, threads, count, int(options.get("parts", 1)))  # type: ignore[arg-type]
    digits = _digits(np.arange(world), radices)
    peer0 = np.array([op.peer for op in ops], dtype=np.int64)
    peer = _number((digits[:, None, :] + digits[peer0][None, :, :]) % np.asarray(radices), radices)
    blocks = _exchange_blocks(ops, parts, peer, digits)
    if blocks is None:
        return None
    offset, length = blocks
    rng = np.random.default_rng(world)
    for rank in sorted({0, 1, world - 1, *rng.integers(0, world, size=checks).tolist()}):
        schedule = s0 if rank == 0 else build(kind, world, rank, count, **options)
        if len(schedule.ops) != len(ops):
            return None
        for index, (op, op0) in enumerate(zip(schedule.ops, ops)):
            data = op.src if type(op) is Send else op.dst
            if type(op) is not type(op0) or op.tag != op0.tag or op.channel != op0.channel or op.deps != op0.deps \
                    or op.mode != op0.mode or op.peer != peer[rank, index] or data.buffer != "data" \
                    or data.offset != offset[rank, index] or data.length != length[rank, index] \
                    or (type(op) is Recv and op.reduce != op0.reduce):
                return None
    radix = np.asarray(radices)

    def inverse(element: int) -> int:
        return int(_number((-digits[element]) % radix, radices))

    return _template_graph(ops, peer, length, inverse, placement=placement, itemsize=itemsize, compute=compute,
                           seed=seed, priority=priority, name=name or kind)
