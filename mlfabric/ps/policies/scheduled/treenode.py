"""One node of a pipelined (cut-through) aggregation tree, without I/O (#36).

    .venv/bin/python -m pytest tests/unit/test_ps_trees.py -q -k node

A node of a tree the scheduler planned (its :class:`~.core.GroupOrder`: ``members`` summed
on this host, ``children`` whose partial sums it waits for, ``parent`` it forwards to, None
for the servers) is handed chunks as they arrive -- ``(source, index, array)`` -- and
returns what to forward: chunk ``i`` of the sum as soon as chunk ``i`` has arrived from every
input, never later (cut-through: a tree of depth ``d`` costs about one transfer plus ``d``
chunk times). It never sends, reads a clock nor blocks; whoever drives it (the runtime's
aggregator, a test, a simulator) carries the actions out.

Sums are exact and deterministic: a chunk is summed once all its inputs are in, in the
inputs' fixed order (members, then children, as the order lists them), whatever order they
arrived in -- integer inputs give the exact sum, float inputs the same bits on every run.

:func:`repair_orders` is the plan's side of a lost node: the tree's orders without it, its
children's subtrees re-attached to its parent (a lost root's first child takes its place),
its own members reported lost; :func:`repaired_entry` the server's order entry for the
slot without them. Nothing else moves: every other member stays on its node, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Hashable, Sequence

import numpy as np

from .core import GroupOrder
from ...scheduler.trees import TreeNode, repair_tree

__all__ = ["Forward", "TreeNodeCore", "chunk_elements", "repair_orders", "repaired_entry"]


@dataclass(frozen=True)
class Forward:
    """Send chunk ``index`` of this node's sum (``data``, ``count`` worker updates in it) to
    ``parent`` (None: the servers)."""

    parent: int | None
    index: int
    data: np.ndarray
    count: int


class TreeNodeCore:
    """One tree node's cut-through summing (module docstring). ``order``: what the scheduler
    told this host; ``elements``: the update's length; ``chunk_elements``: elements per chunk
    (the order's ``chunk_bytes`` over the item size; 0 or >= ``elements``: one chunk, store-
    and-forward); ``counts``: worker updates behind each input (a host request's members, a
    child's subtree; 1 each by default)."""

    def __init__(self, order: GroupOrder, *, elements: int, chunk_elements: int,
                 counts: dict[Hashable, int] | None = None) -> None:
        self.order = order
        self.inputs: tuple[Hashable, ...] = (*order.members, *(("child", c) for c in order.children))
        if not self.inputs:
            raise ValueError(f"tree node on host {order.host} (slot {order.slot}) has no inputs")
        self.elements = int(elements)
        step = int(chunk_elements) if 0 < chunk_elements < elements else max(int(elements), 1)
        self.bounds = [(lo, min(lo + step, self.elements)) for lo in range(0, max(self.elements, 1), step)]
        self.counts = {i: (counts or {}).get(i, 1) for i in self.inputs}
        self._chunks: list[dict[Hashable, np.ndarray]] = [{} for _ in self.bounds]
        self._seen: list[set[Hashable]] = [set() for _ in self.bounds]  # inputs in, per chunk (a repeat is an error)
        self.forwarded = 0

    @property
    def chunks(self) -> int:
        return len(self.bounds)

    @property
    def count(self) -> int:
        """Worker updates in this node's sum."""
        return sum(self.counts.values())

    def add(self, source: Hashable, index: int, data: Any, count: int | None = None) -> list[Forward]:
        """Chunk ``index`` from ``source`` (a member ``(rank, id)`` or ``("child", host)``;
        ``count``: the worker updates in it, as the child's :class:`Forward` says): the
        chunks that became complete, to forward (in index order: chunk i is never forwarded
        before chunk i-1, so a parent fed in order stays in order)."""
        if source not in self.counts:
            raise ValueError(f"tree node on host {self.order.host} (slot {self.order.slot}): {source!r} is not one "
                             f"of its inputs {list(self.inputs)}")
        if not 0 <= index < self.chunks:
            raise ValueError(f"tree node on host {self.order.host}: chunk {index} out of 0..{self.chunks - 1}")
        lo, hi = self.bounds[index]
        arr = np.asarray(data)
        if arr.shape != (hi - lo,):
            raise ValueError(f"tree node on host {self.order.host}: chunk {index} from {source!r} has shape "
                             f"{arr.shape}, expected ({hi - lo},)")
        if source in self._seen[index]:
            raise ValueError(f"tree node on host {self.order.host}: chunk {index} from {source!r} came twice")
        self._seen[index].add(source)
        if count is not None:
            self.counts[source] = int(count)
        self._chunks[index][source] = arr
        out = []
        while self.forwarded < self.chunks and len(self._chunks[self.forwarded]) == len(self.inputs):
            got = self._chunks[self.forwarded]
            total = got[self.inputs[0]].copy()
            for i in self.inputs[1:]:  # the inputs' fixed order: the same bits however they arrived
                total += got[i]
            self._chunks[self.forwarded] = {}
            out.append(Forward(parent=self.order.parent, index=self.forwarded, data=total, count=self.count))
            self.forwarded += 1
        return out

    @property
    def done(self) -> bool:
        return self.forwarded == self.chunks


def chunk_elements(chunk_bytes: int, itemsize: int) -> int:
    """Elements per chunk of ``chunk_bytes`` (0: one chunk)."""
    return 0 if chunk_bytes <= 0 else max(1, math.ceil(chunk_bytes / itemsize))


def repair_orders(orders: Sequence[GroupOrder], lost: int) -> tuple[list[GroupOrder], tuple[tuple[int, int], ...]]:
    """The orders of one tree (one slot) without host ``lost``: its children re-attached to
    its parent, a lost root replaced by its first child (:func:`mlfabric.ps.scheduler.trees.repair_tree`).
    Returns the new orders (only the surviving nodes; send them again to the hosts whose
    parent or children changed) and the lost node's own members (their updates were on it:
    the server's entry no longer counts them, :func:`repaired_entry`)."""
    if len({o.slot for o in orders}) > 1:
        raise ValueError(f"repair_orders: one tree (slot) at a time, got slots {sorted({o.slot for o in orders})}")
    nodes = [TreeNode(host=o.host, parent=o.parent, children=o.children, members=o.members) for o in orders]
    fixed, gone = repair_tree(nodes, lost)
    by_host = {o.host: o for o in orders}
    return [replace(by_host[n.host], parent=n.parent, children=n.children) for n in fixed], tuple(gone)


def repaired_entry(entry: list[Any], lost: Sequence[tuple[int, int]], requests: Sequence[Any]) -> list[Any]:
    """A tree's order entry (``["g", slot, count, deadline, ranks, ...]``) without the lost
    members ``(rank, id)``: its count less their worker updates, their ranks out of the
    held ranks (``requests``: the batch's requests, :class:`~.core.Request`, to count a host
    request's members)."""
    by_key = {(r.rank, r.id): r for r in requests}
    gone = [by_key[k] for k in lost]
    ranks = list(entry[4])
    for r in gone:
        for rank in r.ranks:
            ranks.remove(rank)
    return [entry[0], entry[1], int(entry[2]) - sum(r.count for r in gone), entry[3], ranks, *entry[5:]]
