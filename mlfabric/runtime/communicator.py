"""The user-facing communicator: collectives on tensors, synchronous or as futures.

    import mlfabric
    comm = mlfabric.init()                      # tcp transport; torchrun env vars, or rank=/world_size=/...
    comm.allreduce(t, algorithm="ring", op="sum")
    fut = comm.allreduce_async(t)                 # torch.futures.Future resolving to t
    comm.close()

Every collective picks a schedule builder from ``mlfabric.collectives``, hands it to the
executor's progress thread and returns a future. All ranks must call collectives in the same
order (as with torch.distributed); each call gets the next sequence number, which scopes its
messages, and a description (sizes, dtype, op) that every message carries so a mismatch
between ranks is an error on every rank rather than a hang or a wrong tensor.

When the NIC's rate is known (``nic_rate=`` or ``MLFABRIC_NIC_RATE``; the emulator sets it),
algorithms that send to several peers at once through one NIC (BML, the P2P parameter
server) have each of those connections paced at its fair share of the NIC
(``runtime/fair_share.py``), so their flows end together as the closed form assumes.

Exercise it with ``python -m pytest tests/unit/test_runtime.py tests/local``.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import math
import os
import threading
import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from mlfabric import DEFAULT_TIMEOUT_S, collectives
from mlfabric.collectives.bcube import hierarchy_of, shape_options
from mlfabric.collectives.hierarchical import allreduce_options
from mlfabric.collectives.partition import chunks_for
from mlfabric.collectives.ring import MAX_CHUNKS
from mlfabric.errors import CollectiveError
from mlfabric.schedule import REDUCE_OPS, Schedule
from mlfabric.topo.spec import TopologySpec
from mlfabric.transport.base import Transport

from .executor import Executor, RunInfo, Waiter
from .fair_share import NIC_RATE_ENV, connection_rates, nic_rates_from
from .partial import QUORUM_CHOICES, PartialAllreduce, PartialResult
from .trace import tracer_from

log = logging.getLogger("mlfabric.runtime")

# The watchdog logs a collective that made no progress for this long (then again after each
# further period): long enough that a healthy job on a slow network never trips it, short
# enough to say who is stuck well before the default 60 s timeout. 0 turns it off.
DEFAULT_WATCHDOG_S = 10.0
WATCHDOG_ENV = "MLFABRIC_WATCHDOG_S"
REDUCE_OP_NAMES = ("sum", "avg", "max", "min", "prod")
_TORCH_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
assert set(_TORCH_REDUCE_OPS) == set(REDUCE_OP_NAMES) and set(REDUCE_OPS) < set(REDUCE_OP_NAMES)
#: A reduction: its mlfabric name or torch's ReduceOp (e.g. ``dist.ReduceOp.SUM``).
ReduceOpLike = str | dist.ReduceOp | dist.ReduceOp.RedOpType


class Communicator:
    """Collectives over one transport. Thread-safe: calls are ordered by a lock.

    ``topology`` (a spec such as ``"bcube:n=3,k=2"``) describes the cluster the ranks run on,
    rank ``r`` on host ``r``: it gives BML (``algorithm="bcube"``) and ``"hierarchical"``
    their shape and lets ``"auto"`` pick BML on a BCube.

    ``nic_rate`` (bit/s, ``"500mbit"``, ``"0=1gbit,1=500mbit"`` or a per-channel mapping;
    default ``MLFABRIC_NIC_RATE``, else unknown): the rate of the NIC behind each channel.
    When known, connections that share a NIC in a step are paced at their fair share.

    ``hosts`` (default: what the transport learned, ``Transport.hosts``): the host of every
    rank. On a job over several hosts with several ranks each, ``"auto"`` allreduce,
    broadcast and allgather reduce or spread inside each host first, over shared memory
    (``collectives/hierarchical.py``); ``algorithm="host_hierarchical"`` asks for it.

    ``watchdog`` (seconds; default ``MLFABRIC_WATCHDOG_S``, else :data:`DEFAULT_WATCHDOG_S`;
    0: off): log a collective that made no progress for that long, per rank, with what it
    waits for, from whom, and what those peers say they are doing.

    ``trace`` (a directory; default ``MLFABRIC_TRACE``, else off): record a Chrome/Perfetto
    timeline of every collective and transfer, written there when the communicator closes
    (``runtime/trace.py``; ``mlfabric trace merge DIR`` joins the ranks' files).
    """

    def __init__(self, transport: Transport, *, timeout: float = DEFAULT_TIMEOUT_S,
                 on_close: Sequence[Callable[[], None]] = (),
                 topology: TopologySpec | str | None = None, chunk_bytes: int | None = None,
                 nic_rate: str | float | dict[str, float] | None = None,
                 watchdog: float | None = None, hosts: Sequence[int] | None = None,
                 trace: str | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive byte count, got {chunk_bytes}")
        #: Ring pipelining chunk (bytes); None: the builders' default (ring.default_chunks).
        self.chunk_bytes = chunk_bytes
        self.topology = _check_topology(topology, transport.world_size)
        self.transport = transport
        self.hosts = _check_hosts(transport.hosts if hosts is None else hosts, transport.world_size)
        #: NIC rate per channel (bit/s); empty when unknown, and then nothing is paced.
        self.nic_rates = nic_rates_from(nic_rate, transport.channels)
        self._paced: dict[tuple[int, str], float | None] = {}  # what each connection is paced at now
        self.timeout = float(timeout)
        self.executor = Executor(transport, name=f"mlfabric-progress-{transport.rank}",
                                 watchdog_s=watchdog_seconds(watchdog),
                                 tracer=tracer_from(trace, transport.rank, transport.world_size,
                                                    transport=type(transport).__name__))
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._on_close = list(on_close)
        self._closed = False
        self.store: object | None = None  # the rendezvous store, when init() made one
        self._partials: dict[tuple[object, ...], PartialAllreduce] = {}
        _OPEN.add(self)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    # -- allreduce -------------------------------------------------------------------------

    def allreduce_async(self, tensor: torch.Tensor, algorithm: str = "ring", op: ReduceOpLike = "sum", *,
                        timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        """Reduce ``tensor`` across ranks in place; the future resolves to ``tensor``."""
        future = self._allreduce(tensor, algorithm, op, timeout, blocking=False, call=call)
        assert isinstance(future, torch.futures.Future)
        return future

    def _allreduce(self, tensor: torch.Tensor, algorithm: str, op: ReduceOpLike, timeout: float | None, *,
                   blocking: bool, call: str | None = None) -> torch.futures.Future | Waiter:
        _check_tensor(tensor, "allreduce")
        op = reduce_op_name(op)
        flat, write_back = _flat_work_buffer(tensor)
        name = collectives.choose_allreduce(algorithm, flat.numel() * flat.element_size(), self.world_size,
                                            None if self.topology is None else str(self.topology), self.hosts)
        options = {**self._allreduce_options(name), **self.pipeline_options(name, flat),
                   **self.host_options(name, flat)}
        reduce_op = "sum" if op == "avg" else op

        def finish() -> torch.Tensor:
            if op == "avg":
                _divide(flat, self.world_size)
            write_back()
            return tensor

        return self._run(f"allreduce:{name}", flat, f"allreduce({name}, {op})", finish,
                         timeout, blocking=blocking, call=call, op=reduce_op, **options, **self.ring_options(name, flat))

    def ring_options(self, ring_kind: str, flat: torch.Tensor) -> dict[str, object]:
        """The pipelining options this communicator gives ring builder ``ring_kind`` ("ring",
        "allgather", "reduce_scatter") for ``flat`` (e.g. to simulate the same schedule):
        ``chunks`` when ``chunk_bytes`` is set, the segments (count / world size elements) cut
        into chunks of about ``chunk_bytes``; none otherwise. Every rank computes
        the same value from global quantities, so schedules agree as long as every rank was
        given the same ``chunk_bytes`` (the launchers set one value for all)."""
        if self.chunk_bytes is None or ring_kind not in ("ring", "allgather", "reduce_scatter"):
            return {}
        chunk_elements = max(1, self.chunk_bytes // flat.element_size())
        return {"chunks": chunks_for(flat.numel() // self.world_size, chunk_elements, MAX_CHUNKS)}

    def pipeline_options(self, name: str, flat: torch.Tensor) -> dict[str, object]:
        """The ``parts`` this communicator cuts allreduce ``name`` of ``flat`` into (BML and
        the P2P parameter server; :func:`mlfabric.collectives.pipeline_parts`), from its
        ``chunk_bytes``; empty for the other algorithms."""
        chunk = None if self.chunk_bytes is None else max(1, self.chunk_bytes // flat.element_size())
        shape = shape_options(name, self.topology) if name == "bcube" and self.topology is not None else {}
        return collectives.pipeline_parts(name, flat.numel(), self.world_size, chunk, **shape)

    def host_options(self, name: str, flat: torch.Tensor) -> dict[str, object]:
        """What ``host_hierarchical`` needs: the ranks' hosts, the inter-host algorithm for
        each rank's slice (``auto``'s rule on the slice) and the ring phases' chunk."""
        if name != "host_hierarchical":
            return {}
        chunk = None if self.chunk_bytes is None else max(1, self.chunk_bytes // flat.element_size())
        return allreduce_options(flat.numel() * flat.element_size(), self._needs_hosts(name), chunk)

    def _needs_hosts(self, name: str) -> tuple[int, ...]:
        if self.hosts is None:
            raise ValueError(f"algorithm={name!r} needs to know which ranks share a host: the tcp transport "
                             "learns it at rendezvous (mlfabric.init('tcp')); otherwise pass "
                             "Communicator(..., hosts=[host of rank 0, host of rank 1, ...])")
        return self.hosts

    def _spread(self, algorithm: str, flat_name: str, what: str) -> str:
        """Resolve a broadcast's or allgather's ``algorithm``: ``auto`` is host_hierarchical
        on several multi-rank hosts, else ``flat_name``."""
        if algorithm == "auto":
            hierarchical = (self.hosts is not None
                            and collectives.HostLayout(self.hosts, self.world_size).spans_multi_rank_hosts())
            return "host_hierarchical" if hierarchical else flat_name
        if algorithm not in (flat_name, "host_hierarchical"):
            raise ValueError(f"unknown {what} algorithm {algorithm!r}; choose one of {flat_name}, "
                             "host_hierarchical, auto")
        if algorithm == "host_hierarchical":
            self._needs_hosts(algorithm)
        return algorithm

    def _allreduce_options(self, name: str) -> dict[str, object]:
        """The shape an algorithm needs from the topology (BCube digits, switch hierarchy)."""
        if name not in ("bcube", "hierarchical"):
            return {}
        spec = self.topology
        if spec is None or (name == "bcube" and spec.kind != "bcube"):
            raise ValueError(
                f"algorithm={name!r} needs the cluster's shape: pass "
                "mlfabric.init(..., topology='bcube:n=3,k=2') or set MLFABRIC_TOPOLOGY (the "
                f"emulator's launcher does); this communicator's topology is {spec}")
        options = shape_options(name, spec)
        if name == "bcube":
            # Level l rides channel "l" (NIC l) when the transport has it, else the first NIC:
            # BML stays correct on a one-NIC cluster, it just loses its bandwidth advantage.
            options["channels"] = tuple(str(level) if str(level) in self.transport.channels
                                        else self.transport.channels[0] for level in range(int(options["k"])))
        return options

    def allreduce(self, tensor: torch.Tensor, algorithm: str = "ring", op: ReduceOpLike = "sum", *,
                  timeout: float | None = None) -> torch.Tensor:
        result = self._allreduce(tensor, algorithm, op, timeout, blocking=True).wait()
        assert isinstance(result, torch.Tensor)
        return result

    # -- broadcast -------------------------------------------------------------------------

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0, *, algorithm: str = "auto",
                        timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        _check_tensor(tensor, "broadcast")
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast root {root} is outside world size {self.world_size}")
        name = self._spread(algorithm, "binomial", "broadcast")
        flat, write_back = _flat_work_buffer(tensor)

        def finish() -> torch.Tensor:
            write_back()
            return tensor

        if name == "host_hierarchical":
            return self._run("broadcast:host_hierarchical", flat, f"broadcast(host_hierarchical, root={root})",
                             finish, timeout, call=call, root=root, hosts=self.hosts)
        return self._run("broadcast", flat, f"broadcast(root={root})", finish, timeout, call=call, root=root)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *, algorithm: str = "auto",
                  timeout: float | None = None) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with root's ``tensor``; returns it.
        ``algorithm``: ``"binomial"``, ``"host_hierarchical"`` or ``"auto"``."""
        return self.broadcast_async(tensor, root, algorithm=algorithm, timeout=timeout).wait()

    # -- allgather / reduce_scatter ----------------------------------------------------------

    def allgather_async(self, tensor: torch.Tensor, *, algorithm: str = "auto",
                        timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        _check_tensor(tensor, "allgather")
        name = self._spread(algorithm, "ring", "allgather")
        n = tensor.numel()
        gathered = torch.empty(self.world_size * n, dtype=tensor.dtype)
        gathered[self.rank * n:(self.rank + 1) * n].copy_(tensor.detach().reshape(-1))
        shape = (self.world_size, *tensor.shape)

        def finish() -> torch.Tensor:
            return gathered.view(shape).to(tensor.device)

        if name == "host_hierarchical":
            return self._run("allgather:host_hierarchical", gathered, "allgather(host_hierarchical)", finish,
                             timeout, call=call, hosts=self.hosts)
        return self._run("allgather", gathered, "allgather", finish, timeout, call=call,
                         **self.ring_options("allgather", gathered))

    def allgather(self, tensor: torch.Tensor, *, algorithm: str = "auto",
                  timeout: float | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` stacked: shape ``(world_size, *tensor.shape)``.
        ``algorithm``: ``"ring"``, ``"host_hierarchical"`` or ``"auto"``."""
        return self.allgather_async(tensor, algorithm=algorithm, timeout=timeout).wait()

    def reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *,
                             timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        _check_tensor(tensor, "reduce_scatter")
        op = reduce_op_name(op)
        work = tensor.detach().reshape(-1).to("cpu", copy=True)
        shard = collectives.partition.pieces(work.numel(), self.world_size)[self.rank]

        def finish() -> torch.Tensor:
            out = work[shard.offset:shard.end]
            if op == "avg":
                _divide(out, self.world_size)
            return out.clone().to(tensor.device)

        return self._run("reduce_scatter", work, f"reduce_scatter({op})", finish, timeout, call=call,
                         op="sum" if op == "avg" else op, **self.ring_options("reduce_scatter", work))

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *,
                       timeout: float | None = None) -> torch.Tensor:
        """This rank's shard of the reduction of ``tensor`` over all ranks.

        ``tensor`` is flattened and cut like ``torch.tensor_split(t.flatten(), world_size)``
        (shards differ by at most one element); rank r gets shard r as a 1-D tensor.
        """
        return self.reduce_scatter_async(tensor, op, timeout=timeout).wait()

    # -- reduce, gather, scatter, all-to-all (collectives/tree.py, collectives/direct.py) ----

    def reduce_async(self, tensor: torch.Tensor, root: int = 0, op: ReduceOpLike = "sum", *,
                     timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        """Like :meth:`reduce`; the future resolves to ``tensor``."""
        _check_tensor(tensor, "reduce")
        _check_root(root, self.world_size, "reduce")
        op = reduce_op_name(op)
        at_root = self.rank == root
        # The binomial tree leaves partial sums in a non-root's buffer: reduce a copy there.
        flat, write_back = (_flat_work_buffer(tensor) if at_root
                            else (tensor.detach().reshape(-1).to("cpu", copy=True), _nothing))

        def finish() -> torch.Tensor:
            if at_root:
                if op == "avg":
                    _divide(flat, self.world_size)
                write_back()
            return tensor

        return self._run("reduce", flat, f"reduce(root={root}, {op})", finish, timeout, call=call,
                         root=root, op="sum" if op == "avg" else op)

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: ReduceOpLike = "sum", *,
               timeout: float | None = None) -> torch.Tensor:
        """Reduce ``tensor`` over all ranks into ``root``'s ``tensor`` (in place); the other
        ranks' tensors are left as they were. Returns ``tensor``."""
        return self.reduce_async(tensor, root, op, timeout=timeout).wait()

    def gather_async(self, tensor: torch.Tensor, root: int = 0, *,
                     timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        """Like :meth:`gather`."""
        _check_tensor(tensor, "gather")
        _check_root(root, self.world_size, "gather")
        n, source = tensor.numel(), tensor.detach().reshape(-1)
        if self.rank == root:
            flat = torch.empty(self.world_size * n, dtype=tensor.dtype)
            flat[root * n:(root + 1) * n].copy_(source)
        else:
            flat = source.to("cpu").contiguous()  # only read: may share the caller's memory
        shape = (self.world_size, *tensor.shape)

        def finish() -> torch.Tensor | None:
            return flat.view(shape).to(tensor.device) if self.rank == root else None

        return self._run("gather", flat, "gather", finish, timeout, call=call,
                         describe=f"gather(root={root}) of {self.world_size} x {n} x {_dtype_name(flat)}",
                         root=root, counts=(n,) * self.world_size)

    def gather(self, tensor: torch.Tensor, root: int = 0, *,
               timeout: float | None = None) -> torch.Tensor | None:
        """At ``root``, every rank's ``tensor`` stacked: shape ``(world_size, *tensor.shape)``;
        None on the other ranks. Every message goes straight to the root."""
        return self.gather_async(tensor, root, timeout=timeout).wait()

    def scatter_async(self, output: torch.Tensor, stacked: torch.Tensor | None = None, root: int = 0, *,
                      timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        """Like :meth:`scatter`; the future resolves to ``output``."""
        _check_tensor(output, "scatter")
        _check_root(root, self.world_size, "scatter")
        n = output.numel()
        if self.rank == root:
            if (stacked is None or stacked.numel() != self.world_size * n
                    or stacked.dtype != output.dtype):
                got = "nothing" if stacked is None else f"{tuple(stacked.shape)} {stacked.dtype}"
                raise ValueError(f"rank {self.rank}: scatter's root needs `stacked`, {self.world_size} "
                                 f"pieces shaped like the output {tuple(output.shape)} "
                                 f"({output.dtype}); got {got}")
            flat = stacked.detach().reshape(-1).to("cpu").contiguous()  # only read
            piece = flat[root * n:(root + 1) * n]
        else:
            if stacked is not None:
                raise ValueError(f"rank {self.rank}: only scatter's root ({root}) passes `stacked`")
            flat = piece = torch.empty(n, dtype=output.dtype)

        def finish() -> torch.Tensor:
            output.detach().copy_(piece.view(output.shape))
            return output

        return self._run("scatter", flat, "scatter", finish, timeout, call=call,
                         describe=f"scatter(root={root}) of {self.world_size} x {n} x {_dtype_name(flat)}",
                         root=root, counts=(n,) * self.world_size)

    def scatter(self, output: torch.Tensor, stacked: torch.Tensor | None = None, root: int = 0, *,
                timeout: float | None = None) -> torch.Tensor:
        """Fill every rank's ``output`` with its piece of the root's ``stacked`` (shape
        ``(world_size, *output.shape)``; only the root passes it). Returns ``output``."""
        return self.scatter_async(output, stacked, root, timeout=timeout).wait()

    def all_to_all_async(self, tensor: torch.Tensor, send_counts: Sequence[int] | None = None,
                         recv_counts: Sequence[int] | None = None, *,
                         timeout: float | None = None, call: str | None = None) -> torch.futures.Future:
        """Like :meth:`all_to_all`."""
        _check_tensor(tensor, "all_to_all")
        if tensor.dim() == 0:
            raise ValueError(f"rank {self.rank}: all_to_all splits a tensor along dim 0; got a scalar")
        rows, row = tensor.shape[0], math.prod(tensor.shape[1:])
        send = _split_counts(send_counts, rows, self.world_size, "send_counts", self.rank)
        recv = _split_counts(recv_counts, rows, self.world_size, "recv_counts", self.rank)
        sent = sum(send) * row
        flat = torch.empty(sent + sum(recv) * row, dtype=tensor.dtype)
        flat[:sent].copy_(tensor.detach().reshape(-1))

        def finish() -> torch.Tensor:
            return flat[sent:].view(sum(recv), *tensor.shape[1:]).to(tensor.device)

        # What agrees across ranks is the row; each message's size is checked on arrival.
        return self._run("all_to_all", flat, "all_to_all", finish, timeout, call=call,
                         describe=f"all_to_all of rows of {row} x {_dtype_name(flat)}",
                         send_counts=tuple(c * row for c in send), recv_counts=tuple(c * row for c in recv))

    def all_to_all(self, tensor: torch.Tensor, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None, *,
                   timeout: float | None = None) -> torch.Tensor:
        """Send rows ``tensor[sum(send_counts[:p]):][:send_counts[p]]`` to rank p and return
        the rows received, rank 0's first (as ``torch.distributed.all_to_all_single``).
        ``send_counts``/``recv_counts``: rows per peer (they may differ; rank p's
        ``send_counts[q]`` must be rank q's ``recv_counts[p]``); by default
        ``tensor.shape[0] / world_size`` each."""
        return self.all_to_all_async(tensor, send_counts, recv_counts, timeout=timeout).wait()

    # -- partial allreduce (eager-SGD) -----------------------------------------------------

    def partial_allreduce_async(self, tensor: torch.Tensor, quorum: str = "solo", round: int | None = None, *,
                                algorithm: str = "ring", op: ReduceOpLike = "sum", seed: int = 0,
                                timeout: float | None = None) -> torch.futures.Future:
        """Future of a :class:`~mlfabric.runtime.partial.PartialResult`; see :meth:`partial_allreduce`."""
        op = reduce_op_name(op)
        future = self._partial_call(tensor, quorum, round, algorithm, op, seed, timeout, blocking=False)
        if op == "sum":
            return future
        return future.then(lambda fut: self._average(fut.value()))

    def _average(self, res: PartialResult) -> PartialResult:
        out = res.tensor.clone()
        _divide(out, self.world_size - len(res.lost))
        return dataclasses.replace(res, tensor=out)

    def _partial_call(self, tensor: torch.Tensor, quorum: str, round: int | None, algorithm: str, op: str,
                      seed: int, timeout: float | None, *, blocking: bool) -> torch.futures.Future | Waiter:
        _check_tensor(tensor, "partial_allreduce")
        if op not in ("sum", "avg"):
            raise ValueError(f"partial_allreduce supports op 'sum' and 'avg', got {op!r}: stale "
                             "contributions are accumulated, which only a sum keeps exact")
        if quorum not in QUORUM_CHOICES:
            raise ValueError(f"unknown quorum {quorum!r}; choose one of {', '.join(QUORUM_CHOICES)}")
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: communicator is closed: create a new one "
                                  "(or process group) to run more collectives", rank=self.rank)
        key = (quorum, tensor.numel(), tensor.dtype, algorithm, seed)
        with self._lock:
            handle = self._partials.get(key)
            if handle is None:
                description = (f"partial_allreduce({quorum}, {algorithm}) of {tensor.numel()} x "
                               f"{str(tensor.dtype).removeprefix('torch.')}")
                handle = PartialAllreduce(self.executor, len(self._partials), quorum=quorum,
                                          count=tensor.numel(), dtype=tensor.dtype, algorithm=algorithm,
                                          op="sum", seed=seed, description=description)
                self._partials[key] = handle
                self.executor.attach(handle, kick=False)
        return handle.call(tensor, round, self.timeout if timeout is None else timeout, blocking=blocking)

    def partial_allreduce(self, tensor: torch.Tensor, quorum: str = "solo", round: int | None = None, *,
                          algorithm: str = "ring", op: ReduceOpLike = "sum", seed: int = 0,
                          timeout: float | None = None) -> PartialResult:
        """Solo or majority allreduce (eager-SGD §4): returns without waiting for slow ranks.

        ``quorum="solo"``: the first rank to call starts the round; ``"majority"``: the
        round's initiator, drawn from ``seed`` (shared by all ranks), starts it, so on
        average half the ranks contribute fresh data; ``"all"``: a synchronous allreduce.
        Ranks that have not called contribute what they accumulated so far (their send
        buffer); a tensor that misses its round is kept for the next one, never lost.
        ``round`` defaults to one after the last round this rank received. The result's
        ``tensor`` is the same on every rank; ``contributed`` says whether this call's tensor
        is in it; ``active`` counts the ranks whose fresh data is; ``round`` is the execution
        it comes from. ``op="avg"`` divides by the number of live ranks.
        """
        op = reduce_op_name(op)
        res = self._partial_call(tensor, quorum, round, algorithm, op, seed, timeout, blocking=True).wait()
        assert isinstance(res, PartialResult)
        return res if op == "sum" else self._average(res)

    def barrier(self, *, timeout: float | None = None) -> None:
        """Wait until every rank reaches the barrier (a 1-element allreduce)."""
        self._allreduce(torch.zeros(1, dtype=torch.int32), "halving_doubling", "sum", timeout, blocking=True,
                        call="barrier").wait()

    def striped_copy(self, tensor: torch.Tensor, sources: Sequence[int], receivers: Sequence[int], *,
                     chunk_bytes: int = 4 << 20, timeout: float | None = None) -> torch.Tensor:
        """Copy ``tensor`` from ``sources`` (ranks holding identical copies) to ``receivers``,
        chunk ``j`` of ``chunk_bytes`` from ``sources[j % len(sources)]``
        (``collectives/striped.py``: elastic training's state transfer). Every rank calls it
        with the same arguments; ranks in neither list return at once after taking part in
        the sequence. Returns ``tensor``."""
        _check_tensor(tensor, "striped_copy")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        flat, write_back = _flat_work_buffer(tensor)
        sources, receivers = tuple(int(s) for s in sources), tuple(int(r) for r in receivers)

        def finish() -> torch.Tensor:
            write_back()
            return tensor

        chunk = max(1, chunk_bytes // flat.element_size())
        result = self._run("striped_copy", flat, f"striped_copy(from {list(sources)} to {list(receivers)})",
                           finish, timeout, blocking=True, sources=sources, receivers=receivers,
                           chunk=chunk).wait()
        assert isinstance(result, torch.Tensor)
        return result

    # -- plumbing ----------------------------------------------------------------------------

    def _run(self, kind: str, flat: torch.Tensor, what: str, finish: Callable[[], torch.Tensor],
             timeout: float | None, *, blocking: bool = False, describe: str | None = None,
             call: str | None = None, **options: object) -> torch.futures.Future | Waiter:
        """Submit collective ``kind`` on ``flat``; ``blocking``: the caller waits at once, so a
        :class:`Waiter` stands in for the torch future. ``describe``: the description ranks
        compare, when this rank's buffer size differs from others' (rooted, all-to-all). ``call``:
        the call the user made, when it is not the collective it runs as (a barrier is a
        1-element allreduce): errors then name both, e.g. "barrier (runs as allreduce(...))"."""
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: communicator is closed: create a new one "
                                  "(or process group) to run more collectives", rank=self.rank)
        description = describe or f"{what} of {flat.numel()} x {_dtype_name(flat)}"
        if call is not None:
            description = f"{call} (runs as {description})"
        with self._lock:
            seq = next(self._seq)
            if self.world_size == 1:
                future: torch.futures.Future = torch.futures.Future()
                future.set_result(finish())
                return future
            schedule = collectives.build(kind, self.world_size, self.rank, flat.numel(), **options)
            if self.nic_rates:
                self._pace(schedule)
            future = self.executor.submit(
                schedule, {"data": flat}, RunInfo(seq=seq, description=description, algorithm=kind),
                timeout=self.timeout if timeout is None else timeout, result=finish, kick=False,
                blocking=blocking,
            )
        self.executor.kick()  # outside the lock: the run may finish, and its callbacks run, here
        return future

    def _pace(self, schedule: Schedule) -> None:
        """Pace the connections ``schedule`` sends on at their fair share (or lift the cap),
        telling the transport only what changed since the previous collective. A transport
        that cannot pace is told once (logged) and not asked again."""
        for connection, rate in connection_rates(schedule, self.nic_rates).items():
            if self._paced.get(connection) != rate:
                if not self.transport.pace_connection(*connection, rate) and rate is not None:
                    log.info("rank %d: %s cannot pace connections: the NIC rate is known (%s) but "
                             "fair-share pacing is off", self.rank, type(self.transport).__name__,
                             NIC_RATE_ENV)
                    self.nic_rates = {}
                    return
                self._paced[connection] = rate

    def close(self, *, reason: str = "it closed its communicator") -> None:
        """Stop the progress thread and the transport; idempotent. The goodbye tells the
        peers which collectives this rank leaves unfinished (they fail those at once, naming
        this rank) and ``reason``."""
        if self._closed:
            return
        self._closed = True
        farewell = self.executor.farewell(reason)
        self.executor.close()
        self.transport.close(farewell)
        for callback in self._on_close:
            callback()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, "
                f"transport={type(self.transport).__name__})")


# Communicators not closed yet: a process that ends without closing one still says goodbye
# (so its peers fail at once, naming it, instead of finding a dead connection).
_OPEN: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for comm in list(_OPEN):
        try:
            comm.close(reason="its process exited without closing its communicator")
        except Exception:  # noqa: BLE001 - exiting anyway; peers then see a lost connection
            log.debug("rank %d: closing at exit failed", comm.rank, exc_info=True)


def watchdog_seconds(watchdog: float | None) -> float | None:
    """The watchdog period from the argument, else ``MLFABRIC_WATCHDOG_S``, else the default;
    None when off (0)."""
    if watchdog is None:
        raw = os.environ.get(WATCHDOG_ENV, "").strip()
        try:
            watchdog = float(raw) if raw else DEFAULT_WATCHDOG_S
        except ValueError:
            raise ValueError(f"{WATCHDOG_ENV}={raw!r} is not a number of seconds (0: off)") from None
    if watchdog < 0 or not math.isfinite(watchdog):
        raise ValueError(f"watchdog must be a finite number of seconds >= 0 (0: off), got {watchdog}")
    return watchdog or None


def _check_topology(topology: TopologySpec | str | None, world_size: int) -> TopologySpec | None:
    if topology is None:
        return None
    spec = topology if isinstance(topology, TopologySpec) else TopologySpec.parse(topology)
    if spec.kind == "edges":
        return spec
    hosts = math.prod(hierarchy_of(spec))
    if hosts != world_size:
        raise ValueError(f"topology {spec} has {hosts} hosts but the world size is {world_size}; "
                         "mlfabric runs one rank per host")
    return spec


def _check_hosts(hosts: Sequence[int] | None, world_size: int) -> tuple[int, ...] | None:
    if hosts is None:
        return None
    hosts = tuple(int(h) for h in hosts)
    if len(hosts) != world_size:
        raise ValueError(f"hosts gives the host of {len(hosts)} ranks; the world size is {world_size}")
    return hosts


def _check_tensor(tensor: object, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    dtype = tensor.dtype
    if dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"{what} does not support dtype {dtype}")


def reduce_op_name(op: ReduceOpLike) -> str:
    """The name mlfabric gives reduction ``op``: one of :data:`REDUCE_OP_NAMES`, or a
    ``torch.distributed.ReduceOp`` (SUM, AVG, PRODUCT, MIN, MAX)."""
    if isinstance(op, str):
        if op not in REDUCE_OP_NAMES:
            raise ValueError(f"unknown reduction {op!r}; choose one of {', '.join(REDUCE_OP_NAMES)}")
        return op
    for name, torch_op in _TORCH_REDUCE_OPS.items():
        if op == torch_op:
            return name
    raise ValueError(f"reduction {op} is not supported by mlfabric; choose one of "
                     f"{', '.join(REDUCE_OP_NAMES)} (torch's SUM, AVG, MAX, MIN, PRODUCT)")


def _check_root(root: int, world_size: int, what: str) -> None:
    if not 0 <= root < world_size:
        raise ValueError(f"{what} root {root} is outside world size {world_size}")


def _split_counts(counts: Sequence[int] | None, rows: int, world_size: int, name: str,
                  rank: int) -> tuple[int, ...]:
    """Rows per peer: ``counts``, or ``rows`` cut evenly (which must divide)."""
    if counts is None:
        if rows % world_size:
            raise ValueError(f"rank {rank}: all_to_all of {rows} rows over {world_size} ranks needs "
                             f"{name} (the rows do not split evenly)")
        return (rows // world_size,) * world_size
    counts = tuple(int(c) for c in counts)
    if len(counts) != world_size or min(counts) < 0:
        raise ValueError(f"rank {rank}: {name} must be {world_size} non-negative row counts, got {counts}")
    if name == "send_counts" and sum(counts) != rows:
        raise ValueError(f"rank {rank}: send_counts {counts} add up to {sum(counts)} rows, the "
                         f"tensor has {rows}")
    return counts


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _nothing() -> None:
    pass


def _flat_work_buffer(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A flat contiguous CPU view of ``tensor`` if one exists, else a copy plus the function
    that writes the result back."""
    if tensor.is_cpu and tensor.is_contiguous():
        if tensor.dim() == 1 and not tensor.requires_grad:
            return tensor, _nothing  # already what the run needs: no new tensor objects
        return tensor.detach().view(-1), _nothing
    work = tensor.detach().reshape(-1).to("cpu", copy=True)
    return work, lambda: tensor.detach().copy_(work.view(tensor.shape))


def _divide(flat: torch.Tensor, world_size: int) -> None:
    """``avg`` = sum / world size; integers use floor division (Python's ``//``)."""
    if flat.is_floating_point():
        flat.div_(world_size)
    else:
        flat.copy_(torch.div(flat, world_size, rounding_mode="floor"))
