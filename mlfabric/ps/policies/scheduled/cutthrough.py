"""Cut-through summing for an aggregation tree's node, without I/O: chunks in, "forward chunk i" out.

    .venv/bin/python -m pytest tests/unit/test_ps_cutthrough.py -q

One :class:`ChunkSum` per (batch, group slot, server component) at every node of a tree
(an aggregator host, or the server taking the root's sum): its *inputs* are the node's direct
members' updates (``("m", rank, id)``) and its children's partial sums (``("c", host)``).
The tensor is cut in chunks of ``chunk_elems`` elements; chunk i is summed and handed back
(a :class:`Forward`) as soon as chunk i has come from every input, so the node sends chunk i
on while chunk i+1 is still arriving: a tree of depth d costs about one transfer plus d chunk
times instead of d transfers. ``chunk_elems <= 0`` is store-and-forward (one chunk).

Every chunk carries the worker updates summed into it (``members``: ``(rank, id, version)``),
so a receiver can tell a whole aggregate (every chunk with the same members) from a *torn*
one (chunks summed over different members: a deadline hit after some chunks had gone with
an input that never sent the rest). A torn aggregate is not applied; the server's order
book skips its entry at the deadline like a late one: nothing is applied twice or half.

Repair (a node lost mid-tree): the lost node's inputs send their chunks to the nearest live
ancestor, saying whom they stand in for (:meth:`ChunkSum.lost`). Per chunk, the receiver keeps
the lost child's chunk if it had already come (the inputs' copies of that chunk are then
ignored: they are in it), else it waits for the inputs' chunks instead. Either way each
update is in each chunk exactly once.

The aggregator thread (:mod:`.aggregator`) and the server (:mod:`.server`) drive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

Source = Hashable  # ("m", rank, update id): a member's update; ("c", host): a child's partial sum
Member = tuple[int, int, int]  # (rank, update id, version) of a worker update summed into a chunk


@dataclass(frozen=True)
class Forward:
    """Chunk ``index`` of the sum, ready to go on: its values and the updates summed into it."""

    index: int
    tensor: torch.Tensor
    members: tuple[Member, ...]


@dataclass
class _Chunk:
    expected: list[Source]
    received: dict[Source, tuple[torch.Tensor, tuple[Member, ...]]] = field(default_factory=dict)
    forwarded: bool = False


def chunk_count(numel: int, chunk_elems: int) -> int:
    """How many chunks a tensor of ``numel`` elements is cut into (at least one)."""
    if chunk_elems <= 0 or chunk_elems >= numel:
        return 1
    return -(-numel // chunk_elems)


def chunk_elems(chunk_bytes: int, element_size: int) -> int:
    """A chunk's elements for ``chunk_bytes`` (0: store-and-forward, one chunk); every node of a
    tree derives it the same way from the plan's ``chunk_bytes``."""
    return max(1, chunk_bytes // element_size) if chunk_bytes > 0 else 0


def chunk_span(index: int, numel: int, chunk_elems: int) -> tuple[int, int]:
    """Where chunk ``index`` lies: (first element, length)."""
    if chunk_elems <= 0 or chunk_elems >= numel:
        return 0, numel
    start = index * chunk_elems
    return start, min(chunk_elems, numel - start)


class ChunkSum:
    """The sum at one tree node (module docstring). ``inputs``: the sources it waits for, in
    the order it sums them (a fixed order: equal inputs give equal bits)."""

    def __init__(self, inputs: Sequence[Source], numel: int, chunk_elems: int) -> None:
        if not inputs:
            raise ValueError("a tree node needs at least one input (a member or a child)")
        self.numel, self.chunk_elems = numel, chunk_elems
        self.chunks = chunk_count(numel, chunk_elems)
        self._chunks = [_Chunk(expected=list(inputs)) for _ in range(self.chunks)]
        # chunks from sources not (yet) expected: re-routed ones that came before the message
        # naming the lost node they stand in for, or copies of chunks a lost child had sent
        self._stray: dict[tuple[Source, int], tuple[torch.Tensor, tuple[Member, ...]]] = {}
        self._lost: dict[Source, list[Source]] = {}  # lost inputs and who stands in for them
        self.ignored = 0  # chunks not used (duplicates, or already in a lost child's chunk)

    def span(self, index: int) -> tuple[int, int]:
        return chunk_span(index, self.numel, self.chunk_elems)

    @property
    def done(self) -> bool:
        """Every chunk was handed back (complete, or at the deadline)."""
        return all(c.forwarded for c in self._chunks)

    def waiting_for(self) -> set[Source]:
        """The inputs some chunk not forwarded yet still waits for."""
        return {s for c in self._chunks if not c.forwarded for s in c.expected if s not in c.received}

    def add(self, source: Source, index: int, tensor: torch.Tensor, members: Sequence[Member]) -> list[Forward]:
        """Chunk ``index`` from ``source``; returns the chunks now complete (in index order)."""
        if not 0 <= index < self.chunks:
            raise ValueError(f"chunk {index} from {source}: the sum has {self.chunks} chunks")
        start, length = self.span(index)
        if tensor.numel() != length:
            raise ValueError(f"chunk {index} from {source}: {tensor.numel()} elements, expected {length}")
        chunk = self._chunks[index]
        if chunk.forwarded or source in chunk.received:
            self.ignored += 1
            return []
        if source not in chunk.expected:
            self._stray[(source, index)] = (tensor, tuple(members))
            return []
        chunk.received[source] = (tensor, tuple(members))
        return self._ready([index])

    def lost(self, source: Source, replacement: Sequence[Source]) -> list[Forward]:
        """Input ``source`` is lost: in every chunk not forwarded and not received from it, its
        inputs ``replacement`` stand in for it. Idempotent; a source this node does not wait
        for (yet) is remembered: a later :meth:`lost` of its parent brings it in."""
        self._lost[source] = list(replacement)
        touched = []
        for i, chunk in enumerate(self._chunks):
            if chunk.forwarded or source not in chunk.expected or source in chunk.received:
                continue
            self._replace(i, chunk, source)
            touched.append(i)
        return self._ready(touched)

    def _replace(self, i: int, chunk: _Chunk, source: Source) -> None:
        """``source``'s inputs stand in for it in chunk ``i`` (recursively: one of them may be
        lost too, named before its parent was)."""
        at = chunk.expected.index(source)
        new = [s for s in self._lost[source] if s not in chunk.expected]
        chunk.expected[at:at + 1] = new
        for s in new:
            stray = self._stray.pop((s, i), None)
            if stray is not None:
                chunk.received[s] = stray
            elif s in self._lost:
                self._replace(i, chunk, s)

    def expire(self) -> list[Forward]:
        """The deadline: every chunk not forwarded goes with what came; a chunk nothing came
        for is not sent (the receiver then finds the sum incomplete: late, skipped)."""
        out = []
        for i, chunk in enumerate(self._chunks):
            if chunk.forwarded:
                continue
            chunk.forwarded = True
            if chunk.received:
                out.append(self._sum(i, chunk))
        self._stray.clear()
        return out

    def _ready(self, indices: Sequence[int]) -> list[Forward]:
        out = []
        for i in sorted(set(indices)):
            chunk = self._chunks[i]
            if not chunk.forwarded and all(s in chunk.received for s in chunk.expected):
                chunk.forwarded = True
                out.append(self._sum(i, chunk))
        if self.done:
            self.ignored += len(self._stray)
            self._stray.clear()
        return out

    def _sum(self, index: int, chunk: _Chunk) -> Forward:
        parts = [chunk.received[s] for s in chunk.expected if s in chunk.received]
        total = parts[0][0].clone()
        for tensor, _ in parts[1:]:
            total.add_(tensor)
        members = tuple(sorted({m for _, ms in parts for m in ms}))
        chunk.received.clear()  # the inputs' chunks are not needed any more
        return Forward(index=index, tensor=total, members=members)


@dataclass
class Assembly:
    """A whole aggregate put together from its forwarded chunks (the server's side)."""

    tensor: torch.Tensor
    members: tuple[Member, ...]
    torn: bool


class Assembler:
    """Collects a :class:`ChunkSum`'s forwards into the whole tensor: complete once every chunk
    is in; ``torn`` if the chunks were summed over different members."""

    def __init__(self, numel: int, chunk_elems: int, dtype: torch.dtype) -> None:
        self.numel, self.chunk_elems = numel, chunk_elems
        self.tensor = torch.zeros(numel, dtype=dtype)
        self._members: dict[int, tuple[Member, ...]] = {}
        self.chunks = chunk_count(numel, chunk_elems)

    def add(self, forward: Forward) -> Assembly | None:
        start, length = chunk_span(forward.index, self.numel, self.chunk_elems)
        self.tensor[start:start + length] = forward.tensor
        self._members[forward.index] = forward.members
        if len(self._members) < self.chunks:
            return None
        sets = {frozenset(m) for m in self._members.values()}
        members = tuple(sorted(set().union(*sets)))
        return Assembly(tensor=self.tensor, members=members, torn=len(sets) > 1)


# --------------------------------------------------------------------------- a slot's tree


@dataclass(frozen=True)
class TreeNode:
    """One aggregator host of a group's tree: where it forwards (None: the servers), the
    aggregator hosts it waits for and its direct members (rank, update id)."""

    parent: int | None
    children: tuple[int, ...]
    members: tuple[tuple[int, int], ...]


Tree = dict[int, TreeNode]


def encode_tree(tree: Tree) -> list[list[Any]]:
    """As the group and decision messages carry it (JSON: lists)."""
    return [[host, n.parent, list(n.children), [list(m) for m in n.members]] for host, n in sorted(tree.items())]


def decode_tree(data: Sequence[Sequence[Any]]) -> Tree:
    return {int(host): TreeNode(parent=None if parent is None else int(parent), children=tuple(int(c) for c in children),
                                members=tuple((int(r), int(i)) for r, i in members))
            for host, parent, children, members in data}


def node_inputs(tree: Tree, host: int) -> list[Source]:
    """What ``host`` sums: its members' updates, then its children's partial sums."""
    node = tree[host]
    return [("m", r, i) for r, i in node.members] + [("c", c) for c in node.children]


def tree_root(tree: Tree, host: int) -> int:
    """The root above ``host`` (the node that forwards to the servers; a group summed on
    several hosts, one per server component, has one root per host)."""
    seen = {host}
    while tree[host].parent is not None:
        host = tree[host].parent  # type: ignore[assignment]
        if host in seen or host not in tree:
            raise ValueError(f"a group's tree is not a tree: its parents loop or leave it at host {host}")
        seen.add(host)
    return host


def reroute(tree: Tree, hop: int, gone: Callable[[int], bool]) -> tuple[int | None, list[tuple[int, list[Source]]]]:
    """Where a contribution meant for tree node ``hop`` goes when nodes are ``gone``: the
    nearest live ancestor (None: the servers), and the lost nodes it stands in for, each with
    its inputs (what the receiver's :meth:`ChunkSum.lost` needs)."""
    chain: list[tuple[int, list[Source]]] = []
    current: int | None = hop
    while current is not None and gone(current):
        chain.append((current, node_inputs(tree, current)))
        current = tree[current].parent
    return current, chain


__all__ = ["Assembler", "Assembly", "ChunkSum", "Forward", "Member", "Source", "Tree", "TreeNode", "chunk_count",
           "chunk_elems", "chunk_span", "decode_tree", "encode_tree", "node_inputs", "reroute", "tree_root"]
