"""Elastic data-parallel training: a model and optimizer whose steps survive a lost rank.

    .venv/bin/python examples/elastic.py --help
    .venv/bin/python -m pytest tests/local/test_elastic_processes.py -q

In the spirit of torchft's ``Manager``: wrap the model and optimizer, call :meth:`Elastic.step`
after ``loss.backward()``::

    elastic = Elastic(model, optimizer, store=store, member=member_id, initial=range(4))
    while elastic.committed < total_steps:
        x, y = batch_for(elastic.committed, elastic.rank, elastic.world_size)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        elastic.step(weight=len(x))    # True: committed on every live rank; False: retried

Each step's gradients (times ``weight``, e.g. the batch's sample count) are summed over the
ranks of the current membership with one allreduce, in which two more numbers ride: the sum of
the weights (the gradient is divided by it: averaged over the ranks that contributed, in
proportion to their samples) and the leader's "joiners are waiting" flag. A failed allreduce
(a rank died) aborts the step on this rank and reconfigures the membership
(``mlfabric/runtime/elastic.py``); the quorum starts the new epoch at the highest committed
step and hands that state to any member behind it, so the step ends committed on all live
ranks or on none. A joiner (``initial=None``) receives the model, the optimizer state and
the step count before its first step.

Parameters must share one floating dtype (the gradient buffer is one flat tensor); optimizer
state may hold tensors of any dtype and plain numbers. A model on a GPU works as one on the CPU:
the gradients and the state a joiner receives are staged through host memory, and each received
state tensor goes where the sender kept it (beside its parameter, or in host memory like Adam's
step count); tests/unit/test_elastic_cuda.py checks it where a GPU is present.

With torch's DistributedDataParallel (``ddp = elastic.ddp()``, then ``ddp(x)`` and
``elastic.step()`` as above): DDP's gradient buckets are allreduced during ``backward()`` over
:attr:`Elastic.process_group`, the "mlfabric" backend's process group over the current
membership (:class:`ElasticProcessGroup`); a bucket that fails does not raise inside DDP but
marks the step, and :meth:`Elastic.step` then aborts it; otherwise one small allreduce (the
number of contributing ranks and the joiners' flag) commits it. Every rank's gradient counts
once (DDP's convention: equal local batches). ``examples/elastic_ddp.py`` runs it under
torchrun, one torchrun per rank.
"""

from __future__ import annotations

import contextlib
import time
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from mlfabric.collectives import choose_allreduce
from mlfabric.errors import CollectiveError, MlfabricError
from mlfabric.runtime.communicator import DEFAULT_TIMEOUT_S, Communicator
from mlfabric.runtime.elastic import DEFAULT_CONNECT_S, ElasticCommunicator
from mlfabric.runtime.membership import DEFAULT_GRACE_S, Store
from mlfabric.runtime.p2p import PointToPoint

from .backend import MlfabricWork, ProcessGroupMlfabric, ProcessGroupOptions

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["Elastic", "ElasticProcessGroup", "model_signature"]

log = logging.getLogger("mlfabric.elastic")


def model_signature(model: nn.Module) -> str:
    """Names, shapes and dtypes of ``model``'s parameters and buffers: what a joiner must share."""
    parts = [f"{name}:{'x'.join(map(str, t.shape)) or 'scalar'}:{str(t.dtype).removeprefix('torch.')}"
             for name, t in model.state_dict().items()]
    return ";".join(parts)


class Elastic:
    """See the module docstring. ``on_commit(step, elastic)`` is called after each committed
    step (measurements); ``algorithm`` is the allreduce schedule (ring, halving_doubling, tree,
    host_hierarchical, bcube, ...). ``topology`` (e.g. "bcube:n=2,k=2", member id i on host i)
    and ``hosts`` (member id -> host) describe the cluster: BCube and the switch hierarchy run
    while the members are exactly the topology's hosts and fall back to ring when one is lost
    (back again once it rejoins); host_hierarchical runs over the hosts that remain."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, store: Store, member: int,
                 initial: Sequence[int] | None = None, algorithm: str = "ring", job: str = "job",
                 address: str = "127.0.0.1", timeout: float = DEFAULT_TIMEOUT_S, grace_s: float = DEFAULT_GRACE_S,
                 connect_s: float = DEFAULT_CONNECT_S, topology: str | None = None,
                 hosts: Mapping[int, int] | None = None,
                 on_commit: Callable[[int, "Elastic"], None] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"Elastic needs parameters of one floating dtype, got {sorted(map(str, dtypes))}")
        self.dtype = next(iter(dtypes))
        self.committed = 0
        self.aborted = 0
        self.on_commit = on_commit
        choose_allreduce(algorithm, 0, 2)  # an unknown name fails here, not at the first step
        self.comm = ElasticCommunicator(store, member, self, initial=initial, job=job, address=address,
                                        timeout=timeout, grace_s=grace_s, connect_s=connect_s,
                                        topology=topology, hosts=hosts)
        self._group: ElasticProcessGroup | None = None
        self._ddp: DistributedDataParallel | None = None
        # The first failure of a DDP gradient bucket's allreduce in the current step.
        self._bucket_error: BaseException | None = None

    # -- membership ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def members(self) -> tuple[int, ...]:
        assert self.comm.membership is not None
        return self.comm.membership.members

    @property
    def process_group(self) -> "ElasticProcessGroup":
        """The "mlfabric" backend's process group over this job's current membership (for DDP
        and for torch.distributed calls with ``group=``); see :class:`ElasticProcessGroup`."""
        if self._group is None:
            self._group = ElasticProcessGroup(self)
        return self._group

    def ddp(self, **kwargs: Any) -> "DistributedDataParallel":
        """The model wrapped in torch's ``DistributedDataParallel`` over :attr:`process_group`;
        ``kwargs`` go to DDP (``bucket_cap_mb``, ...). Call :meth:`step` after each backward.

        DDP is built without its start-up broadcast (``init_sync=False``: the membership gave
        every member the same state already) and with a communication hook that allreduces each
        bucket on the current membership and never raises inside ``backward()`` (a failed
        bucket marks the step, which :meth:`step` then aborts). DDP rebuilds its buckets once,
        after its first backward, with a broadcast from rank 0: a joiner's first backward comes
        at another step than the members', and the broadcasts would not match. So the buckets
        are laid out here, in parameter order, on every process alike: a pure function of the
        model, so that broadcast runs locally."""
        from torch.nn.parallel import DistributedDataParallel

        fixed = {"process_group", "device_mesh", "init_sync", "broadcast_buffers"} & set(kwargs)
        if fixed:
            raise ValueError(f"Elastic.ddp() sets {sorted(fixed)} itself (the elastic group; no start-up "
                             "broadcast: the membership synchronised the state)")
        if self._ddp is not None:
            raise ValueError("Elastic.ddp() was called already: one DDP wrapper per Elastic")
        group = self.process_group
        with warnings.catch_warnings():
            # torch deprecates broadcast_buffers but says to keep it where buffers must not be
            # synchronised at init (its replacement still does that): the case here.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            ddp = DistributedDataParallel(self.model, process_group=group, init_sync=False, broadcast_buffers=False,
                                          **kwargs)
        ddp.register_comm_hook(self, _ddp_bucket_hook)
        ddp.reducer._push_all_rebuilt_params()
        with group.locally():
            ddp.reducer._rebuild_buckets()
        ddp._has_rebuilt_buckets = True
        self._ddp = ddp
        return ddp

    # -- the step --------------------------------------------------------------------------------

    def step(self, weight: float = 1.0) -> bool:
        """Average the gradients over this step's ranks and apply the optimizer: True when the
        step committed, False when it was aborted (a rank was lost; the membership changed and
        this rank now holds the job's latest committed state: compute the step again).
        With :meth:`ddp` the gradients were summed during backward; ``weight`` must be 1."""
        if self._ddp is not None:
            return self._ddp_step(weight)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        leader_flag = 1.0 if self.comm.rank == 0 and self.comm.joiners_waiting() else 0.0
        # The communicator moves host memory: the gradients of a model on an accelerator are
        # staged through one host buffer (as the "mlfabric" backend stages CUDA tensors).
        buf = torch.cat([g.detach().reshape(-1).to("cpu", self.dtype) for g in grads]
                        + [torch.tensor([1.0, leader_flag], dtype=self.dtype)])
        n = buf.numel() - 2
        if weight != 1.0:
            buf[:n].mul_(weight)
        buf[n] = weight
        comm = self.comm.comm
        assert comm is not None
        try:
            comm.allreduce(buf, algorithm=self.comm.algorithm_for(self.algorithm))
        except MlfabricError as exc:
            self.aborted += 1
            self.comm.reconfigure(f"step {self.committed} aborted: {type(exc).__name__}: {exc}")
            return False
        total, joiners = float(buf[n]), float(buf[n + 1])
        buf[:n].div_(total)
        offset = 0
        for p, g in zip(self.params, grads):
            size = g.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(buf[offset:offset + size].view_as(p.grad))  # back to p's device
            offset += size
        return self._commit(joiners)

    def _ddp_step(self, weight: float) -> bool:
        if weight != 1.0:
            raise ValueError(f"Elastic.step(weight={weight}): under DDP every rank's gradient counts once "
                             "(its buckets were summed during backward); call step() without a weight")
        failed, self._bucket_error = self._bucket_error, None
        buf = torch.tensor([1.0, 1.0 if self.comm.rank == 0 and self.comm.joiners_waiting() else 0.0],
                           dtype=torch.float64)
        if failed is None:
            comm = self.comm.comm
            assert comm is not None
            try:
                # Commits the step: every rank's buckets completed (a rank whose bucket failed
                # never calls this; it leaves the epoch, which fails this allreduce everywhere).
                comm.allreduce(buf, algorithm=self.comm.algorithm_for(self.algorithm))
            except MlfabricError as exc:
                failed = exc
        if failed is not None:
            self.aborted += 1
            self.comm.reconfigure(f"step {self.committed} aborted: {type(failed).__name__}: {failed}")
            return False
        contributors, joiners = float(buf[0]), float(buf[1])
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(contributors)
        return self._commit(joiners)

    def _commit(self, joiners: float) -> bool:
        """The step's gradients are averaged on every live rank: apply them, and admit the
        joiners the leader said are waiting (after the commit: they receive this step's state)."""
        self.optimizer.step()
        self.committed += 1
        if self.on_commit is not None:
            self.on_commit(self.committed, self)
        if joiners > 0:
            self.comm.reconfigure(f"admitting joiners after step {self.committed}", after_commit=True)
        return True

    def finish(self) -> None:
        """Training is over: processes still waiting to join give up (JobFinishedError)."""
        self.comm.finish()

    def close(self) -> None:
        if self._group is not None:
            self._group._closed = True
        self.comm.close()

    # -- state (runtime.elastic.StateHolder) -------------------------------------------------------

    def signature(self) -> str:
        return model_signature(self.model)

    def _tensors(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """The state's tensors in a fixed order, and its plain values."""
        tensors = [(f"model.{name}", t) for name, t in self.model.state_dict().items()]
        extra: dict[str, Any] = {}
        for i, p in enumerate(self.params):
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    # "@" marks a state tensor kept where its parameter is (Adam's moments);
                    # the others stay in host memory on the receiver too (Adam's step count)
                    where = "@" if value.device == p.device else ""
                    tensors.append((f"opt.{i}.{key}{where}", value))
                else:
                    extra[f"opt.{i}.{key}"] = value
        return tensors, extra

    def pack(self) -> tuple[dict[str, Any], torch.Tensor]:
        tensors, extra = self._tensors()
        layout, offset = [], 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
            offset += nbytes
        blob = torch.empty(offset, dtype=torch.uint8)  # host memory, whatever the state's devices
        for (name, _, _, start, nbytes), (_, t) in zip(layout, tensors):
            blob[start:start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return {"committed": self.committed, "layout": layout, "extra": extra, "packed_at": time.time()}, blob

    def unpack(self, header: dict[str, Any], blob: torch.Tensor) -> None:
        model_state = self.model.state_dict()
        for name, dtype, shape, start, nbytes in header["layout"]:
            value = blob[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
            if name.startswith("model."):
                key = name.removeprefix("model.")
                if key not in model_state or tuple(model_state[key].shape) != tuple(shape):
                    raise ValueError(f"the received state's {key} ({shape}) does not fit this model")
                with torch.no_grad():
                    model_state[key].copy_(value)  # onto the model's own device
            else:
                _, index, key = name.split(".", 2)
                param = self.params[int(index)]
                on_param = key.endswith("@")
                self.optimizer.state[param][key.removesuffix("@")] = (value.to(param.device, copy=True) if on_param
                                                                      else value.clone())
        for name, value in header["extra"].items():
            _, index, key = name.split(".", 2)
            self.optimizer.state[self.params[int(index)]][key] = value
        self.committed = int(header["committed"])


def _ddp_bucket_hook(elastic: Elastic, bucket: "torch.distributed.GradBucket") -> torch.futures.Future:
    """DDP's communication hook under :meth:`Elastic.ddp`: sum the bucket over the current
    membership. A failure is kept for :meth:`Elastic.step` (which aborts the step) instead of
    raising inside ``backward()``; the bucket then resolves to this rank's own gradients, which
    the aborted step never applies. After a failed bucket the step's later buckets are not sent
    (the peers fail theirs when this rank leaves the epoch)."""
    buffer = bucket.buffer()
    result: torch.futures.Future = torch.futures.Future()
    if elastic._bucket_error is not None:
        result.set_result(buffer)
        return result

    def settle(done: torch.futures.Future) -> None:
        try:
            done.value()
        except BaseException as exc:  # noqa: BLE001 - kept for step(), see above
            if elastic._bucket_error is None:
                elastic._bucket_error = exc
        result.set_result(buffer)

    try:
        work = elastic.process_group.allreduce([buffer])
    except MlfabricError as exc:  # the epoch's communicator is closed (an abort())
        elastic._bucket_error = exc
        result.set_result(buffer)
        return result
    work._future.add_done_callback(settle)
    return result


# DDP checks a hook's annotations against the objects (this module's are strings).
_ddp_bucket_hook.__annotations__ = {"elastic": Elastic, "bucket": torch.distributed.GradBucket,
                                    "return": torch.futures.Future[torch.Tensor]}


class ElasticProcessGroup(ProcessGroupMlfabric):
    """The "mlfabric" backend's process group over an elastic job's current membership: each
    call runs on the current membership epoch's communicator, so ``rank()`` and ``size()``
    follow the membership (torch's own copies, read by C++ code, keep the values at creation;
    DDP under :meth:`Elastic.ddp` reads neither). A collective that fails (a rank lost) fails
    here as on any group and :meth:`errored` says so until the membership changes.

    Lifetime: :meth:`abort` fails the current epoch's operations at once (the next
    :meth:`Elastic.step` aborts and the members form the next epoch: torchft's abort, then
    reconfigure; the peers see this member leave the epoch, so it comes back through the
    next epoch's join, receiving the state like a restarted process); :meth:`shutdown` leaves the job (the others go on without this member). Both
    are idempotent and never raise."""

    def __init__(self, elastic: Elastic) -> None:
        comm = elastic.comm.comm
        assert comm is not None
        self._elastic = elastic
        self._p2p_epoch = elastic.comm.epoch
        self._error_epoch = -1
        self._local_only = False
        super().__init__(comm, ProcessGroupOptions(algorithm=elastic.algorithm, transport="tcp").resolved(),
                         group_name=f"elastic:{elastic.comm.ms.prefix}")

    @property
    def comm(self) -> Communicator:
        comm = self._elastic.comm.comm
        assert comm is not None
        return comm

    # DDP's buckets run the wrapper's algorithm where the current membership supports it, else
    # its fallback (ElasticCommunicator.algorithm_for).
    @property
    def algorithm(self) -> str:
        return self._elastic.comm.algorithm_for(self._elastic.algorithm)

    @algorithm.setter
    def algorithm(self, value: str) -> None:
        pass  # ProcessGroupMlfabric's constructor sets it; the wrapper's algorithm is the one

    @property
    def p2p(self) -> PointToPoint:
        epoch = self._elastic.comm.epoch
        if epoch != self._p2p_epoch:  # a new membership: a new transport under it
            old, self._p2p = self._p2p, PointToPoint(self.comm.transport, timeout=self.comm.timeout)
            self._p2p_epoch = epoch
            old.close()
        return self._p2p

    def rank(self) -> int:
        return self._elastic.comm.rank

    def size(self) -> int:
        return self._elastic.comm.world_size

    def __repr__(self) -> str:
        return (f"ElasticProcessGroup(member={self._elastic.comm.member}, epoch={self._elastic.comm.epoch}, "
                f"rank={self.rank()}, size={self.size()}, algorithm={self.algorithm!r})")

    @contextlib.contextmanager
    def locally(self) -> Iterator[None]:
        """Broadcasts inside run on this process only (each rank already holds the root's
        value: :meth:`Elastic.ddp`'s bucket layout)."""
        self._local_only = True
        try:
            yield
        finally:
            self._local_only = False

    def broadcast(self, tensors: list[torch.Tensor] | torch.Tensor, opts: object = None) -> MlfabricWork:
        if self._local_only:
            done: torch.futures.Future = torch.futures.Future()
            outputs = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            done.set_result(outputs)
            return MlfabricWork(done, outputs, "broadcast (local: every rank holds the root's value)",
                                rank=self.rank())
        return super().broadcast(tensors, opts)

    # -- lifetime ------------------------------------------------------------------------------

    def _note_failure(self, done: torch.futures.Future) -> None:
        epoch = self._elastic.comm.epoch
        if self._error_epoch != epoch:
            self._error, self._error_epoch = None, epoch
        super()._note_failure(done)

    def errored(self) -> Exception | None:
        """The error that broke the current membership epoch (a failed operation, a peer seen
        gone), or None; None again once the members formed the next epoch."""
        if self._error_epoch != self._elastic.comm.epoch:
            self._error = None
        return super().errored()

    def abort(self) -> None:
        """Fail the current membership epoch's operations at once; the next step aborts and the
        members form the next epoch. Never raises."""
        epoch = self._elastic.comm.epoch
        reason = f"its elastic process group was aborted (membership epoch {epoch})"
        self._error, self._error_epoch = CollectiveError(
            f"member {self._elastic.comm.member}: {reason}; the next step aborts and the members form the next "
            "membership", rank=self.rank()), epoch
        try:
            self.comm.close(reason=reason)
        except Exception as exc:  # noqa: BLE001 - aborting must succeed
            log.warning("member %d: abort: closing epoch %d raised %s (ignored)", self._elastic.comm.member,
                        epoch, exc)

    def shutdown(self) -> None:
        """Leave the job (the other members go on without this one). Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            self._p2p.close()
            self._elastic.comm.close()
        except Exception as exc:  # noqa: BLE001 - leaving must succeed
            log.warning("member %d: shutdown raised %s (ignored)", self._elastic.comm.member, exc)
