"""Task graphs of rank-symmetric collectives built from one rank's schedule (no schedule per rank).

:func:`~mlfabric.sim.graph.compile_schedules` walks every op of every rank's
:class:`~mlfabric.schedule.Schedule` in Python: a ring allreduce over 1,024 ranks is 4.2 M ops,
~90 s and ~5 GB of op objects before the engine starts (issue #37). A ring is the same schedule
on every rank up to a rotation: rank ``r``'s op ``i`` is rank 0's op ``i`` with its peer and
its data segment shifted by ``r``. :func:`ring_graph` builds rank 0's schedule (and ranks 1
and ``n-1``'s, to check the rotation holds), then writes the whole graph with numpy:
the same arrays, in the same order, as ``compile_schedules`` of every rank's schedule
(``tests/unit/test_sim_scale.py`` compares them field by field), in a few seconds for 1,024
ranks. Anything it does not recognise returns None and the caller compiles the schedules.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim_scale.py -q -k regular
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mlfabric.collectives import build
from mlfabric.collectives.partition import pieces, subdivide
from mlfabric.collectives.ring import default_chunks
from mlfabric.schedule import DepMode, Recv, Schedule, Send

from .compute import ComputeModel
from .graph import DELAY, TRANSFER, GraphBuilder, TaskGraph

__all__ = ["ring_graph"]

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
    hosts = np.arange(world, dtype=np.int64) if placement is None else np.asarray(placement, dtype=np.int64)
    if hosts.shape != (world,):
        raise ValueError(f"placement must give one host per rank ({world}), got {hosts.shape}")
    if itemsize <= 0:
        raise ValueError(f"itemsize must be > 0 bytes, got {itemsize}")
    ops = s0.ops
    m = len(ops)
    ranks = np.arange(world, dtype=np.int64)
    is_recv = template["is_recv"]
    is_send = ~is_recv
    # Per-op facts of the template, then (rank, op) grids flattened rank-major (task r*m + i).
    peer_rel = template["peer"]  # rank 0's peer = the offset of every rank's peer
    peer = (ranks[:, None] + peer_rel[None, :]) % world
    seg = (template["segment"][None, :] + ranks[:, None]) % world
    elements = lengths[seg, template["chunk"][None, :]]
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
           rank=np.repeat(ranks, m), peer=np.where(is_send | is_recv, peer, -1).ravel(), op=np.tile(np.arange(m), world),
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
    # (r, channel, tag): in template terms, a Send whose peer offset is minus the Recv's.
    sends: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    for index in np.flatnonzero(is_send).tolist():
        sends[(int(peer_rel[index]), channels[index], int(template["tag"][index]))].append(index)
    seen: dict[tuple[int, str, int], int] = defaultdict(int)
    recv_ops, send_ops = [], []
    for index in np.flatnonzero(is_recv).tolist():
        key = (int(peer_rel[index]), channels[index], int(template["tag"][index]))
        partner = sends.get(((-key[0]) % world, key[1], key[2]), [])
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
