"""The simulator's task graph: what the event engine executes, built from schedules or workloads.

A :class:`TaskGraph` is a flat DAG in numpy arrays, so that workloads of a million tasks
build and run without a Python object per task. A task is either

* a **transfer** (``src`` host -> ``dst`` host, ``size_bytes``, optionally a NIC of the sender
  and a priority class): it becomes a flow on the network when ready and completes when the
  last byte arrives; or
* a **delay** (``duration_s``; 0 for pure synchronisation points): compute, reductions, Nops.

Dependencies are edges ``before -> after`` of two kinds, as in the schedule IR (eager-SGD
§4.1.1): *all-of* edges (the task waits for every one of them) and *any-of* edges (the task
needs at least one of them). A task becomes ready when every all-of edge has fired and, if it
has any-of edges, at least one of those.

:func:`compile_schedules` turns a set of per-rank :class:`~mlfabric.schedule.Schedule` objects
(the same ones the runtime executes) into a graph:

* ``Send`` -> transfer task from the rank's host to the peer's host; its op completes when the
  message has been delivered (the buffer was read while the flow ran);
* ``Recv`` -> delay task (its reduction time under a compute model, else 0) with the op's own
  dependencies plus an all-of edge from the matching Send. Sends are *eager*: the flow starts
  as soon as the Send is ready, whether or not the receiver posted its Recv; the data waits
  at the receiver. Sends and Recvs match by ``(src rank, dst rank, channel, tag)``, in op
  order when a key repeats, as the runtime matches them. The Sends from one rank to one peer
  on one channel share a FIFO *connection*: they move one at a time, in the order they became
  ready (the runtime's transports keep one TCP stream per peer and channel, so a message
  queued behind another does not take half of the bandwidth from it);
* ``Reduce`` / ``Copy`` -> delay tasks timed by the compute model; ``Nop`` -> zero delay;
* with a compute model, one extra delay task per rank (its compute time before the
  collective) precedes every op of that rank without dependencies.

Channel names that are integers (``"0"``, ``"1"``, ...) name the sender's NIC; on multi-NIC
topologies (BCube) the engine routes such a message through that NIC when a shortest path
starts there.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim.py -q -k graph
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from mlfabric.schedule import Copy, DepMode, Nop, Recv, Reduce, Schedule, ScheduleError, Send

from .compute import ComputeModel

__all__ = ["TRANSFER", "DELAY", "TaskGraph", "GraphBuilder", "compile_schedules", "merge_graphs"]

TRANSFER = 0
DELAY = 1


@dataclass(frozen=True, eq=False, kw_only=True)
class TaskGraph:
    """A DAG of transfer and delay tasks (see the module docstring); build with :class:`GraphBuilder`."""

    kind: np.ndarray  # int8: TRANSFER or DELAY
    src: np.ndarray  # int64 host (transfers; -1 otherwise)
    dst: np.ndarray  # int64 host
    size_bytes: np.ndarray  # float64 (transfers)
    duration_s: np.ndarray  # float64 (delays)
    nic: np.ndarray  # int64 sender NIC, -1 = any
    priority: np.ndarray  # int64 class, 0 is served first
    job: np.ndarray  # int64 index into job_names
    rank: np.ndarray  # int64 owning rank / worker for diagnostics, -1 = none
    peer: np.ndarray  # int64 peer rank for diagnostics, -1 = none
    op: np.ndarray  # int64 op index in the rank's schedule, -1 = none
    label: np.ndarray  # int16 index into label_names
    label_names: tuple[str, ...]
    job_names: tuple[str, ...]
    #: What per-flow ECMP hashes besides the hosts (the role of a 5-tuple's ports): the
    #: task's index in its own job, so a job takes the same paths alone or among others; for a
    #: transfer on a connection, ``-1 - connection``, so a connection's messages share a path.
    flow_key: np.ndarray
    #: int64 FIFO connection of a transfer, -1 = none. Transfers of one connection move one
    #: at a time, in the order they became ready (a TCP connection per (sender, receiver,
    #: channel), as the runtime's transports have); the others share links max-min fairly.
    connection: np.ndarray
    # Edges in CSR form by source task: task u enables dep_dst[dep_ptr[u]:dep_ptr[u+1]].
    dep_ptr: np.ndarray
    dep_dst: np.ndarray
    dep_any: np.ndarray  # bool per edge
    need_all: np.ndarray  # int64: all-of edges into each task
    has_any: np.ndarray  # bool: the task has any-of edges

    @property
    def n_tasks(self) -> int:
        return int(self.kind.size)

    @property
    def n_edges(self) -> int:
        return int(self.dep_dst.size)

    @property
    def n_transfers(self) -> int:
        return int(np.count_nonzero(self.kind == TRANSFER))

    def describe(self, task: int) -> str:
        """One line naming a task, for errors: job, rank, op, kind, peer, hosts."""
        parts = []
        if len(self.job_names) > 1:
            parts.append(f"job {self.job_names[int(self.job[task])]!r}")
        if self.rank[task] >= 0:
            parts.append(f"rank {int(self.rank[task])}")
        if self.op[task] >= 0:
            parts.append(f"op {int(self.op[task])}")
        text = self.label_names[int(self.label[task])]
        if self.peer[task] >= 0:
            text += f" {'to' if self.kind[task] == TRANSFER else 'from'} rank {int(self.peer[task])}"
        if self.kind[task] == TRANSFER:
            text += f" (h{int(self.src[task])}->h{int(self.dst[task])}, {self.size_bytes[task]:.0f} B)"
        parts.append(text)
        return " ".join(parts) + f" [task {task}]"


def _column(value: object, n: int, dtype: type) -> np.ndarray:
    array = np.asarray(value, dtype=dtype)
    if array.ndim == 0:
        return np.full(n, array, dtype=dtype)
    if array.shape != (n,):
        raise ValueError(f"expected a scalar or {n} values, got shape {array.shape}")
    return array


class GraphBuilder:
    """Accumulates tasks and edges in vectorized batches; ``add_*`` return the new task ids."""

    _FIELDS = ("kind", "src", "dst", "size_bytes", "duration_s", "nic", "priority", "job", "rank", "peer", "op", "label",
               "connection")

    def __init__(self, job_name: str = "job") -> None:
        self.n = 0
        self._parts: dict[str, list[np.ndarray]] = {name: [] for name in self._FIELDS}
        self._edges_before: list[np.ndarray] = []
        self._edges_after: list[np.ndarray] = []
        self._edges_any: list[np.ndarray] = []
        self._labels: dict[str, int] = {}
        self.job_name = job_name

    def _label(self, name: str) -> int:
        return self._labels.setdefault(name, len(self._labels))

    def _add(self, n: int, **columns: object) -> np.ndarray:
        dtypes = {"kind": np.int8, "size_bytes": np.float64, "duration_s": np.float64, "label": np.int16}
        for name in self._FIELDS:
            self._parts[name].append(_column(columns[name], n, dtypes.get(name, np.int64)))
        ids = np.arange(self.n, self.n + n, dtype=np.int64)
        self.n += n
        return ids

    def add_transfers(self, src: np.ndarray | int, dst: np.ndarray | int, size_bytes: np.ndarray | float, *,
                      n: int | None = None, nic: np.ndarray | int = -1, priority: np.ndarray | int = 0,
                      rank: np.ndarray | int = -1, peer: np.ndarray | int = -1, op: np.ndarray | int = -1,
                      connection: np.ndarray | int = -1, label: str = "transfer") -> np.ndarray:
        """Transfers ``src[i] -> dst[i]`` of ``size_bytes[i]`` bytes (scalars broadcast);
        ``connection[i] >= 0`` puts a transfer on a FIFO connection (see :class:`TaskGraph`)."""
        n = _count(n, src, dst, size_bytes)
        sizes = _column(size_bytes, n, np.float64)
        if (sizes < 0).any() or not np.isfinite(sizes).all():
            raise ValueError("transfer sizes must be finite and >= 0 bytes")
        return self._add(n, kind=TRANSFER, src=src, dst=dst, size_bytes=sizes, duration_s=0.0, nic=nic,
                         priority=priority, job=0, rank=rank, peer=peer, op=op, label=self._label(label),
                         connection=connection)

    def add_delays(self, duration_s: np.ndarray | float, *, n: int | None = None, rank: np.ndarray | int = -1,
                   peer: np.ndarray | int = -1, op: np.ndarray | int = -1, label: str = "delay") -> np.ndarray:
        """Delay tasks (compute, reductions, synchronisation points when 0 s)."""
        n = _count(n, duration_s)
        durations = _column(duration_s, n, np.float64)
        if (durations < 0).any() or not np.isfinite(durations).all():
            raise ValueError("delays must be finite and >= 0 s")
        return self._add(n, kind=DELAY, src=-1, dst=-1, size_bytes=0.0, duration_s=durations, nic=-1,
                         priority=0, job=0, rank=rank, peer=peer, op=op, label=self._label(label), connection=-1)

    def add_edges(self, before: np.ndarray | int, after: np.ndarray | int, *, any_of: bool = False) -> None:
        """Edges ``before[i] -> after[i]`` (scalars broadcast); ``any_of`` marks any-of edges."""
        before_array = np.asarray(before, dtype=np.int64)
        after_array = np.asarray(after, dtype=np.int64)
        before_array, after_array = np.broadcast_arrays(before_array, after_array)
        before_array, after_array = before_array.ravel().copy(), after_array.ravel().copy()
        if before_array.size and (min(before_array.min(), after_array.min()) < 0
                                  or max(before_array.max(), after_array.max()) >= self.n):
            raise ValueError(f"edge endpoints must be task ids in [0, {self.n})")
        self._edges_before.append(before_array)
        self._edges_after.append(after_array)
        self._edges_any.append(np.full(before_array.size, any_of))

    def build(self) -> TaskGraph:
        columns = {name: (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
                   for name, parts in self._parts.items()}
        n = self.n
        before = np.concatenate(self._edges_before) if self._edges_before else np.zeros(0, dtype=np.int64)
        after = np.concatenate(self._edges_after) if self._edges_after else np.zeros(0, dtype=np.int64)
        any_of = np.concatenate(self._edges_any) if self._edges_any else np.zeros(0, dtype=bool)
        order = np.argsort(before, kind="stable")
        dep_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(before, minlength=n), out=dep_ptr[1:])
        need_all = np.bincount(after[~any_of], minlength=n).astype(np.int64)
        has_any = np.bincount(after[any_of], minlength=n) > 0
        labels = tuple(sorted(self._labels, key=self._labels.__getitem__)) or ("task",)
        return TaskGraph(
            kind=columns["kind"].astype(np.int8, copy=False), src=columns["src"], dst=columns["dst"],
            size_bytes=columns["size_bytes"].astype(np.float64, copy=False),
            duration_s=columns["duration_s"].astype(np.float64, copy=False),
            nic=columns["nic"], priority=columns["priority"], job=columns["job"], rank=columns["rank"],
            peer=columns["peer"], op=columns["op"], label=columns["label"].astype(np.int16, copy=False),
            label_names=labels, job_names=(self.job_name,), flow_key=np.arange(n, dtype=np.int64),
            connection=columns["connection"], dep_ptr=dep_ptr, dep_dst=after[order], dep_any=any_of[order],
            need_all=need_all, has_any=has_any,
        )


def _count(n: int | None, *values: object) -> int:
    if n is not None:
        return n
    sizes = {np.asarray(v).size for v in values if np.asarray(v).ndim > 0}
    if len(sizes) > 1:
        raise ValueError(f"array arguments have different lengths {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def merge_graphs(graphs: Sequence[TaskGraph], *, names: Sequence[str] | None = None,
                 priorities: Sequence[int] | None = None) -> TaskGraph:
    """Concatenate independent graphs as concurrent jobs (job ``i`` = ``graphs[i]``).

    ``priorities[i]`` replaces the priority class of every transfer of job ``i`` (0 is served
    first; see :mod:`mlfabric.sim.engine`).
    """
    if not graphs:
        raise ValueError("merge_graphs needs at least one graph")
    if names is not None and len(names) != len(graphs):
        raise ValueError(f"{len(names)} names for {len(graphs)} graphs")
    if priorities is not None and len(priorities) != len(graphs):
        raise ValueError(f"{len(priorities)} priorities for {len(graphs)} graphs")
    labels: dict[str, int] = {}
    offsets = np.cumsum([0] + [g.n_tasks for g in graphs])
    cols: dict[str, list[np.ndarray]] = defaultdict(list)
    ptr_parts = [np.zeros(1, dtype=np.int64)]
    edge_base = 0
    connection_base = 0
    job_names: list[str] = []
    for index, (graph, offset) in enumerate(zip(graphs, offsets)):
        # Connections are per job: renumber them past the previous jobs'.
        cols["connection"].append(np.where(graph.connection >= 0, graph.connection + connection_base, -1))
        connection_base += int(graph.connection.max(initial=-1)) + 1
        for name in ("kind", "src", "dst", "size_bytes", "duration_s", "nic", "rank", "peer", "op", "need_all", "has_any",
                     "flow_key"):
            cols[name].append(getattr(graph, name))
        remap = np.array([labels.setdefault(label, len(labels)) for label in graph.label_names], dtype=np.int16)
        cols["label"].append(remap[graph.label])
        prio = graph.priority if priorities is None else np.full(graph.n_tasks, int(priorities[index]), dtype=np.int64)
        cols["priority"].append(prio)
        cols["job"].append(np.full(graph.n_tasks, len(job_names), dtype=np.int64))
        job_names.append(names[index] if names is not None else f"job{index}")
        cols["dep_dst"].append(graph.dep_dst + offset)
        cols["dep_any"].append(graph.dep_any)
        ptr_parts.append(graph.dep_ptr[1:] + edge_base)
        edge_base += graph.n_edges
    joined = {name: np.concatenate(parts) for name, parts in cols.items()}
    return TaskGraph(
        kind=joined["kind"], src=joined["src"], dst=joined["dst"], size_bytes=joined["size_bytes"],
        duration_s=joined["duration_s"], nic=joined["nic"], priority=joined["priority"], job=joined["job"],
        rank=joined["rank"], peer=joined["peer"], op=joined["op"], label=joined["label"],
        label_names=tuple(sorted(labels, key=labels.__getitem__)), job_names=tuple(job_names), flow_key=joined["flow_key"],
        connection=joined["connection"], dep_ptr=np.concatenate(ptr_parts), dep_dst=joined["dep_dst"],
        dep_any=joined["dep_any"], need_all=joined["need_all"], has_any=joined["has_any"],
    )


def _nic_of(channel: str) -> int:
    return int(channel) if channel.isdigit() else -1


def compile_schedules(schedules: Sequence[Schedule], *, placement: Sequence[int] | np.ndarray | None = None,
                      itemsize: int = 4, compute: ComputeModel | None = None, seed: int = 0,
                      priority: int = 0, name: str | None = None) -> TaskGraph:
    """Compile one collective's per-rank schedules into a task graph (see the module docstring).

    ``placement[r]`` is the host of rank ``r`` (default: host ``r``). Raises
    :class:`~mlfabric.schedule.ScheduleError` for a Send or Recv without a partner.
    """
    world = len(schedules)
    if world == 0:
        raise ValueError("compile_schedules needs at least one schedule")
    for r, sched in enumerate(schedules):
        if sched.rank != r or sched.world_size != world:
            raise ValueError(f"schedules[{r}] is rank {sched.rank} of {sched.world_size}; expected rank {r} of {world}")
    hosts = np.arange(world, dtype=np.int64) if placement is None else np.asarray(placement, dtype=np.int64)
    if hosts.shape != (world,):
        raise ValueError(f"placement must give one host per rank ({world}), got {hosts.shape}")
    if itemsize <= 0:
        raise ValueError(f"itemsize must be > 0 bytes, got {itemsize}")
    speeds = compute.worker_speeds(world, seed) if compute is not None else np.ones(world)
    start_times = compute.compute_times(1, world, seed)[0] if compute is not None else None

    b = GraphBuilder(name or schedules[0].name)
    total = sum(len(s.ops) for s in schedules)
    kinds = np.empty(total, dtype=np.int8)
    src = np.full(total, -1, dtype=np.int64)
    dst = np.full(total, -1, dtype=np.int64)
    size = np.zeros(total)
    duration = np.zeros(total)
    nic = np.full(total, -1, dtype=np.int64)
    peer = np.full(total, -1, dtype=np.int64)
    connection = np.full(total, -1, dtype=np.int64)
    connections: dict[tuple[int, int, str], int] = {}  # (rank, peer, channel) -> FIFO connection
    owner = np.empty(total, dtype=np.int64)
    op_index = np.empty(total, dtype=np.int64)
    label = np.empty(total, dtype=np.int16)
    label_ids = {name: b._label(name) for name in ("Send", "Recv", "Reduce", "Copy", "Nop")}
    offsets = [0] * world
    sends: dict[tuple[int, int, str, int], deque[int]] = defaultdict(deque)
    recvs: list[tuple[int, tuple[int, int, str, int], int, int]] = []  # (task, key, rank, op)
    dep_before: list[int] = []
    dep_after: list[int] = []
    any_before: list[int] = []
    any_after: list[int] = []
    roots: list[tuple[int, int]] = []  # (rank, task) of ops without dependencies
    task = 0
    for r, sched in enumerate(schedules):
        base = task
        offsets[r] = base
        for i, op in enumerate(sched.ops):
            owner[task], op_index[task] = r, i
            if isinstance(op, Send):
                kinds[task] = TRANSFER
                src[task], dst[task] = hosts[r], hosts[op.peer]
                size[task] = op.src.length * itemsize
                nic[task] = _nic_of(op.channel)
                peer[task] = op.peer
                connection[task] = connections.setdefault((r, op.peer, op.channel), len(connections))
                sends[(r, op.peer, op.channel, op.tag)].append(task)
                label[task] = label_ids["Send"]
            else:
                kinds[task] = DELAY
                if isinstance(op, Recv):
                    peer[task] = op.peer
                    recvs.append((task, (op.peer, r, op.channel, op.tag), r, i))
                    label[task] = label_ids["Recv"]
                    if op.reduce and compute is not None:
                        duration[task] = compute.op_seconds(op.dst.length * itemsize, kind="reduce", speed=speeds[r])
                elif isinstance(op, Reduce):
                    label[task] = label_ids["Reduce"]
                    if compute is not None:
                        duration[task] = compute.op_seconds(op.dst.length * itemsize, kind="reduce", speed=speeds[r])
                elif isinstance(op, Copy):
                    label[task] = label_ids["Copy"]
                    if compute is not None:
                        duration[task] = compute.op_seconds(op.dst.length * itemsize, kind="copy", speed=speeds[r])
                elif isinstance(op, Nop):
                    label[task] = label_ids["Nop"]
                else:
                    raise ValueError(f"rank {r} op {i}: unknown op type {type(op).__name__}")
            if op.deps:
                if op.mode is DepMode.ANY:
                    any_before.extend(base + d for d in op.deps)
                    any_after.extend([task] * len(op.deps))
                else:
                    dep_before.extend(base + d for d in op.deps)
                    dep_after.extend([task] * len(op.deps))
            else:
                roots.append((r, task))
            task += 1
    b._add(total, kind=kinds, src=src, dst=dst, size_bytes=size, duration_s=duration, nic=nic,
           priority=np.where(kinds == TRANSFER, priority, 0), job=0, rank=owner, peer=peer, op=op_index, label=label,
           connection=connection)
    for task, key, r, i in recvs:
        queue = sends.get(key)
        if not queue:
            raise ScheduleError(
                f"rank {r} op {i}: Recv from rank {key[0]} (channel {key[2]!r}, tag {key[3]}) has no matching Send; "
                "check the builders' tags"
            )
        dep_before.append(queue.popleft())
        dep_after.append(task)
    leftover = [(key, queue) for key, queue in sends.items() if queue]
    if leftover:
        (src_rank, dst_rank, channel, tag), queue = leftover[0]
        raise ScheduleError(
            f"rank {src_rank} op {queue[0] - offsets[src_rank]}: Send to rank {dst_rank} (channel {channel!r}, "
            f"tag {tag}) has no matching Recv ({sum(len(q) for _, q in leftover)} unmatched Sends in all)"
        )
    if start_times is not None and roots:
        starts = b.add_delays(start_times, rank=np.arange(world), label="compute")
        root_ranks = np.array([r for r, _ in roots], dtype=np.int64)
        b.add_edges(starts[root_ranks], np.array([t for _, t in roots], dtype=np.int64))
    if dep_before:
        b.add_edges(np.array(dep_before, dtype=np.int64), np.array(dep_after, dtype=np.int64))
    if any_before:
        b.add_edges(np.array(any_before, dtype=np.int64), np.array(any_after, dtype=np.int64), any_of=True)
    graph = b.build()
    # Per-flow ECMP hashes a TCP connection, not a message: every message of a connection
    # takes its path (negative keys never equal a task index of the job's other transfers).
    return replace(graph, flow_key=np.where(graph.connection >= 0, -1 - graph.connection, graph.flow_key))
