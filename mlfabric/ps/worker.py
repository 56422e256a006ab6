"""The worker's side of the parameter server: push, pull, clock (MLNET) and push/get/allreduce (MLfabric).

    python -m pytest tests/unit/test_ps.py tests/local/test_ps_processes.py

Both papers' APIs on one implementation (:class:`PSWorker`):

* MLNET: ``pull(model, staleness)``, ``push(model, gradients)``, ``clock()``;
* MLfabric Table 1: ``push(server, update, update_norm)``, ``get(server, model)``,
  ``allreduce(update)`` (realised through push/get to a root drawn at random, §6).

Every call checks its arguments on the caller at once (model registered, keys, shapes, dtype)
and names the worker, the key and what was expected. Every wait is bounded by the
configuration's ``timeout_s``, and a server that dies or leaves makes the waiting call raise
:class:`mlfabric.PeerLostError` naming it as soon as the transport knows (well within 2 s
over TCP). ``*_async`` variants return ``torch.futures.Future``; they run one at a time, in
call order, on the worker's own thread.

A typical iteration: ``pull`` (answered when the consistency model allows), compute, ``push``,
``clock``. The worker's clock counts its finished iterations; a pull carries it so the server
can hold it back under BSP/SSP (:mod:`mlfabric.ps.consistency`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import torch

from mlfabric.errors import CollectiveTimeoutError, PeerLostError
from mlfabric.transport.base import Message, SendHandle, Transport, tensor_bytes

from . import protocol
from .config import PSConfig
from .layout import PSLayout
from .model import ModelSpec, Tensors
from .policies.ordered import ORDERS, ArrivingModel, check_priorities
from .policy import Policy, make_policy, send_pulls_directly
from .protocol import PSRequestError, payload_tensor
from .waits import wait_until

log = logging.getLogger("mlfabric.ps")
T = TypeVar("T")


class _Redirected(Exception):
    """A server was lost and its replica took over: the waiting call asks again."""


@dataclass
class WorkerStats:
    pushes: int = 0
    pulls: int = 0
    pull_latency_s: list[float] = field(default_factory=list)
    versions_seen: list[int] = field(default_factory=list)  # server 0's version at each pull
    #: (this worker's clock, server 0's model clock) at each pull: SSP's bound is
    #: model clock >= clock - s (None: every other worker had left).
    pull_clocks: list[tuple[int, int | None]] = field(default_factory=list)
    relayed: int = 0  # model shards this worker forwarded as a distributor (§10.3)
    pushes_dropped: int = 0  # updates MLfabric's scheduler dropped (push returned False)
    rejoined_at_clock: int | None = None  # a restarted worker: the clock it was taken back at

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.pull_latency_s)
        return {"pushes": self.pushes, "pulls": self.pulls, "relayed": self.relayed,
                "pushes_dropped": self.pushes_dropped, "rejoined_at_clock": self.rejoined_at_clock,
                "pull_latency_ms_mean": 1e3 * sum(lat) / len(lat) if lat else None,
                "pull_latency_ms_p50": 1e3 * lat[len(lat) // 2] if lat else None,
                "pull_latency_ms_max": 1e3 * lat[-1] if lat else None}


class PSWorker:
    """Worker ``layout.worker_index(transport.rank)`` of a PS job (module docstring)."""

    def __init__(self, transport: Transport, layout: PSLayout, config: PSConfig, *,
                 routing: Policy | None = None, channel: str | None = None) -> None:
        self.transport = transport
        self.layout = layout
        self.config = config
        self.index = layout.worker_index(transport.rank)
        self.who = layout.describe(transport.rank)
        self.channel = channel or transport.channels[0]
        #: The routing policy (:mod:`mlfabric.ps.policy`): how pushes, pulls and clocks leave.
        self.routing: Policy = routing or make_policy(config)
        self.models: dict[str, ModelSpec] = {}
        self.versions: dict[str, list[int]] = {}
        self.clock_value = 0
        self.stats = WorkerStats()
        self._ids = itertools.count(1)  # 0 is the tag of errors about pushes and clocks
        self._allreduce_seq = itertools.count(1)
        self._roots = random.Random(config.seed * 7_919 + 1)
        # Sends whose source must stay untouched until done: tensors, or received messages a
        # distributor forwards.
        self._inflight: list[tuple[SendHandle, Any]] = []
        self._left = False
        self._lock = threading.RLock()
        #: The rank serving each shard: the server, or its replica after a failover.
        self.serving: list[int] = list(layout.server_ranks)
        self.failovers = 0
        # Lost servers whose shard a replica serves now. The worker's thread and its mlnet tree
        # node both fail over (whichever sees the loss first), once.
        self._failed_over: set[int] = set()
        self._failover_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._arriving: dict[str, ArrivingModel] = {}  # the last ordered pull per model

    # -- registration ------------------------------------------------------------------------

    def init_model(self, name: str, tensors: Tensors, *, lr: float = 0.01, momentum: float = 0.0,
                   priorities: Mapping[str, int] | None = None) -> ModelSpec:
        """Register model ``name`` with its initial values (every worker calls it with the same
        layout; the first values to reach a server win). ``lr``/``momentum``: the server's
        eq. (1)-(2). ``priorities`` (key -> int, lower first; TicTac's TIO/TAO from
        :mod:`mlfabric.order`): the order in which servers send the tensors to
        :meth:`pull_in_order` (:mod:`mlfabric.ps.policies.ordered`). Waits until every server has it."""
        with self._lock:
            self._check_open("init_model")
            spec = ModelSpec.of(name, tensors)
            if name in self.models and self.models[name] != spec:
                raise ValueError(f"{self.who}: init_model({name!r}) again with another layout")
            flat = spec.flatten(tensors, who=self.who, op="init_model")
            extra = {} if priorities is None else {"priorities": check_priorities(spec, priorities, self.who)}
            ids = []
            for j, (offset, length) in enumerate(spec.shards(self.layout.servers)):
                request_id = next(self._ids)
                ids.append(request_id)
                component = flat[offset:offset + length].contiguous()
                handle = self.transport.send(self.server_rank(j), protocol.request_tag(self.config.session),
                                             tensor_bytes(component), channel=self.channel,
                                             meta=protocol.Init(id=request_id, spec=spec.to_json(), lr=lr,
                                                                momentum=momentum, **extra).encode())
                self._inflight.append((handle, component))
            versions = [int(self._await(j, request_id, f"init_model({name!r})")[0]["version"])
                        for j, request_id in enumerate(ids)]
            self.models[name] = spec
            self.versions[name] = versions
            return spec

    def rejoin(self, incarnation: int) -> int:
        """This worker's process was restarted (its rank's ``incarnation``-th process, on a
        transport from :meth:`mlfabric.transport.tcp.TcpTransport.rejoin`): ask every server
        to take it back. Each answers with the clock it counts this worker from; the worker
        takes the highest and tells the others (an adopt, ahead of its first push on the same
        connection), so that no server counts it in a round it will not push to. Returns that
        clock. Then call :meth:`init_model` as at the start (the servers keep their model:
        only the layout is checked) and :meth:`pull` the current model. Bounded by the
        config's ``timeout_s`` per server, naming it."""
        with self._lock:
            self._check_open("rejoin")
            endpoints = dict(getattr(self.transport, "endpoints", {}))
            # Request ids of this process apart from the old one's (replies carry them in their
            # tags): an answer meant for the old process can never pass for one of ours. Below
            # 2**38, where an mlnet node's own ids start.
            self._ids = itertools.count(1 + (incarnation % 64) * (1 << 32))
            at_least = self.routing.before_rejoin(self, incarnation)
            ids = []
            for j in range(self.layout.servers):
                request_id = next(self._ids)
                ids.append(request_id)
                self.transport.send(self.server_rank(j), protocol.request_tag(self.config.session), b"",
                                    meta=protocol.Rejoin(id=request_id, incarnation=incarnation, endpoints=endpoints,
                                                         at_least=at_least).encode(), channel=self.channel)
            clocks = [int(self._await(j, request_id, f"rejoin (incarnation {incarnation})")[0]["clock"])
                      for j, request_id in enumerate(ids)]
            clock = max(clocks)
            tag = protocol.request_tag(self.config.session)
            for j, theirs in enumerate(clocks):
                if theirs != clock:
                    self.transport.send(self.server_rank(j), tag, b"", meta=protocol.Adopt(clock=clock).encode(),
                                        channel=self.channel)
            self.clock_value = clock
            self.stats.rejoined_at_clock = clock
            self.routing.after_rejoin(self, clock)
            return clock

    # -- push -----------------------------------------------------------------------------------

    def push(self, target: str | int, update: Tensors, update_norm: float | None = None, *,
             model: str | None = None) -> bool:
        """MLNET ``push(model, gradients)``: ``target`` is the model's name and ``update`` its
        gradients (a mapping key -> tensor, a sequence in registration order, a module whose
        parameters hold them, or the flat vector). MLfabric ``push(server, update,
        update_norm)``: ``target`` is a server index and ``update`` that server's component
        (the flat range of ``model``, by default the only registered model). Returns once the
        transport has the data (it leaves in the background): True, or False if MLfabric's
        scheduler dropped the update (Alg. 2: it could not meet the delay bound)."""
        with self._lock:
            self._check_open("push")
            if isinstance(target, int) and not isinstance(target, bool):
                spec = self._model(model, "push")
                server = self._server(target, "push")
                offset, length = spec.shards(self.layout.servers)[server]
                components = {server: _component(update, spec, length, f"{self.who}: push to server {server}")}
            else:
                if model is not None:
                    raise TypeError(f"{self.who}: push(model, gradients) names the model once; drop model=")
                spec = self._model(target, "push")
                flat = spec.flatten(_gradients(update) if isinstance(update, torch.nn.Module) else update,
                                    who=self.who, op="push")
                components = {j: flat[offset:offset + length]
                              for j, (offset, length) in enumerate(spec.shards(self.layout.servers))}
            # (one function from here to the policy's send: issue 35's check 6 counts the stops)
            norm = update_norm
            if norm is None and self.routing.needs_push_norm:
                # one float64 pass over the update, without a copy of it (only the scheduled policy reads it)
                norm = math.sqrt(sum(float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2
                                     for c in components.values()))
            pushes = [protocol.Push(model=spec.name, clock=self.clock_value, version=self.versions[spec.name][j],
                                    norm=norm) for j in components]
            servers = list(components)
            parts = [components[j] for j in servers]
            if len(servers) == self.layout.servers:  # every component (keyed 0..S-1 then): the policy's
                handles = self.routing.send_push(self, spec.name, parts, pushes)
                if handles is None:
                    self.stats.pushes_dropped += 1
                    return False
            else:  # one component (MLfabric's push(server, ...)): straight to that server
                tag = protocol.request_tag(self.config.session)
                handles = [self.transport.send(self.server_rank(j), tag, tensor_bytes(c), meta=p.encode(),
                                               channel=self.channel) for j, c, p in zip(servers, parts, pushes)]
            self._inflight += list(zip(handles, parts))
            self._inflight = [(h, t) for h, t in self._inflight if not h.done()]
            self.stats.pushes += 1
            return True

    def push_async(self, target: str | int, update: Tensors, update_norm: float | None = None, *,
                   model: str | None = None) -> torch.futures.Future:
        snapshot = _detach(update)
        return self._submit(lambda: self.push(target, snapshot, update_norm, model=model))

    # -- clock ----------------------------------------------------------------------------------

    def clock(self) -> int:
        """Finish this iteration: tell every server, and return the new clock."""
        with self._lock:
            self._check_open("clock")
            clocks = self._clock_headers()
            if clocks is not None:
                tag = protocol.request_tag(self.config.session)
                for j, meta in enumerate(clocks):
                    self.transport.send(self.server_rank(j), tag, b"", meta=meta, channel=self.channel)
            return self.clock_value

    def _clock_headers(self) -> list[bytes] | None:
        """Finish this iteration (the lock held): the CLOCK header for each server, for the
        caller to send, or None where the routing sent the clock itself (mlnet: up the trees
        with the sums)."""
        clock, self.clock_value = self.clock_value, self.clock_value + 1
        if self.routing.send_clock(self, clock):
            return None
        return [protocol.Clock(clock=clock).encode()] * self.layout.servers

    # -- pull / get -----------------------------------------------------------------------------

    def pull(self, model: str, staleness: int | None = None) -> dict[str, torch.Tensor]:
        """MLNET ``pull(model, staleness)``: the model, once the servers' model clock is within
        ``staleness`` of this worker's clock (default: the job's consistency). Returns the
        model's tensors by key (views of one flat tensor, :meth:`pull_flat`)."""
        spec = self._model(model, "pull")
        return spec.unflatten(self.pull_flat(model, staleness))

    def pull_flat(self, model: str, staleness: int | None = None, *, out: torch.Tensor | None = None,
                  clock: bool = False) -> torch.Tensor:
        """:meth:`pull` as one flat tensor (written into ``out`` when given). ``clock=True``:
        :meth:`clock` first, its message handed to the transport with the pull's (see
        :meth:`pull_in_order`)."""
        with self._lock:
            self._check_open("pull")
            spec = self._model(model, "pull")
            if staleness is not None and staleness < 0:
                raise ValueError(f"{self.who}: pull({model!r}) with staleness {staleness}; it must be >= 0")
            if out is None:
                out = torch.empty(spec.numel, dtype=spec.torch_dtype)
            elif out.numel() != spec.numel or out.dtype != spec.torch_dtype or not out.is_contiguous():
                raise ValueError(f"{self.who}: pull({model!r}, out=...) needs a contiguous {spec.numel} x "
                                 f"{spec.dtype} tensor, got {tuple(out.shape)} x {out.dtype}")
            started = time.monotonic()
            flat = out.reshape(-1)
            clocks = self._clock_headers() if clock else None
            for _attempt in range(self.layout.servers + 1):  # a failover restarts the pull
                try:
                    self._pull_into(spec, model, staleness, flat, clocks)
                    break
                except _Redirected:
                    clocks = None  # they went with the first try (a promoted replica adopts clocks)
                    continue
            else:
                raise PeerLostError(f"{self.who}: pull({model!r}): servers kept failing", rank=self.transport.rank)
            self.stats.pulls += 1
            self.stats.pull_latency_s.append(time.monotonic() - started)
            self.stats.versions_seen.append(self.versions[model][0])
            return out

    def _pull_into(self, spec: ModelSpec, model: str, staleness: int | None, flat: torch.Tensor,
                   clocks: list[bytes] | None) -> None:
        ids = [next(self._ids) for _ in range(self.layout.servers)]
        self.routing.send_pull(self, [protocol.Pull(id=request_id, model=model, clock=self.clock_value,
                                                    staleness=staleness) for request_id in ids], clocks=clocks)
        for j, ((offset, length), request_id) in enumerate(zip(spec.shards(self.layout.servers), ids)):
            header, msg = self._await_model(j, request_id, model, staleness,
                                            f"pull({model!r}) at clock {self.clock_value}")
            flat[offset:offset + length].copy_(
                payload_tensor(msg.payload, spec.torch_dtype, length, f"{self.who}: pull from server {j}"))
            self.versions[model][j] = int(header["version"])
            if j == 0:
                self.stats.pull_clocks.append((self.clock_value, header.get("model_clock")))

    def pull_async(self, model: str, staleness: int | None = None) -> torch.futures.Future:
        return self._submit(lambda: self.pull(model, staleness))

    def pull_in_order(self, model: str, into: torch.nn.Module | torch.Tensor, *, order: str = "priority",
                      staleness: int | None = None, clock: bool = False) -> ArrivingModel:
        """Pull ``model`` answered per tensor in ``order`` (``"priority"``: the priorities given
        to :meth:`init_model`; ``"random"``: a fresh random order per pull), each tensor written
        into ``into`` (a module whose parameters are the model's keys, or the flat tensor) as
        it lands. Returns at once; :meth:`ArrivingModel.wait` blocks until tensors are in
        (:class:`mlfabric.ps.overlap.ParameterGate` waits per module). The previous ordered
        pull of ``model`` is finished first.

        ``clock=True``: :meth:`clock` first (the previous iteration ends), its message handed
        to the transport in one call with the pull's, so that a server finds both in one turn.
        Sent apart, the clock of BSP's last worker closes the round and the server answers the
        pulls waiting for it before this worker's pull is in: that pull is answered a server
        turn later (1-3 ms on the emulated TicTac runs), and it is the one every worker waits
        for."""
        with self._lock:
            self._check_open("pull_in_order")
            spec = self._model(model, "pull_in_order")
            if order not in ORDERS:
                raise ValueError(f"{self.who}: pull_in_order({model!r}, order={order!r}); choose one of {ORDERS}")
            if staleness is not None and staleness < 0:
                raise ValueError(f"{self.who}: pull_in_order({model!r}) with staleness {staleness}; it must be >= 0")
            previous = self._arriving.get(model)
            if previous is not None:
                previous.join()
            targets = _flat_targets(spec, into, self.who)
            ids = [next(self._ids) for _ in range(self.layout.servers)]
            clocks = self._clock_headers() if clock else None
            requested = time.monotonic()
            send_pulls_directly(self, [protocol.Pull(id=request_id, model=model, order=order, clock=self.clock_value,
                                                     staleness=staleness) for request_id in ids], clocks=clocks)
            arriving = self._arriving[model] = ArrivingModel(self, spec, targets, list(enumerate(ids)), order,
                                                             requested)
            self.stats.pulls += 1
            return arriving

    def get(self, server: int, model: str) -> torch.Tensor:
        """MLfabric ``get(server, model)``: server ``server``'s shard of ``model`` (flat), at once
        whatever the consistency (staleness unbounded)."""
        with self._lock:
            self._check_open("get")
            spec = self._model(model, "get")
            j = self._server(server, "get")
            request_id = next(self._ids)
            self.transport.send(self.server_rank(j), protocol.request_tag(self.config.session), b"",
                                channel=self.channel,
                                meta=protocol.Pull(id=request_id, model=model, clock=self.clock_value,
                                                   staleness=float("inf")).encode())
            header, msg = self._await(j, request_id, f"get(server={j}, model={model!r})")
            self.versions[model][j] = int(header["version"])
            _, length = spec.shards(self.layout.servers)[j]
            return payload_tensor(msg.payload, spec.torch_dtype, length, f"{self.who}: get from server {j}").clone()

    # -- allreduce (MLfabric §6) ------------------------------------------------------------------

    def allreduce(self, update: torch.Tensor) -> torch.Tensor:
        """The sum of every worker's ``update`` (same shape and dtype on all), through push/get
        to a root worker drawn at random (the same draw on every worker: call it the same
        number of times everywhere). Returns a new tensor."""
        with self._lock:
            self._check_open("allreduce")
            if not isinstance(update, torch.Tensor):
                raise TypeError(f"{self.who}: allreduce expects a tensor, got {type(update).__name__}")
            seq = next(self._allreduce_seq)
            root = self._roots.randrange(self.layout.workers)
            flat = update.detach().to("cpu").reshape(-1).contiguous()
            what = f"allreduce #{seq} (root: {self.layout.describe(self.layout.worker_rank(root))})"
            push_tag = protocol.tag(protocol.ALLREDUCE_PUSH, self.config.session, seq)
            result_tag = protocol.tag(protocol.ALLREDUCE_RESULT, self.config.session, seq)
            root_rank = self.layout.worker_rank(root)
            if self.index != root:
                handle = self.transport.send(root_rank, push_tag, tensor_bytes(flat), channel=self.channel)
                self._inflight.append((handle, flat))
                msg = self._take(root_rank, result_tag, what)
                return payload_tensor(msg.payload, flat.dtype, flat.numel(), what).clone().view(update.shape)
            total = flat.clone()
            for w in range(self.layout.workers):
                if w != self.index:
                    msg = self._take(self.layout.worker_rank(w), push_tag, what)
                    total.add_(payload_tensor(msg.payload, flat.dtype, flat.numel(), f"{what} from worker {w}"))
            handles = [self.transport.send(self.layout.worker_rank(w), result_tag, tensor_bytes(total),
                                           channel=self.channel)
                       for w in range(self.layout.workers) if w != self.index]
            self._inflight += [(h, total) for h in handles]
            return total.view(update.shape)

    # -- leaving -----------------------------------------------------------------------------------

    def leave(self) -> None:
        """Tell the servers this worker is done (they stop waiting for it at once); idempotent.
        The transport stays open for the caller."""
        with self._lock:
            if self._left:
                return
            self._left = True
            # updates a policy still holds leave before the leave message
            self.routing.flush(self.config.timeout_s)
            # Replicas hear it too: one that takes over later must not wait for this worker.
            for rank in dict.fromkeys([*self.serving, *self.layout.replica_ranks]):
                if rank not in self.transport.lost_peers:
                    self.transport.send(rank, protocol.request_tag(self.config.session), b"",
                                        meta=protocol.Leave().encode(), channel=self.channel)
            def sent() -> bool:
                self._inflight = [(h, t) for h, t in self._inflight if not h.done()]
                return not self._inflight

            wait_until(self.transport, sent, time.monotonic() + self.config.timeout_s, who=self.who,
                       what="leave: the sends in flight", required=False, poll=0.01)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    close = leave

    def __enter__(self) -> "PSWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # -- plumbing ----------------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], T]) -> torch.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"mlfabric-ps-w{self.index}")
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the future's waiter
                future.set_exception(exc)

        self._pool.submit(run)
        return future

    def _check_open(self, op: str) -> None:
        if self._left:
            raise RuntimeError(f"{self.who}: {op} after leave()")
        for rank in list(self.serving):
            if rank in self.transport.lost_peers and self.fail_over(rank):
                continue
            if self.transport.is_gone(rank):
                raise self.lost_error(rank, op)
        error = self.transport.mailbox.take(self.channel, protocol.reply_tag(self.config.session, 0))
        if error is not None:
            raise PSRequestError(protocol.decode(error.meta).get("message", "a server refused a request"))

    def track(self, handle: SendHandle, source: Any) -> None:
        """Keep ``source`` (a tensor, a received message) alive until ``handle`` is done."""
        self._inflight.append((handle, source))

    def server_rank(self, server: int) -> int:
        """The rank serving shard ``server`` now (its replica after a failover)."""
        return self.serving[server]

    def fail_over(self, peer: int) -> bool:
        """``peer`` was lost: if it served a shard that a live replica can take over
        (:func:`~mlfabric.ps.replica.failover_refusal`), send that shard's requests (and, under
        the scheduled policy, the scheduler's) to the replica from now on, tell it this
        worker's clock, and return True (True again for a peer already failed over). The update
        in flight to ``peer`` is lost; fresh ones make it up (MLfabric §3.3). Under mlnet the
        worker's tree node re-attaches to the replica and tells it the clocks instead."""
        from .failover import failover_refusal, live_replicas

        with self._failover_lock:
            if peer in self._failed_over:
                return True
            if peer not in self.serving or failover_refusal(self.config, self.layout) is not None:
                return False
            j = self.serving.index(peer)
            candidates = live_replicas(self.layout, self.transport, j)
            if not candidates:
                return False
            self.serving[j] = candidates[0]
            self._failed_over.add(peer)
            self.failovers += 1
        log.warning("%s: %s was lost; shard %d is now served by %s", self.who, self.layout.describe(peer), j,
                    self.layout.describe(candidates[0]))
        self.routing.after_failover(self, candidates[0])
        return True

    def _model(self, model: str | None, op: str) -> ModelSpec:
        if model is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ValueError(f"{self.who}: {op} needs model=: registered models are {list(self.models)}")
        spec = self.models.get(model)
        if spec is None:
            known = ", ".join(map(repr, self.models)) or "none"
            raise KeyError(f"{self.who}: {op}({model!r}) before init_model({model!r}) (registered: {known}); "
                           f"call init_model({model!r}, tensors) on every worker first")
        return spec

    def _server(self, server: int, op: str) -> int:
        if not 0 <= server < self.layout.servers:
            raise ValueError(f"{self.who}: {op} to server {server}, but this job has servers "
                             f"0..{self.layout.servers - 1}")
        return server

    def _await_model(self, server: int, request_id: int, model: str, staleness: int | None,
                     what: str) -> tuple[dict[str, Any], Message]:
        """A pull's answer from server ``server``: the shard itself, or (MLfabric's model
        distribution, §10.3) a note naming the distributor that relays it. A distributor is
        named a list of other pullers in its own answer, and forwards them the shard at once.
        A worker whose distributor is lost before the shard came asks the server again, to be
        answered directly."""
        header, msg = self._await(server, request_id, what)
        # Multicast (#36): this worker's children in the model's tree (the server's answer or
        # the "via" note names the tree, ``mtree``: host -> [[child, its request id], ...])
        children = [(int(c), int(rid)) for c, rid in (header.get("mtree") or {}).get(str(self.transport.rank), [])]
        relayed_here = header["op"] == "via"
        if relayed_here:
            relay = int(header["distributor"])
            try:
                msg = self._take(relay, protocol.reply_tag(self.config.session, request_id),
                                 f"{what} (relayed by {self.layout.describe(relay)})")
                header = protocol.decode(msg.meta)
                if "chunks" in header:
                    return self._gather_chunks(relay, request_id, header, msg, children, what)
            except PeerLostError:
                if relay not in self.transport.lost_peers and relay not in self.transport.departed_peers:
                    raise
                log.warning("%s: %s was lost before relaying %s; asking %s directly", self.who,
                            self.layout.describe(relay), what, self.layout.describe(self.server_rank(server)))
                retry = next(self._ids)
                self.transport.send(self.server_rank(server), protocol.request_tag(self.config.session), b"",
                                    channel=self.channel,
                                    meta=protocol.Pull(id=retry, model=model, clock=self.clock_value,
                                                       staleness=staleness, direct=True).encode())
                header, msg = self._await(server, retry, what)
                self._relay(children, msg)  # the subtree below still waits on this worker
                return header, msg
        elif "chunks" in header:  # a multicast tree's root: the chunks come from the server
            return self._gather_chunks(self.server_rank(server), request_id, header, msg, children, what)
        if children:
            self._relay(children, msg)
        forward = header.pop("forward", None)
        if forward and not relayed_here:
            # The header goes on as it came (not decoded and encoded again): its ``forward`` is
            # this distributor's list, which a worker that got its model relayed ignores.
            for rank, rid in forward:
                handle = self.transport.send(int(rank), protocol.reply_tag(self.config.session, int(rid)),
                                             msg.payload, meta=msg.meta, channel=self.channel)
                self._inflight.append((handle, msg))  # the received buffer stays alive until sent
            self.stats.relayed += len(forward)
        return header, msg

    def _relay(self, children: list[tuple[int, int]], msg: Message) -> None:
        """Send a model message (a chunk, or the whole shard) on to this worker's children in
        the model's multicast tree, as it came: its header's bytes too (not decoded and encoded
        again); the received buffer stays alive until sent."""
        if not children:
            return
        for rank, rid in children:
            handle = self.transport.send(rank, protocol.reply_tag(self.config.session, rid), msg.payload,
                                         meta=msg.meta, channel=self.channel)
            self._inflight.append((handle, msg))
        self.stats.relayed += len(children)

    def _gather_chunks(self, src: int, request_id: int, header: dict[str, Any], msg: Message,
                       children: list[tuple[int, int]], what: str) -> tuple[dict[str, Any], Message]:
        """A shard multicast chunk by chunk (#36): each chunk goes on to the children as soon as
        it is here (cut-through: the next one is being received meanwhile), and into one
        buffer; returns the whole shard as one message. A whole answer in between (the
        sender's relay was lost and it asked the server directly) replaces the chunks."""
        chunks, elems = int(header["chunks"]), int(header["elems"])
        itemsize = int(header["itemsize"])
        buffer = bytearray(int(header["nbytes"]))
        got: set[int] = set()
        tag = protocol.reply_tag(self.config.session, request_id)
        while True:
            self._relay(children, msg)
            if "chunks" not in header:
                return header, msg
            index = int(header["chunk"])
            start = index * elems * itemsize
            buffer[start:start + msg.payload.nbytes] = msg.payload
            got.add(index)
            if len(got) == chunks:
                break
            msg = self._take(src, tag, f"{what} (chunk {len(got) + 1} of {chunks} from {self.layout.describe(src)})")
            header = protocol.decode(msg.meta)
        whole = {k: v for k, v in header.items() if k not in ("chunk", "chunks", "elems", "itemsize", "nbytes", "mtree")}
        # the whole shard's header is ``whole`` (what the caller reads); its message goes
        # nowhere (every relay sent the chunks on as they came), so it carries no encoded meta
        return whole, Message(src=src, tag=tag, channel=self.channel, meta=b"", payload=memoryview(buffer))

    def _await(self, server: int, request_id: int, what: str) -> tuple[dict[str, Any], Message]:
        msg = self._take(self.server_rank(server), protocol.reply_tag(self.config.session, request_id), what)
        header = protocol.decode(msg.meta)
        if header["op"] == "error":
            if "lost_peer" in header:  # an mlnet tree node lost its parent (ps/policies/mlnet.py)
                raise PeerLostError(header["message"], rank=self.transport.rank, peer=int(header["lost_peer"]))
            raise PSRequestError(header["message"])
        return header, msg

    def _take(self, src: int, tag: int, what: str) -> Message:
        """The message ``tag`` from ``src``, bounded by the timeout. PeerLostError as soon as
        ``src`` or any server is lost or has left: a worker cannot go on without every shard,
        and a call waiting on a live server (a BSP pull held for a round) must not wait out
        the timeout because another server died."""
        transport = self.transport

        def gone(peer: int) -> BaseException:
            if peer in transport.lost_peers and self.fail_over(peer):
                return _Redirected(peer)
            return self.lost_error(peer, what)

        def late() -> BaseException:
            # init_model waits on nothing but the server's loop; pulls wait on clocks too
            hint = ("it is alive but not serving: call serve() on its rank (PSJob.serve, or "
                    "mlfabric.ps.init on every rank of the launch)" if what.startswith("init_model") else
                    "it is alive; under BSP/SSP it waits for the slowest worker's clock: is a worker stuck or "
                    "not calling clock()?")
            return CollectiveTimeoutError(f"{self.who}: {what}: no answer from {self.layout.describe(src)} within "
                                          f"{self.config.timeout_s:g} s ({hint})", rank=transport.rank, peer=src)

        msg = wait_until(transport, lambda: transport.mailbox.take(self.channel, tag, src),
                         time.monotonic() + self.config.timeout_s, who=self.who, what=what,
                         watch=(src, *self.serving), on_gone=gone, on_timeout=late)
        assert msg is not None  # required: a timeout raised
        return msg

    def lost_error(self, peer: int, what: str) -> PeerLostError:
        """The error a call during ``what`` raises because ``peer`` was lost or left (naming it)."""
        transport = self.transport
        name = self.layout.describe(peer)
        if peer in transport.lost_peers:
            hint = ("no replica takes over in this runtime: restart the job" if self.layout.role(peer) == "server"
                    else "restart the job without it")
            text = f"{self.who}: {name} was lost ({transport.lost_peers[peer]}) during {what}; {hint}"
        else:
            text = f"{self.who}: {name} left the job during {what}"
        return PeerLostError(text, rank=transport.rank, peer=peer)


def _component(update: Tensors, spec: ModelSpec, length: int, who: str) -> torch.Tensor:
    if not isinstance(update, torch.Tensor):
        raise TypeError(f"{who}: push(server, update) takes that server's flat component (a tensor), "
                        f"got {type(update).__name__}")
    if update.numel() != length:
        raise ValueError(f"{who}: component of {update.numel()} elements, expected {length} (the server's range of "
                         f"model {spec.name!r})")
    if str(update.dtype).removeprefix("torch.") != spec.dtype:
        raise TypeError(f"{who}: component of dtype {update.dtype}, expected {spec.dtype}")
    return update.detach().to("cpu").reshape(-1).contiguous().clone()


def _flat_targets(spec: ModelSpec, into: torch.nn.Module | torch.Tensor, who: str) -> dict[str, torch.Tensor]:
    """Flat views, by key, of where an ordered pull writes each tensor (checked against ``spec``)."""
    if isinstance(into, torch.nn.Module):
        params = dict(into.named_parameters())
        out = {}
        for t in spec.tensors:
            p = params.get(t.key)
            if p is None or tuple(p.shape) != t.shape or p.dtype != spec.torch_dtype or not p.is_contiguous():
                found = "missing" if p is None else f"{tuple(p.shape)} x {p.dtype}"
                raise ValueError(f"{who}: pull_in_order into a module: parameter {t.key!r} must be a contiguous "
                                 f"{t.shape} x {spec.dtype} tensor of model {spec.name!r}; found {found}")
            out[t.key] = p.data.view(-1)
        return out
    if not isinstance(into, torch.Tensor) or into.numel() != spec.numel or into.dtype != spec.torch_dtype \
            or not into.is_contiguous():
        raise ValueError(f"{who}: pull_in_order of model {spec.name!r} needs a module or a contiguous {spec.numel} x "
                         f"{spec.dtype} tensor")
    flat = into.reshape(-1)
    return {t.key: flat[t.offset:t.offset + t.numel] for t in spec.tensors}


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's gradients by parameter name (zeros where a parameter has none)."""
    return {k: p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            for k, p in module.named_parameters() if p.requires_grad}


def _detach(update: Tensors) -> Tensors:
    """A copy the caller may change while an async push is queued."""
    if isinstance(update, torch.Tensor):
        return update.detach().clone()
    if isinstance(update, torch.nn.Module):
        return {k: g.clone() for k, g in _gradients(update).items()}
    if isinstance(update, dict):
        return {k: v.detach().clone() for k, v in update.items()}
    return [t.detach().clone() for t in update]
