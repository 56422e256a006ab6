"""The "mlfabric" torch.distributed backend: torch's collectives, run by mlfabric.

    import mlfabric                                   # registers the backend (torch also
    import torch.distributed as dist                  # finds it through an entry point)
    dist.init_process_group("mlfabric")               # torchrun's env://, or store=/rank=/world_size=
    model = torch.nn.parallel.DistributedDataParallel(model)   # unchanged DDP / FSDP code
    MLFABRIC_ALGORITHM=bcube MLFABRIC_TOPOLOGY=bcube:n=3,k=2 torchrun ... # pick the allreduce

Like torchft's process groups, this is pure Python on torch's extension API: a subclass of
``torch.distributed.ProcessGroup`` (whose C++ trampoline lets DDP's reducer, FSDP and
``torch.distributed``'s functions call its methods) registered with
``torch.distributed.Backend.register_backend``. Each group (the default one and every
``new_group``) is a :class:`~mlfabric.runtime.communicator.Communicator` over its own TCP
connections, set up through the store torch hands the backend, plus a
:class:`~mlfabric.runtime.p2p.PointToPoint` for send/recv. Every method maps torch's
arguments onto the communicator's collectives and returns a :class:`MlfabricWork`, whose
``wait()``, ``is_completed()``, ``exception()`` and ``get_future()`` (resolving to the output
tensors, as gloo's) behave as torch's; failures surface as mlfabric's errors (each also the
matching ``torch.distributed.DistError`` subclass), naming the rank, the peer and the torch
call beside what it runs as ("barrier (runs as allreduce(halving_doubling, sum) of 1 x int32)").

Options (``pg_options=ProcessGroupOptions(...)`` in ``init_process_group``/``new_group``, else
environment variables): the allreduce algorithm (``MLFABRIC_ALGORITHM``: ring, bcube, auto,
...; DDP's buckets go through it), the transport (``MLFABRIC_TRANSPORT``: tcp or zmq) and
mlfabric's topology, pipelining chunk and NIC rate (``MLFABRIC_TOPOLOGY``,
``MLFABRIC_CHUNK_BYTES``, ``MLFABRIC_NIC_RATE``). Collectives time out after the group's
``timeout``. See docs/torch_backend.md for what maps to what and what is not supported.

Exercise it with ``python -m pytest tests/local/test_torch_backend.py tests/unit/test_torch_backend_options.py``
(and ``tests/local/test_torch_entry_points.py``: every torch.distributed entry point against gloo).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import mlfabric
from mlfabric._plugin import BACKEND_NAME, register_backend
from mlfabric.collectives import choose_allreduce
from mlfabric.errors import CollectiveError, CollectiveTimeoutError, PeerLeftError, PeerLostError
from mlfabric.runtime.communicator import Communicator, reduce_op_name
from mlfabric.runtime.p2p import PointToPoint

ALGORITHM_ENV = "MLFABRIC_ALGORITHM"
TRANSPORT_ENV = "MLFABRIC_TRANSPORT"
DEFAULT_ALGORITHM = "auto"
DEFAULT_TRANSPORT = "tcp"  # receives in place; measured faster than zmq (docs/results.md)
BACKEND_TRANSPORTS = ("tcp", "zmq")  # "torch" would need a process group of its own

_log = logging.getLogger("mlfabric.torch")

__all__ = ["ALGORITHM_ENV", "TRANSPORT_ENV", "MlfabricWork", "ProcessGroupMlfabric",
           "ProcessGroupOptions", "create_process_group", "register_backend"]


@dataclass(frozen=True, kw_only=True)
class ProcessGroupOptions:
    """Options of one mlfabric process group; pass as ``pg_options=``. ``None`` fields fall
    back to the environment (``MLFABRIC_ALGORITHM``, ``MLFABRIC_TRANSPORT``,
    ``MLFABRIC_TOPOLOGY``, ``MLFABRIC_CHUNK_BYTES``, ``MLFABRIC_NIC_RATE``), then to the
    defaults: allreduce ``"auto"`` over ``"tcp"``."""

    algorithm: str | None = None
    transport: str | None = None
    topology: str | None = None
    chunk_bytes: int | str | None = None
    nic_rate: str | float | None = None

    def resolved(self) -> "ProcessGroupOptions":
        """Every field the group will use: these options, else the environment, else the
        defaults (topology, chunk and NIC rate stay None when unset: mlfabric then reads them)."""
        algorithm = self.algorithm or os.environ.get(ALGORITHM_ENV) or DEFAULT_ALGORITHM
        transport = self.transport or os.environ.get(TRANSPORT_ENV) or DEFAULT_TRANSPORT
        if transport not in BACKEND_TRANSPORTS:
            raise ValueError(f"mlfabric process group: transport {transport!r} (from "
                             f"{'pg_options' if self.transport else TRANSPORT_ENV}) is not one of "
                             f"{', '.join(BACKEND_TRANSPORTS)}")
        return ProcessGroupOptions(algorithm=algorithm, transport=transport, topology=self.topology,
                                   chunk_bytes=self.chunk_bytes, nic_rate=self.nic_rate)


class MlfabricWork(dist.Work):
    """One operation in flight, as torch's ``Work``: ``wait()`` blocks until it is done and
    raises its error; ``get_future()`` resolves to the output tensors."""

    def __init__(self, future: torch.futures.Future, outputs: list[torch.Tensor], what: str, *,
                 rank: int, source_rank: Callable[[], int] | None = None) -> None:
        super().__init__()
        self._future = future
        self._outputs = outputs
        self._what = what
        self._rank = rank
        self._source_rank_of = source_rank
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())
        self._result_future = _then(future, lambda _: self._outputs)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until done (at most ``timeout`` if given; the operation's own deadline, the
        group's timeout, bounds it anyway); raise the operation's error, if any."""
        seconds = timeout.total_seconds()
        if seconds > 0 and not self._done.wait(seconds):
            raise CollectiveTimeoutError(f"rank {self._rank}: {self._what} not done after waiting "
                                         f"{seconds:g}s", rank=self._rank)
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as exc:  # noqa: BLE001 - returned, as torch's Work does
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        return self._result_future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        """The sender of a receive from any source (group rank)."""
        if self._source_rank_of is None:
            raise ValueError(f"rank {self._rank}: {self._what} is not a receive from any source")
        self.wait()
        return self._source_rank_of()

    _source_rank = source_rank


class ProcessGroupMlfabric(dist.ProcessGroup):
    """A process group whose collectives and point-to-point messages are mlfabric's."""

    def __init__(self, comm: Communicator, options: ProcessGroupOptions, *, group_name: str = "",
                 global_ranks: Sequence[int] = ()) -> None:
        super().__init__(comm.rank, comm.world_size)
        self._comm = comm
        self.options = options
        self.algorithm = str(options.algorithm)
        self._p2p = PointToPoint(comm.transport, timeout=comm.timeout)
        self.global_ranks = tuple(global_ranks) or tuple(range(comm.world_size))
        self._group_name = group_name
        self._group_desc = ""
        self._closed = False
        # The first failure of one of this group's operations (errored() reports it).
        self._error: BaseException | None = None
        # The works started between _start_coalescing and _end_coalescing (None: not coalescing).
        self._coalesced: list[MlfabricWork] | None = None

    # The communicator and point-to-point endpoint every method runs on (properties: the
    # elastic group, mlfabric/torch/elastic.py, answers with its current membership's).
    @property
    def comm(self) -> Communicator:
        return self._comm

    @property
    def p2p(self) -> PointToPoint:
        return self._p2p

    # -- what torch asks about the group -----------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    # torch keeps a group's name and description in its C++ backends, which a Python group
    # has none of (DeviceMesh, and so FSDP2, look groups up by name): keep them here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return (f"ProcessGroupMlfabric(rank={self.rank()}, size={self.size()}, algorithm="
                f"{self.algorithm!r}, transport={self.options.transport!r}, global_ranks={list(self.global_ranks)})")

    # -- allreduce, broadcast, reduce, barrier ---------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor] | torch.Tensor, opts: object = None) -> MlfabricWork:
        tensor = _single(tensors, "all_reduce", self.rank())
        op = _op_of(opts)
        wire, op = _wire(tensor, op, "all_reduce", self.rank())
        future = self.comm.allreduce_async(wire, algorithm=self.algorithm, op=op, timeout=_timeout_of(opts),
                                           call="all_reduce")
        return self._work(future, [tensor], f"all_reduce({self.algorithm}, {op})")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> MlfabricWork:
        """One allreduce of every tensor's elements back to back (they share a dtype)."""
        if not tensors:
            raise ValueError(f"rank {self.rank()}: all_reduce_coalesced needs at least one tensor")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise TypeError(f"rank {self.rank()}: all_reduce_coalesced needs one dtype, got {sorted(map(str, dtypes))}")
        op = _op_of(opts)
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors])
        wire, op = _wire(flat, op, "all_reduce_coalesced", self.rank())

        def unpack(result: torch.Tensor) -> None:
            for tensor, piece in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
                tensor.detach().copy_(piece.view(tensor.shape))

        future = self.comm.allreduce_async(wire, algorithm=self.algorithm, op=op, timeout=_timeout_of(opts),
                                           call=f"all_reduce_coalesced of {len(tensors)} tensors")
        return self._work(_then(future, unpack), list(tensors), f"all_reduce_coalesced({op})")

    def broadcast(self, tensors: list[torch.Tensor] | torch.Tensor, opts: object = None) -> MlfabricWork:
        tensor = _single(tensors, "broadcast", self.rank())
        root = _root_of(opts)
        future = self.comm.broadcast_async(_wire(tensor, None, "broadcast", self.rank())[0], root,
                                           timeout=_timeout_of(opts), call="broadcast")
        return self._work(future, [tensor], f"broadcast(root={root})")

    def reduce(self, tensors: list[torch.Tensor] | torch.Tensor, opts: object = None) -> MlfabricWork:
        tensor = _single(tensors, "reduce", self.rank())
        root, op = _root_of(opts), _op_of(opts)
        wire, op = _wire(tensor, op, "reduce", self.rank())
        future = self.comm.reduce_async(wire, root, op, timeout=_timeout_of(opts), call="reduce")
        return self._work(future, [tensor], f"reduce(root={root}, {op})")

    def barrier(self, opts: object = None) -> MlfabricWork:
        # A one-element allreduce: every rank has called it once every rank's element is in.
        # Errors name the barrier, and the allreduce beside it (issue #39).
        future = self.comm.allreduce_async(torch.zeros(1, dtype=torch.int32), algorithm="halving_doubling",
                                           timeout=_timeout_of(opts), call="barrier")
        return self._work(future, [], "barrier")

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """``group.monitored_barrier(timeout)``, as gloo's: every rank reports to rank 0, which
        waits for each one directly and then releases them, so that rank 0's timeout error
        names every rank that has not called it ("waiting for recv from peer 2, ...; rank 2
        has not called collective #7 yet"); the others time out waiting for rank 0. torch's
        ``dist.monitored_barrier`` refuses every backend but gloo before it gets here; this
        is for code that calls the group's method, as docs/torch_backend.md suggests.
        ``wait_all_ranks``: rank 0 always names all the absent ranks."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None
        token = torch.zeros(1, dtype=torch.int32)
        self.comm.gather_async(token, 0, timeout=seconds, call="monitored_barrier").wait()
        # The others then wait for rank 0 (and time out naming it, as gloo's do).
        self.comm.broadcast_async(token, 0, timeout=seconds, call="monitored_barrier's release").wait()

    # -- allgather, gather, scatter --------------------------------------------------------------

    def allgather(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor] | torch.Tensor,
                  opts: object = None) -> MlfabricWork:
        tensor = _single(input_list, "all_gather", self.rank())
        outputs = _single_list(output_lists, "all_gather", self.rank())
        self._check_pieces(outputs, tensor, "all_gather", "output")
        future = self.comm.allgather_async(_wire(tensor, None, "all_gather", self.rank())[0],
                                           timeout=_timeout_of(opts), call="all_gather")
        return self._work(_then(future, lambda rows: _copy_rows(rows, outputs)), outputs, "all_gather")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> MlfabricWork:
        """``all_gather_into_tensor``: the ranks' tensors back to back in ``output``."""
        self._check_total(output, input, "all_gather_into_tensor", "output")
        future = self.comm.allgather_async(_wire(input, None, "all_gather_into_tensor", self.rank())[0],
                                           timeout=_timeout_of(opts), call="all_gather_into_tensor")
        return self._work(_then(future, lambda rows: _copy_into(output, rows)), [output], "all_gather_into_tensor")

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: object = None) -> MlfabricWork:
        """``all_gather_coalesced`` (deprecated in torch, still there): ``output_lists[r][i]``
        := rank r's ``input_list[i]``; one allgather of the inputs back to back."""
        what = "all_gather_coalesced"
        if not input_list:
            raise ValueError(f"rank {self.rank()}: {what} needs at least one input tensor")
        if len(output_lists) != self.size():
            raise ValueError(f"rank {self.rank()}: {what} needs {self.size()} output lists (one per rank), "
                             f"got {len(output_lists)}")
        counts = [t.numel() for t in input_list]
        for peer, outputs in enumerate(output_lists):
            if [t.numel() for t in outputs] != counts or any(o.dtype != input_list[0].dtype for o in outputs):
                raise ValueError(f"rank {self.rank()}: {what}: output_tensor_lists[{peer}] must hold tensors "
                                 f"of {counts} elements of {input_list[0].dtype} like input_tensor_list, got "
                                 f"{[(tuple(o.shape), str(o.dtype)) for o in outputs]}")
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in input_list])

        def unpack(rows: torch.Tensor) -> None:
            for outputs, row in zip(output_lists, rows):
                for out, piece in zip(outputs, torch.split(row, counts)):
                    _copy_into(out, piece)

        future = self.comm.allgather_async(_wire(flat, None, what, self.rank())[0], timeout=_timeout_of(opts),
                                           call=f"{what} of {len(input_list)} tensors")
        return self._work(_then(future, unpack), [t for outputs in output_lists for t in outputs], what)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> MlfabricWork:
        return self._all_of([self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
                            outputs, "all_gather_into_tensor_coalesced")

    def gather(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor] | torch.Tensor,
               opts: object = None) -> MlfabricWork:
        tensor = _single(input_list, "gather", self.rank())
        root = _root_of(opts)
        outputs = _single_list(output_lists, "gather", self.rank()) if self.rank() == root else []
        if outputs:
            self._check_pieces(outputs, tensor, "gather", "gather_list")
        future = self.comm.gather_async(_wire(tensor, None, "gather", self.rank())[0], root,
                                        timeout=_timeout_of(opts))
        return self._work(_then(future, lambda rows: _copy_rows(rows, outputs) if outputs else None),
                          outputs, f"gather(root={root})")

    def scatter(self, output_tensors: list[torch.Tensor] | torch.Tensor, input_lists: list[list[torch.Tensor]],
                opts: object = None) -> MlfabricWork:
        output = _single(output_tensors, "scatter", self.rank())
        root = _root_of(opts)
        stacked = None
        if self.rank() == root:
            pieces = _single_list(input_lists, "scatter", self.rank())
            self._check_pieces(pieces, output, "scatter", "scatter_list")
            stacked = _wire(torch.stack([p.detach().cpu().reshape(output.shape) for p in pieces]),
                            None, "scatter", self.rank())[0]
        future = self.comm.scatter_async(_wire(output, None, "scatter", self.rank())[0], stacked, root,
                                         timeout=_timeout_of(opts), call="scatter")
        return self._work(future, [output], f"scatter(root={root})")

    # -- reduce_scatter ----------------------------------------------------------------------

    def reduce_scatter(self, output_tensors: list[torch.Tensor] | torch.Tensor,
                       input_lists: list[list[torch.Tensor]], opts: object = None) -> MlfabricWork:
        output = _single(output_tensors, "reduce_scatter", self.rank())
        pieces = _single_list(input_lists, "reduce_scatter", self.rank())
        self._check_pieces(pieces, output, "reduce_scatter", "input_list")
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in pieces])
        return self._reduce_scatter_into(output, flat, opts, "reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> MlfabricWork:
        """``reduce_scatter_tensor``: rank r gets the reduction of piece r of ``input``."""
        self._check_total(input, output, "reduce_scatter_tensor", "input")
        return self._reduce_scatter_into(output, input, opts, "reduce_scatter_tensor")

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> MlfabricWork:
        return self._all_of([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)],
                            outputs, "reduce_scatter_tensor_coalesced")

    def _reduce_scatter_into(self, output: torch.Tensor, flat: torch.Tensor, opts: object, what: str) -> MlfabricWork:
        wire, op = _wire(flat, _op_of(opts), what, self.rank())
        future = self.comm.reduce_scatter_async(wire, op, timeout=_timeout_of(opts), call=what)
        return self._work(_then(future, lambda shard: _copy_into(output, shard)), [output], f"{what}({op})")

    # -- all-to-all ----------------------------------------------------------------------------

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> MlfabricWork:
        """``all_to_all_single``: dim-0 splits, even when no sizes are given."""
        size = self.size()
        for tensor, splits, name in ((input, input_split_sizes, "input"), (output, output_split_sizes, "output")):
            if not splits and tensor.shape[0] % size:
                raise ValueError(f"rank {self.rank()}: all_to_all_single's {name} has {tensor.shape[0]} rows, "
                                 f"which do not split evenly over {size} ranks: pass {name}_split_sizes")
        send = list(input_split_sizes) or [input.shape[0] // size] * size
        recv = list(output_split_sizes) or [output.shape[0] // size] * size
        if sum(recv) != output.shape[0]:
            raise ValueError(f"rank {self.rank()}: output_split_sizes {recv} add up to {sum(recv)} rows, the "
                             f"output has {output.shape[0]}")
        future = self.comm.all_to_all_async(_wire(input, None, "all_to_all_single", self.rank())[0], send, recv,
                                            timeout=_timeout_of(opts), call="all_to_all_single")
        return self._work(_then(future, lambda rows: _copy_into(output, rows)), [output], "all_to_all_single")

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: object = None) -> MlfabricWork:
        """``all_to_all``: tensor p of ``input_tensors`` to rank p; pieces may differ in size."""
        size = self.size()
        if len(input_tensors) != size or len(output_tensors) != size:
            raise ValueError(f"rank {self.rank()}: all_to_all needs {size} input and output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        if len({t.dtype for t in (*input_tensors, *output_tensors)}) != 1:
            raise TypeError(f"rank {self.rank()}: all_to_all's tensors must share one dtype")
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in input_tensors])
        future = self.comm.all_to_all_async(_wire(flat, None, "all_to_all", self.rank())[0],
                                            [t.numel() for t in input_tensors],
                                            [t.numel() for t in output_tensors], timeout=_timeout_of(opts),
                                            call="all_to_all")

        def unpack(received: torch.Tensor) -> None:
            pieces = torch.split(received, [t.numel() for t in output_tensors])
            for out, piece in zip(output_tensors, pieces):
                _copy_into(out, piece)

        return self._work(_then(future, unpack), list(output_tensors), "all_to_all")

    # torch >= 2.13 calls these by their new names (torch <= 2.12 by the old ones above).
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # -- point to point --------------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> MlfabricWork:  # noqa: N803
        tensor = _single(tensors, "send", self.rank())
        future = self.p2p.send_async(_wire(tensor, None, "send", self.rank())[0], dstRank, tag)
        return self._work(future, [tensor], f"send to group rank {dstRank} (tag {tag})")

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> MlfabricWork:  # noqa: N803
        return self._recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> MlfabricWork:
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list[torch.Tensor], source: int | None, tag: int) -> MlfabricWork:
        tensor = _single(tensors, "recv", self.rank())
        future = self.p2p.recv_async(_wire(tensor, None, "recv", self.rank())[0], source, tag)
        who = "any rank" if source is None else f"group rank {source}"
        return self._work(future, [tensor], f"recv from {who} (tag {tag})",
                          source_rank=lambda: int(future.value()))

    # -- lifetime ------------------------------------------------------------------------------
    #
    # What torch and fault-tolerant trainers expect of a group's lifetime (torchft's process
    # groups have the same three): ``errored()`` says, without blocking, whether the group is
    # broken and must be replaced; ``shutdown()`` (``destroy_process_group``) leaves in order;
    # ``abort()`` (``_abort_process_group``, a trainer that gave up on a peer) fails whatever is
    # in flight at once. None of them raises or waits for a dead peer, and each may follow the
    # other, any number of times.

    def errored(self) -> Exception | None:
        """The error that broke this group, or None while it is healthy: the first failure of
        one of its operations, else a peer seen lost or departed while nothing was in flight
        (its next collective would fail). Does not block."""
        if self._error is not None:
            return self._error  # type: ignore[return-value]
        transport = self.comm.transport
        lost = dict(transport.lost_peers)
        gone = sorted(set(lost) | set(transport.departed_peers))
        if gone:
            peer = gone[0]
            kind, how = (PeerLostError, f"was lost ({lost[peer]})") if peer in lost else (PeerLeftError, "left")
            return kind(f"rank {self.rank()}: group rank {peer} {how}; this process group cannot run "
                        "collectives any more: destroy it and build a new one (or use "
                        "mlfabric.torch.Elastic, which does)", rank=self.rank(), peer=peer)
        if self._closed:
            return CollectiveError(f"rank {self.rank()}: the process group was shut down or aborted",
                                   rank=self.rank())
        return None

    def shutdown(self) -> None:
        """Close the connections, telling the peers which operations this rank leaves
        unfinished (``destroy_process_group`` calls this); pending operations fail. Idempotent;
        never raises (a dead peer cannot be told, and leaving must still succeed)."""
        self._close("the process group was shut down")

    def abort(self) -> None:
        """Fail every operation in flight and drop the connections (torch's
        ``_abort_process_group``; a trainer that gave up on a peer): the same close as
        :meth:`shutdown` (mlfabric's close does not wait for peers: a goodbye to a dead one is
        skipped), with its own reason in the pending operations' errors. Idempotent; never raises."""
        self._close("the process group was aborted")

    def _close(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        for close in (lambda: self.p2p.close(reason), lambda: self.comm.close(reason=reason)):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - see shutdown(): closing must succeed
                _log.warning("rank %d: %s; closing raised %s: %s (ignored)", self.rank(), reason,
                             type(exc).__name__, exc)

    # -- helpers -------------------------------------------------------------------------------

    def _work(self, future: torch.futures.Future, outputs: list[torch.Tensor], what: str, *,
              source_rank: Callable[[], int] | None = None) -> MlfabricWork:
        work = MlfabricWork(future, outputs, what, rank=self.rank(), source_rank=source_rank)
        future.add_done_callback(self._note_failure)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _note_failure(self, done: torch.futures.Future) -> None:
        """Keep the first error of an operation of this group (``errored()``)."""
        if self._error is None:
            try:
                done.value()
            except BaseException as exc:  # noqa: BLE001 - kept, the caller's wait() raises it
                self._error = exc

    # torch's ``_coalescing_manager(group, device)`` (NCCL-style coalescing) brackets ops with
    # these; without them torch fails inside, with "No backend type associated with device
    # type cpu". The ops run as they are issued; the end's work completes when all have.
    def _start_coalescing(self, device: object = None) -> None:
        if self._coalesced is not None:
            raise CollectiveError(f"rank {self.rank()}: _coalescing_manager entered twice on one group: "
                                  "finish the first block before starting another", rank=self.rank())
        self._coalesced = []

    def _end_coalescing(self, device: object = None) -> MlfabricWork:
        works, self._coalesced = self._coalesced, None
        if works is None:
            raise CollectiveError(f"rank {self.rank()}: _end_coalescing without _start_coalescing: use "
                                  "torch.distributed._coalescing_manager, which calls both", rank=self.rank())
        return self._all_of(works, [t for w in works for t in w._outputs], f"{len(works)} coalesced ops")

    def _all_of(self, works: list[MlfabricWork], outputs: list[torch.Tensor], what: str) -> MlfabricWork:
        """One work for several (the coalesced variants); it fails with the first error."""
        combined = torch.futures.collect_all([w._future for w in works])
        return self._work(_then(combined, lambda done: [f.value() for f in done]), outputs, what)

    def _check_pieces(self, pieces: list[torch.Tensor], like: torch.Tensor, what: str, name: str) -> None:
        """One piece per rank, each with ``like``'s size and dtype (gloo's rule too)."""
        if len(pieces) != self.size():
            raise ValueError(f"rank {self.rank()}: {what} needs {self.size()} tensors in {name}, got {len(pieces)}")
        for index, piece in enumerate(pieces):
            if piece.numel() != like.numel() or piece.dtype != like.dtype:
                raise ValueError(f"rank {self.rank()}: {what}: {name}[{index}] is {tuple(piece.shape)} "
                                 f"{piece.dtype}, expected {like.numel()} elements of {like.dtype} like "
                                 "this rank's tensor (mlfabric, like gloo, needs equal sizes here)")

    def _check_total(self, whole: torch.Tensor, piece: torch.Tensor, what: str, name: str) -> None:
        if whole.numel() != self.size() * piece.numel() or whole.dtype != piece.dtype:
            raise ValueError(f"rank {self.rank()}: {what}: the {name} must hold {self.size()} x "
                             f"{piece.numel()} elements of {piece.dtype}, got {tuple(whole.shape)} {whole.dtype}")


def create_process_group(store_and_ranks: object, options: object) -> ProcessGroupMlfabric:
    """Build the group torch asks for (see ``mlfabric/_plugin.py``): join the group's ranks
    through torch's store with a :class:`Communicator`."""
    if options is None:
        options = ProcessGroupOptions()
    if not isinstance(options, ProcessGroupOptions):
        raise TypeError(f"pg_options for the mlfabric backend must be mlfabric.torch.ProcessGroupOptions, "
                        f"got {type(options).__name__}")
    resolved = options.resolved()
    store = store_and_ranks.store  # type: ignore[attr-defined]
    rank, size = int(store_and_ranks.group_rank), int(store_and_ranks.group_size)  # type: ignore[attr-defined]
    timeout = store_and_ranks.timeout.total_seconds()  # type: ignore[attr-defined]
    choose_allreduce(str(resolved.algorithm), 0, size, resolved.topology)  # unknown names fail here
    comm = mlfabric.connect(store, rank, size, transport=str(resolved.transport), master_addr=_reachable_host(store),
                            timeout=timeout, topology=resolved.topology, chunk_bytes=resolved.chunk_bytes,
                            nic_rate=resolved.nic_rate)
    return ProcessGroupMlfabric(comm, resolved, group_name=str(store_and_ranks.group_id),  # type: ignore[attr-defined]
                                global_ranks=list(store_and_ranks.global_ranks_in_group))  # type: ignore[attr-defined]


def _reachable_host(store: object) -> str:
    """A host every rank reaches: MASTER_ADDR, else the host of the TCPStore under torch's
    prefix stores (``init_process_group(store=...)``), else loopback."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.host if isinstance(store, dist.TCPStore) else "127.0.0.1"


# -- mapping torch's arguments ----------------------------------------------------------------

def _single(tensors: list[torch.Tensor] | torch.Tensor, what: str, rank: int) -> torch.Tensor:
    """torch passes one tensor in a list (several were the retired one-process-many-GPUs API)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise ValueError(f"rank {rank}: {what} takes one tensor per process, got {len(tensors)}")
    return tensors[0]


def _single_list(lists: list[list[torch.Tensor]], what: str, rank: int) -> list[torch.Tensor]:
    if len(lists) != 1:
        raise ValueError(f"rank {rank}: {what} takes one list of tensors per process, got {len(lists)}")
    return list(lists[0])


def _op_of(opts: object) -> object:
    """The reduction in torch's options object (or a bare ReduceOp, another accepted form)."""
    if opts is None:
        return dist.ReduceOp.SUM
    return getattr(opts, "reduceOp", opts)


def _root_of(opts: object) -> int:
    return int(getattr(opts, "rootRank", 0))


def _timeout_of(opts: object) -> float | None:
    """An op's own timeout (torch's options carry the group's unless the call set one)."""
    timeout = getattr(opts, "timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None


# Reductions of booleans as gloo does them: a sum is "any", a product "all".
_BOOL_OPS = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def _wire(tensor: torch.Tensor, op: object, what: str, rank: int) -> tuple[torch.Tensor, object]:
    """The tensor mlfabric moves for ``tensor`` (a view of the same memory) and the reduction
    to apply: booleans travel as bytes (sum = or, product = and), complex numbers as pairs of
    reals (sum and average only)."""
    if tensor.dtype == torch.bool:
        name = None if op is None else reduce_op_name(op)
        if name is not None and name not in _BOOL_OPS:
            raise ValueError(f"rank {rank}: {what} of booleans supports SUM, PRODUCT, MIN and MAX, not {op}")
        return tensor.view(torch.uint8), (None if name is None else _BOOL_OPS[name])
    if tensor.is_complex():
        if op is not None and reduce_op_name(op) not in ("sum", "avg"):
            raise ValueError(f"rank {rank}: {what} of complex tensors supports SUM and AVG, not {op}")
        return torch.view_as_real(tensor), op
    return tensor, op


def _then(future: torch.futures.Future, step: Callable[[object], object]) -> torch.futures.Future:
    """``future`` followed by ``step(its value)`` (copies into the caller's tensors). Errors
    pass through as they are (``Future.then`` would wrap them in a RuntimeError, and callers
    could no longer catch mlfabric's PeerLostError or CollectiveMismatchError)."""
    chained: torch.futures.Future = torch.futures.Future()

    def run_step(done: torch.futures.Future) -> None:
        try:
            value = step(done.value())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            chained.set_exception(exc)
            return
        chained.set_result(value)

    future.add_done_callback(run_step)
    return chained


def _copy_rows(rows: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    for out, row in zip(outputs, rows):
        _copy_into(out, row)


def _copy_into(output: torch.Tensor, values: torch.Tensor) -> None:
    """``output``'s elements := ``values``' (same count, any shape; booleans come back as bytes)."""
    target = output.view(torch.uint8) if output.dtype == torch.bool else output
    if target.is_complex():
        target = torch.view_as_real(target)
    target.detach().copy_(values.reshape(target.shape))
