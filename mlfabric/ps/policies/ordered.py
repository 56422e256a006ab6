"""Pull answers per parameter tensor, in a priority order enforced at the sender (TicTac §5.1).

    .venv/bin/python -m pytest tests/unit/test_ps_ordered.py -q

The default pull is one flat message per shard: a worker can compute nothing until the whole
shard is in. An *ordered* pull (``PSWorker.pull_in_order``) is answered per tensor: the
server cuts its shard into pieces (one per tensor it holds; a tensor that straddles two
servers is one piece on each) and hands them to the transport in one call (in the
order the pull asks for), after a small header message:

* ``"priority"``: the priorities the workers registered with ``init_model(...,
  priorities=...)`` (lower first; ties in registration order). TicTac's TIO/TAO give them
  (:mod:`mlfabric.order`), keyed by parameter name.
* ``"random"``: a fresh random order per pull (seeded by the job's seed, the worker and its
  clock): the arbitrary order of a sender that enforces none, TicTac's baseline.

§5.1's counter: "the sender keeps a counter per worker per iteration, incremented when a
transfer is handed to the transport; a transfer of priority p waits until the counter
reaches p". Here one thread (the server loop) hands one pull's pieces over in sorted order,
so the wait never blocks; the counter is the sequence number ``seq`` each piece carries, and
the worker checks that pieces arrive in that order (``ArrivingModel.reordered`` counts those
that did not; the plain TCP transport keeps one FIFO per connection, so it stays 0, where §5.1
saw gRPC reorder 0.4-0.5%).

The worker (:class:`ArrivingModel`) receives the pieces on a thread of its own and writes
each into its destination (a module's parameters, or a flat tensor) as it lands, recording
when; :meth:`ArrivingModel.wait` blocks, bounded, until given tensors are complete.
:class:`mlfabric.ps.overlap.ParameterGate` uses it so that each module's forward starts as
soon as its own parameters are in.

Wire format, on the pull's reply tag: ``{"op": "model", "version", "model_clock", "pieces":
n, "order"}`` then n messages ``{"op": "piece", "key", "lo", "hi", "seq"}`` whose payload is
elements ``lo:hi`` of tensor ``key`` (flattened).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from mlfabric.errors import CollectiveTimeoutError
from mlfabric.order.dag import recv_name
from mlfabric.runtime.fair_share import PAYLOAD_FRACTION
from mlfabric.transport.base import SendHandle, tensor_bytes

from .. import protocol
from ..model import ModelSpec
from ..policy import Policy
from ..protocol import PSRequestError, payload_tensor
from ..waits import wait_until

if TYPE_CHECKING:
    from ..policy import ServerPort, WorkerPort
    from ..shard import PendingPull, Shard

__all__ = ["ORDERS", "ArrivingModel", "OrderedPulls", "Piece", "answer_in_order", "check_priorities", "handoff_order",
           "lift_pacing", "pace_fairly", "shard_pieces"]

#: What a pull may ask for: the registered priorities, or a fresh random order per pull.
ORDERS = ("priority", "random")


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``lo:hi`` of tensor ``key`` (flattened), which sit at ``start:start + hi - lo``
    of the server's shard."""

    key: str
    lo: int
    hi: int
    start: int
    index: int  # the tensor's registration index (the tie-break)


def check_priorities(spec: ModelSpec, priorities: Mapping[str, int], who: str) -> dict[str, int]:
    """``priorities`` as a plain dict after checking it names every tensor of ``spec`` once
    with an integer >= 0 (ValueError naming ``who``, the model and the key)."""
    keys = set(spec.keys)
    unknown = [k for k in priorities if k not in keys]
    if unknown:
        raise ValueError(f"{who}: priorities of model {spec.name!r} name {unknown[0]!r}, which is not one of its "
                         f"tensors ({spec.keys[:4]}...)")
    missing = [k for k in spec.keys if k not in priorities]
    if missing:
        raise ValueError(f"{who}: priorities of model {spec.name!r} miss {len(missing)} tensor(s), e.g. "
                         f"{missing[0]!r}: give every tensor a priority (lower goes first)")
    out = {}
    for k, p in priorities.items():
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"{who}: priority of {k!r} in model {spec.name!r} is {p!r}; expected an int >= 0")
        out[str(k)] = int(p)
    return out


def shard_pieces(spec: ModelSpec, offset: int, length: int) -> list[Piece]:
    """The pieces of the tensors that overlap the shard ``offset:offset + length``, in
    registration order."""
    out = []
    for index, t in enumerate(spec.tensors):
        a, b = max(t.offset, offset), min(t.offset + t.numel, offset + length)
        if a < b:
            out.append(Piece(key=t.key, lo=a - t.offset, hi=b - t.offset, start=a - offset, index=index))
    return out


def handoff_order(pieces: list[Piece], order: str, priorities: Mapping[str, int] | None,
                  rng: random.Random | None = None) -> list[Piece]:
    """The order in which the pieces go to the transport: by priority (ties in registration
    order), or shuffled by ``rng``."""
    if order == "priority":
        if priorities is None:
            raise ValueError("an ordered pull asks for the registered priorities, but none were registered: "
                             "pass priorities= to init_model")
        return sorted(pieces, key=lambda p: (priorities[p.key], p.index))
    if order == "random":
        shuffled = list(pieces)
        (rng or random.Random()).shuffle(shuffled)
        return shuffled
    raise ValueError(f"unknown pull order {order!r}; choose one of {', '.join(ORDERS)}")


def pull_rng(seed: int, worker: int, clock: int, server: int) -> random.Random:
    """The random order's generator: the same job seed, worker and clock give the same order."""
    return random.Random((seed * 1_000_003 + worker) * 1_000_003 + clock * 257 + server)


def answer_in_order(server: "ServerPort", pulls: "list[PendingPull]", spec: ModelSpec, offset: int,
                    values: list[torch.Tensor], priorities: Mapping[str, int] | None, version: int,
                    model_clock: int | None, *, pacer: Any = None) -> list[tuple[SendHandle, torch.Tensor]]:
    """Server side: answer the ordered pulls of ``pulls`` (``values[i]``: the shard snapshot
    for pull i, untouched until the handles are done) with a header each, then their pieces
    in the order each pull asked for. Every puller's header goes first; then each puller's
    pieces are handed to the transport at once (``Transport.send_many``: one system call on
    tcp), so no puller's first bytes wait for the others' pieces. Returns the sends to keep
    alive."""
    pieces = shard_pieces(spec, offset, values[0].numel()) if values else []
    sending: list[tuple[SendHandle, torch.Tensor]] = []
    session, channel = server.config.session, server.channel
    plans = []
    for p, shard in zip(pulls, values):
        rng = pull_rng(server.config.seed, p.worker, p.clock, server.server) if p.order == "random" else None
        tag = protocol.reply_tag(session, p.request_id)
        try:
            order = handoff_order(pieces, str(p.order), priorities, rng)
        except ValueError as exc:
            text = f"{server.who}: ordered pull of model {spec.name!r} from {server.layout.describe(p.rank)}: {exc}"
            server.stats.errors.append(text)
            server.transport.send(p.rank, tag, b"", meta=protocol.ErrorReply(message=text).encode(), channel=channel)
            continue
        server.transport.send(p.rank, tag, b"", channel=channel,
                              meta=protocol.ModelReply(version=version, model_clock=model_clock, pieces=len(order),
                                                       order=p.order).encode())
        plans.append((p.rank, tag, shard, order))
    pacer = server if pacer is None else pacer
    pace_fairly(pacer, [rank for rank, _, _, _ in plans])
    for rank, tag, shard, order in plans:
        # Slices of one byte view: a torch slice and its view per piece cost tens of µs each
        # on a loaded host, a memoryview slice well under one.
        data, size = tensor_bytes(shard), shard.element_size()
        messages = [(tag, data[piece.start * size:(piece.start + piece.hi - piece.lo) * size],
                     protocol.Piece(key=piece.key, lo=piece.lo, hi=piece.hi, seq=seq).encode())
                    for seq, piece in enumerate(order)]  # seq: §5.1's per-worker counter at hand-off
        handle = server.transport.send_many(rank, messages, channel=channel)
        sending.append((handle, shard))
        pacer.ordered_in_flight[rank] = handle
    return sending


def pace_fairly(server: Any, ranks: list[int]) -> None:
    """Before the server answers ``ranks``' ordered pulls, with ``PSConfig.pace_ordered_pulls``
    and a known NIC rate (``ParameterServer.nic_rate_bps``): pace every connection with an
    ordered answer in flight, these included, at an equal share of the server's NIC. Each
    worker then receives its pieces at a steady share, which is what TIO/TAO's oracle and the
    simulator assume; unpaced, the TCP flows that leave one NIC together do not share it
    evenly (on the emulated star one worker had its model in 17 ms and another in 46 ms).
    The unevenness costs a forward pass, which waits for the slowest worker, and helps
    training, whose first workers push while the last still pull (docs/tictac.md decision
    16). Counting the answers in flight, not the round, matters: under BSP the last worker's
    pull often comes just after the round of the others was answered. ``runtime/fair_share.py`` gives the
    payload fraction; a flat answer lifts the caps (:func:`lift_pacing`)."""
    if not server.config.pace_ordered_pulls or server.nic_rate_bps is None or not ranks:
        return
    # An answer to a worker that is gone never completes: it no longer takes a share.
    flowing = {r for r, last in server.ordered_in_flight.items()
               if not last.done() and not server.transport.is_gone(r)} | set(ranks)
    share = PAYLOAD_FRACTION * server.nic_rate_bps / len(flowing)
    for rank in sorted(flowing):
        if server.transport.pace_connection(rank, server.channel, share):
            server.paced_for_pulls.add(rank)


def lift_pacing(server: Any, ranks: Iterable[int]) -> None:
    """Lift the caps :func:`pace_fairly` left on the connections to ``ranks`` (before a flat
    answer, which has no order to keep and should have the whole NIC to share)."""
    for rank in ranks:
        if rank in server.paced_for_pulls:
            server.paced_for_pulls.discard(rank)
            server.transport.pace_connection(rank, server.channel, None)


class OrderedPulls(Policy):
    """TicTac's ordered pulls as a pull policy every server runs: it claims the pulls that ask
    for an order (``PSWorker.pull_in_order``) and answers them per tensor in that order
    (:func:`answer_in_order`), pacing them at equal shares of the NIC where asked
    (:func:`pace_fairly`); a flat answer to the same worker lifts the caps (:func:`lift_pacing`).
    It is the *pacer* those functions take: the server's transport, channel, config and NIC
    rate, and its own record of the connections it capped and of the answers in flight."""

    name = "ordered"

    def __init__(self, server: "ServerPort") -> None:
        self._server = server
        self.paced_for_pulls: set[int] = set()  # ranks whose connection an ordered answer capped
        self.ordered_in_flight: dict[int, SendHandle] = {}  # rank -> last piece of its latest ordered answer

    @property
    def transport(self) -> Any:
        return self._server.transport

    @property
    def channel(self) -> str:
        return self._server.channel

    @property
    def config(self) -> Any:
        return self._server.config

    @property
    def nic_rate_bps(self) -> float | None:
        return self._server.nic_rate_bps

    def claims_pull(self, pull: "PendingPull") -> bool:
        return pull.order is not None

    def answer_pulls(self, server: "ServerPort", pulls: "list[PendingPull]", shard: torch.Tensor,
                     header: protocol.ModelReply, *, source: "Shard | None" = None) -> list[SendHandle]:
        if source is None:
            raise ValueError(f"{server.who}: ordered pulls are answered from a server's shard (source=)")
        sent = answer_in_order(server, pulls, source.spec, source.offset, [shard] * len(pulls), source.priorities,
                               source.version, header.model_clock, pacer=self)
        return [h for h, _ in sent]

    def others_answered(self, server: "ServerPort", ranks: list[int]) -> None:
        if self.paced_for_pulls:
            lift_pacing(self, ranks)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One piece as the worker received it: ``at`` = when it was taken from the transport."""

    key: str
    server: int
    seq: int
    nbytes: int
    at: float


class ArrivingModel:
    """One ordered pull in flight on the worker (module docstring): pieces land in
    ``targets`` (flat views by key) on a receiving thread; :meth:`wait` blocks until tensors
    are complete. ``requested`` is when the pull was sent; ``begins[j]`` when server ``j``'s
    header arrived (its first bytes: the pieces follow on the same connection)."""

    def __init__(self, worker: "WorkerPort", spec: ModelSpec, targets: Mapping[str, torch.Tensor],
                 requests: list[tuple[int, int]], order: str, requested: float) -> None:
        self.worker = worker
        self.spec = spec
        self.order = order
        self.requested = requested
        self.clock = worker.clock_value
        self.timeout_s = worker.config.timeout_s
        self._targets = dict(targets)
        self._requests = requests  # (server index, request id)
        self._remaining = {t.key: t.numel for t in spec.tensors}
        self._holders: dict[str, list[int]] = {}
        for j, (offset, length) in enumerate(spec.shards(worker.layout.servers)):
            for piece in shard_pieces(spec, offset, length):
                self._holders.setdefault(piece.key, []).append(j)
        self.complete: dict[str, float] = {}  # key -> when its last piece landed
        self.arrivals: list[Arrival] = []
        self.begins: dict[int, float] = {}
        self.versions: dict[int, int] = {}
        self.model_clock: int | None = None
        self.reordered = 0  # pieces that arrived out of their hand-off order (§5.1's gRPC error)
        self.finished: float | None = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._receive, name=f"mlfabric-ps-pull-w{worker.index}", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------

    def wait(self, keys: Iterable[str] | None = None, *, timeout: float | None = None, who: str = "") -> None:
        """Block until every tensor of ``keys`` (default: all) is complete, at most ``timeout``
        seconds (default: the job's ``timeout_s``). Raises the receiving thread's error
        (a lost server, a refused pull) or :class:`mlfabric.CollectiveTimeoutError` naming the
        first missing tensor and the server(s) holding it; ``who`` says who waits."""
        wanted = list(self._remaining) if keys is None else list(keys)
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                missing = [k for k in wanted if k not in self.complete]
                if not missing:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.5))
        key = missing[0]
        holders = ", ".join(self.worker.layout.describe(self.worker.server_rank(j)) for j in self._holders[key])
        raise CollectiveTimeoutError(
            f"{self.worker.who}: {who + ' waits for' if who else 'waiting for'} parameter {key!r} of model "
            f"{self.spec.name!r} from {holders}: not complete within {limit:g} s ({len(self.complete)} of "
            f"{len(self._remaining)} tensors in, pull at clock {self.clock}); the server is alive "
            "but slow or stuck: check its log, or raise timeout_s", rank=self.worker.transport.rank,
            peer=self.worker.server_rank(self._holders[key][0]))

    def done(self) -> bool:
        return self.finished is not None or self._error is not None

    def join(self, timeout: float | None = None) -> None:
        """Wait for the whole pull (every tensor) and the receiving thread."""
        self.wait(timeout=timeout)
        self._thread.join(timeout=self.timeout_s)

    def transfer_spans(self) -> list[tuple[str, float, float]]:
        """Per piece ``(recv:<key>, start, end)``: a server's channel serves its pieces back to
        back, so a piece's transfer starts when the previous one from that server landed (the
        first when the header did) and ends when it landed."""
        last = dict(self.begins)
        spans = []
        for a in self.arrivals:
            start = last.get(a.server, self.requested)
            spans.append((recv_name(a.key), start, a.at))
            last[a.server] = a.at
        return spans

    # -- the receiving thread -----------------------------------------------------------------

    def _receive(self) -> None:
        try:
            self._receive_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _receive_all(self) -> None:
        w = self.worker
        transport, mailbox = w.transport, w.transport.mailbox
        session = w.config.session
        expected: dict[int, int | None] = {j: None for j, _ in self._requests}  # pieces per server, from its header
        got = {j: 0 for j, _ in self._requests}
        next_seq = {j: 0 for j, _ in self._requests}
        what = f"ordered pull of {self.spec.name!r} at clock {self.clock}"

        def complete() -> bool:
            """Land every piece that is in; True once every server's pieces are."""
            for j, request_id in self._requests:
                rank = w.server_rank(j)
                while (expected[j] is None or got[j] < expected[j]) and (
                        msg := mailbox.take(w.channel, protocol.reply_tag(session, request_id), rank)) is not None:
                    now = time.monotonic()
                    header = protocol.decode(msg.meta)
                    if header["op"] == "error":
                        raise PSRequestError(header["message"])
                    if header["op"] == "model":
                        expected[j] = int(header["pieces"])
                        self.begins[j] = now
                        self.versions[j] = int(header["version"])
                        if j == 0:
                            self.model_clock = header.get("model_clock")
                        continue
                    self._land(j, header, msg.payload, now, next_seq)
                    got[j] += 1
            return all(expected[j] is not None and got[j] >= expected[j] for j in expected)

        wait_until(transport, complete, time.monotonic() + w.config.timeout_s, who=w.who, what=what,
                   watch=lambda: [w.server_rank(j) for j, _ in self._requests],
                   on_gone=lambda rank: w.lost_error(rank, what),
                   on_timeout=lambda: CollectiveTimeoutError(
                       f"{w.who}: {what}: {sum(got.values())} pieces in, the rest not within {w.config.timeout_s:g} s "
                       "(under BSP/SSP the answer waits for the slowest worker's clock)", rank=transport.rank))
        for j, version in self.versions.items():
            w.versions[self.spec.name][j] = version
        with self._cond:
            self.finished = time.monotonic()
            self._cond.notify_all()

    def _land(self, server: int, header: dict[str, Any], payload: memoryview, now: float,
              next_seq: dict[int, int]) -> None:
        key, lo, hi, seq = str(header["key"]), int(header["lo"]), int(header["hi"]), int(header["seq"])
        if seq != next_seq[server]:
            self.reordered += 1
        next_seq[server] = seq + 1
        target = self._targets[key]
        target[lo:hi].copy_(payload_tensor(payload, self.spec.torch_dtype, hi - lo,
                                           f"{self.worker.who}: piece {key!r} from server {server}"))
        with self._cond:
            self.arrivals.append(Arrival(key=key, server=server, seq=seq, nbytes=payload.nbytes, at=now))
            self._remaining[key] -= hi - lo
            if self._remaining[key] == 0:
                self.complete[key] = now
                self._cond.notify_all()
