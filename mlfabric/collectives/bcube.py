"""BML gradient synchronization on BCube(n,k) (papers/bml.txt §3.2, Algorithm 1), and the same
digit-by-digit exchange on one NIC as the "hierarchical" baseline of BML §3.3.

Host ``a`` has digits ``[a_{k-1} .. a_0]`` with ``a = sum_i a_i n^i`` (``mlfabric.topo.bcube``
numbers hosts the same way). Each host runs ``k`` synchronization threads; the gradient is cut
into ``k*N`` pieces ``<e, v_{k-1} .. v_0>`` and thread ``t`` handles the ``N`` pieces with
``e = t``. Thread ``t`` corrects the digits in the order ``j_i = (i + t) mod k``:

* aggregation step ``w`` uses level ``l = j_w`` = ``(w + t) mod k``: to each level-``l``
  neighbour ``s`` it sends the pieces whose digits ``j_0..j_{w-1}`` equal its own and whose
  digit ``j_w`` equals ``s``'s (``CalcGset(s, w)``), and reduces what it receives into the
  pieces matching its own digits ``j_0..j_w``. After ``k`` steps piece ``<t, a>`` is complete.
* broadcast step ``w`` uses level ``(k-1-w+t) mod k`` = ``j_{k-1-w}``: it sends the complete
  pieces matching its digits ``j_0..j_{k-1-w}`` (``CalcGset(a, k-1-w)``) to every neighbour
  of that level and stores theirs.

In every step the ``k`` threads of a host use ``k`` distinct levels, so all NICs are busy and
the GST is ``2 (N-1)/(k N) * T_F`` (one full-gradient transfer time ``T_F`` per NIC), ``1/k``
of the parameter server's or ring's ``2 (N-1)/N * T_F`` on a Fat-Tree.

**Buffer layout.** A piece's name ``<e, digits>`` is a label; where its elements sit in the
flat buffer is ours to choose. We lay thread ``t``'s ``N`` pieces out in the order of the
mixed-radix number ``(v_{j_0}, v_{j_1}, .., v_{j_{k-1}})`` (``v_{j_0}`` most significant), so
every ``CalcGset`` is one contiguous slice and every transfer one message. The buffer is cut
into ``k*N`` pieces per call, i.e. per DDP bucket, which is BML §4.1's per-layer split.

**Step order on a connection.** The threads share each neighbour's connection (one per
level). BML's analysis has the threads step together; left to timing, a thread that ran ahead
could queue its step-``w+1`` message in front of another thread's step-``w`` message to the
same neighbour, and on a FIFO connection the earlier step then waits for the later, bigger
transfer. So every send also waits for the previous step's send on its connection.

**Parts.** A step's messages leave only when the previous step's have arrived and been
reduced, so a NIC idles between steps (reductions, hand-offs, and the slowest neighbour of
each step; ~30 ms per step on the emulator). With ``parts=P`` the buffer is cut into P
consecutive exchanges built step by step: a connection carries step ``w`` of every part
before step ``w+1`` of any, so part 0's next step is ready while part 1's current one is on
the wire. The simulated GST does not change (910.22 ms for 64 MB on BCube(3,2) at 500 Mbit/s
with 1-4 parts); on the emulator, with fair-share pacing, 3 parts took 1000 ms against 1087 ms
for one (docs/results.md). ``collectives.pipeline_parts`` picks P from the pipelining chunk.

**Hierarchical synchronization** (``hierarchical_allreduce``) is the same exchange with one
thread on one NIC over mixed radices, e.g. a Fat-Tree(k) grouped by edge switch (``k/2``
hosts), then by pod (``k/2`` edges), then across the ``k`` pods: BML §3.3's baseline, whose
GST equals the parameter server's on a non-blocking network.

Cost per rank with ``count`` divisible by ``k*N``: on every level ``2 (N-1) * count/(k N)``
elements in ``2k`` steps.

Exercise it with ``python -m pytest tests/unit/test_bcube.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from mlfabric.schedule import DEFAULT_CHANNEL, Cost, Schedule, ScheduleBuilder, Slice

from .partition import piece_offsets, piece_sizes

if TYPE_CHECKING:
    from mlfabric.topo.spec import TopologySpec

AGGREGATION, BROADCAST = 0, 1


@dataclass(frozen=True)
class DigitExchange:
    """The geometry shared by every rank: radices, threads, and how pieces map to slices."""

    radices: tuple[int, ...]  # radix of digit i (least significant first)
    threads: int
    count: int
    base: int = 0  # where this exchange's elements start in "data" (one part of a parted call)

    @property
    def levels(self) -> int:
        return len(self.radices)

    @cached_property
    def world_size(self) -> int:
        return math.prod(self.radices)

    @cached_property
    def _offsets(self) -> list[int]:
        parts = self.threads * self.world_size
        return [*piece_offsets(self.count, parts), self.count]

    @cached_property
    def _sizes(self) -> list[int]:
        return piece_sizes(self.count, self.threads * self.world_size)

    def digits(self, host: int) -> list[int]:
        out = []
        for radix in self.radices:
            host, digit = divmod(host, radix)
            out.append(digit)
        return out

    def host(self, digits: list[int]) -> int:
        value = 0
        for radix, digit in zip(reversed(self.radices), reversed(digits)):
            value = value * radix + digit
        return value

    def order(self, thread: int) -> list[int]:
        """The digit (= level) thread ``thread`` corrects in step i: ``j_i = (i + t) mod L``."""
        return [(i + thread) % self.levels for i in range(self.levels)]

    def aggregation_level(self, thread: int, step: int) -> int:
        return (step + thread) % self.levels

    def broadcast_level(self, thread: int, step: int) -> int:
        return (self.levels - 1 - step + thread) % self.levels

    def block(self, thread: int, fixed: list[int]) -> Slice:
        """The pieces of ``thread`` whose digits ``j_0 .. j_{len(fixed)-1}`` equal ``fixed``."""
        order = self.order(thread)
        position, span = 0, self.world_size
        for level, digit in zip(order, fixed):
            span //= self.radices[level]
            position += digit * span
        first = thread * self.world_size + position
        return Slice("data", self.base + self._offsets[first], self._offsets[first + span] - self._offsets[first])

    def neighbours(self, host: int, level: int) -> list[tuple[int, int]]:
        """``(digit, host)`` of the other hosts that differ from ``host`` only in ``level``.
        Listed starting after ``host``'s own digit so that hosts spread their first messages."""
        digits = self.digits(host)
        radix = self.radices[level]
        out = []
        for shift in range(1, radix):
            d = (digits[level] + shift) % radix
            out.append((d, self.host(digits[:level] + [d] + digits[level + 1:])))
        return out


def tag_of(thread: int, stage: int, step: int, levels: int) -> int:
    """Builder tag of the message of (thread, stage, step); one per ordered pair and step."""
    return (thread * 2 + stage) * levels + step


def decode_tag(tag: int, levels: int) -> tuple[int, int, int]:
    """``(thread, stage, step)`` of a tag made by :func:`tag_of` (used by the structural tests)."""
    rest, step = divmod(tag, levels)
    thread, stage = divmod(rest, 2)
    return thread, stage, step


def decode_part_tag(tag: int, levels: int, threads: int) -> tuple[int, int, int, int]:
    """``(part, thread, stage, step)`` of a message tag of a parted exchange (part ``p``'s tags
    are :func:`tag_of`'s moved up by ``p * 2 * threads * levels``)."""
    part, tag = divmod(tag, 2 * threads * levels)
    return (part, *decode_tag(tag, levels))


def bcube_allreduce(world_size: int, rank: int, count: int, *, n: int, k: int, op: str = "sum",
                    channels: tuple[str, ...] | None = None, parts: int = 1) -> Schedule:
    """BML Algorithm 1 on BCube(n, k). ``channels[l]`` carries level-``l`` traffic (default
    ``"0" .. "k-1"``: one channel per NIC); pass fewer distinct names to share NICs.
    ``parts``: cut the buffer into that many consecutive exchanges, pipelined step by step
    ("Parts" in the module docstring)."""
    if n < 2 or k < 1:
        raise ValueError(f"BCube needs n >= 2 and k >= 1, got n={n}, k={k}")
    if world_size != n**k:
        raise ValueError(f"BCube(n={n}, k={k}) has {n**k} hosts but the world size is {world_size}; "
                         f"BML needs exactly n^k ranks")
    channels = channels or tuple(str(level) for level in range(k))
    if len(channels) != k:
        raise ValueError(f"BCube(n={n}, k={k}) needs {k} channels (one per level), got {channels}")
    return _digit_exchange("bcube_allreduce", exchange_parts((n,) * k, k, count, parts), rank, op, channels)


def hierarchical_allreduce(world_size: int, rank: int, count: int, *, radices: tuple[int, ...],
                           op: str = "sum", channel: str = DEFAULT_CHANNEL) -> Schedule:
    """Group ranks by digit 0 (radix ``radices[0]``), then digit 1, ...: one thread, one NIC."""
    if not radices or any(r < 1 for r in radices):
        raise ValueError(f"radices must be positive, got {radices}")
    if math.prod(radices) != world_size:
        raise ValueError(f"radices {radices} describe {math.prod(radices)} ranks, not {world_size}")
    return _digit_exchange("hierarchical_allreduce", exchange_parts(tuple(radices), 1, count, 1), rank, op,
                           (channel,) * len(radices))


def _digit_exchange(name: str, parts: list[DigitExchange], rank: int, op: str,
                    channels: tuple[str, ...]) -> Schedule:
    """The schedule of one rank for ``parts`` (consecutive slices of ``data``, each its own
    exchange), built step-major: every connection carries step ``w`` of every part before
    step ``w+1`` of any, so a part's next step is ready while another part's is on the wire."""
    first = parts[0]
    if not 0 <= rank < first.world_size:
        raise ValueError(f"rank {rank} is outside world size {first.world_size}")
    b = ScheduleBuilder(name, rank, first.world_size)
    b.buffer("data", sum(part.count for part in parts))
    levels, threads = first.levels, first.threads
    mine = first.digits(rank)
    sent: dict[str, int] = {}
    tags_per_part = 2 * threads * levels

    # The last send on each connection (peer, level); every send waits for it ("Step order
    # on a connection" above: without it BML calls on the emulator took ~1.5 s instead of
    # ~1.1 s whenever one thread ran ahead, docs/results.md).
    last_send: dict[tuple[int, int], int] = {}

    # The connections each step sends on, for the NIC shares of the cost (every connection of
    # a step gets an equal part of its channel's NIC, as in the closed form); send() adds to
    # the last set, one set per step.
    step_connections: list[set[tuple[int, str]]] = []

    def send(peer: int, sl: Slice, tag: int, deps: list[int], level: int) -> int:
        sent[channels[level]] = sent.get(channels[level], 0) + sl.length
        step_connections[-1].add((peer, channels[level]))
        before = last_send.get((peer, level))
        after = deps + ([before] if before is not None else [])
        last_send[(peer, level)] = b.send(peer, sl, tag, after, channel=channels[level])
        return last_send[(peer, level)]

    # Built step by step (all threads' step w before any thread's step w+1), so that
    # ``last_send`` always holds the previous step's message on a connection.
    orders = [first.order(t) for t in range(threads)]
    # Aggregation: after step w this rank holds the reduction over the hosts that share
    # its digits outside j_0..j_w, for the pieces matching its digits j_0..j_w.
    previous_recvs: list[list[list[int]]] = [[[] for _ in range(threads)] for _ in parts]
    # agg_send[p][t][(step, peer)]: thread t's aggregation send of that step to that peer in part p.
    agg_send: list[list[dict[tuple[int, int], int]]] = [[{} for _ in range(threads)] for _ in parts]
    for w in range(levels):
        step_connections.append(set())
        for p, ex in enumerate(parts):
            for t in range(threads):
                level = ex.aggregation_level(t, w)
                fixed = [mine[j] for j in orders[t][:w]]
                tag = p * tags_per_part + tag_of(t, AGGREGATION, w, levels)
                recvs: list[int] = []
                for digit, peer in ex.neighbours(rank, level):
                    block = ex.block(t, fixed + [digit])
                    agg_send[p][t][(w, peer)] = send(peer, block, tag, previous_recvs[p][t], level)
                own = ex.block(t, fixed + [mine[level]])
                for _, peer in ex.neighbours(rank, level):
                    # Reductions into the same block are chained (they would race otherwise);
                    # the messages themselves still arrive concurrently.
                    chain = recvs[-1:] or previous_recvs[p][t]
                    recvs.append(b.recv(peer, own, tag, chain, channel=channels[level], reduce=op))
                previous_recvs[p][t] = recvs or previous_recvs[p][t]
    # Broadcast: step w spreads the complete pieces matching digits j_0..j_{L-1-w}: the
    # piece completed by the last aggregation plus what the previous broadcast brought.
    complete = [[previous_recvs[p][t][-1:] for t in range(threads)] for p in range(len(parts))]
    for w in range(levels):
        step_connections.append(set())
        for p, ex in enumerate(parts):
            for t in range(threads):
                level = ex.broadcast_level(t, w)
                agg_step = levels - 1 - w  # the aggregation step that used this level
                fixed = [mine[j] for j in orders[t][:agg_step]]
                own = ex.block(t, fixed + [mine[level]])
                tag = p * tags_per_part + tag_of(t, BROADCAST, w, levels)
                recvs = []
                for _, peer in ex.neighbours(rank, level):
                    send(peer, own, tag, complete[p][t], level)
                for digit, peer in ex.neighbours(rank, level):
                    # Overwrites exactly what the aggregation send to this peer read.
                    recvs.append(b.recv(peer, ex.block(t, fixed + [digit]), tag,
                                        [agg_send[p][t][(agg_step, peer)]], channel=channels[level]))
                complete[p][t] = complete[p][t] + recvs
    return b.build(Cost(steps=2 * levels, elements_sent=sent, link_shares=equal_shares(step_connections)))


def exchange_parts(radices: tuple[int, ...], threads: int, count: int, parts: int) -> list[DigitExchange]:
    """``count`` elements cut into ``parts`` consecutive exchanges (sizes differ by at most one)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    sizes = piece_sizes(count, parts)
    offsets = piece_offsets(count, parts)
    return [DigitExchange(radices, threads, size, base=offset) for size, offset in zip(sizes, offsets)]


def equal_shares(steps: list[set[tuple[int, str]]]) -> dict[tuple[int, str], float]:
    """Each step's connections share their channel's NIC equally; a connection used in several
    steps keeps its smallest share. Connections alone on their NIC are left out (whole NIC)."""
    shares: dict[tuple[int, str], float] = {}
    for connections in steps:
        per_channel: dict[str, int] = {}
        for _, channel in connections:
            per_channel[channel] = per_channel.get(channel, 0) + 1
        for peer, channel in connections:
            share = 1 / per_channel[channel]
            shares[(peer, channel)] = min(share, shares.get((peer, channel), 1.0))
    return {connection: share for connection, share in shares.items() if share < 1}


def closed_form_elements_per_level(count: int, n: int, k: int) -> float:
    """BML's per-level traffic of one host: ``2 (N-1)`` pieces of ``count / (k N)`` elements."""
    world = n**k
    return 2 * (world - 1) * count / (k * world)


def closed_form_gst(n: int, k: int, full_transfer_s: float) -> float:
    """BML §3.2: ``2 (N-1)/(k N) * T_F``."""
    world = n**k
    return 2 * (world - 1) / (k * world) * full_transfer_s


def hierarchy_of(spec: "TopologySpec") -> tuple[int, ...]:
    """Digit radices (innermost group first) that group a topology's hosts by switch:
    Fat-Tree(k) -> hosts per edge switch, edges per pod, pods ``(k/2, k/2, k)``; racks ->
    ``(h, r)``; BCube(n,k) -> ``(n,) * k``; star -> ``(n,)``. Hosts are numbered as in
    ``mlfabric.topo`` (consecutive hosts share the innermost switch)."""
    p = spec.params
    if spec.kind == "fat-tree":
        half = int(p["k"]) // 2
        return (half, half, int(p["k"]))
    if spec.kind == "racks":
        return (int(p["h"]), int(p["r"]))
    if spec.kind == "bcube":
        return (int(p["n"]),) * int(p["k"])
    if spec.kind == "star":
        return (int(p["n"]),)
    raise ValueError(f"no switch hierarchy for topology {spec}")


def shape_options(algorithm: str, spec: "TopologySpec") -> dict[str, object]:
    """Builder options an allreduce takes from the topology it runs on: BML's ``n`` and ``k``
    on BCube(n,k), hierarchical allreduce's ``radices`` (:func:`hierarchy_of`); none for the
    others. The runtime, the simulator and the benchmarks all derive them here, so they run
    the same schedule on the same cluster."""
    if algorithm == "bcube":
        if spec.kind != "bcube":
            raise ValueError(f"BML (algorithm 'bcube') runs on a BCube topology (bcube:n=..,k=..), not {spec}; "
                             "give n= and k= explicitly to run its schedule on another cluster")
        return {"n": int(spec.params["n"]), "k": int(spec.params["k"])}
    if algorithm == "hierarchical":
        return {"radices": hierarchy_of(spec)}
    return {}
