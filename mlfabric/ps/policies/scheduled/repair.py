"""A lost node of an aggregation tree, on the plan's side (#36), without I/O.

    .venv/bin/python -m pytest tests/unit/test_ps_trees.py -q -k lost

:func:`repair_orders`: a tree's orders (its :class:`~.core.GroupOrder` per node) without a lost
node, its children's subtrees re-attached to its parent (a lost root's first child takes its
place), its own members reported lost; :func:`repaired_entry`: the server's order entry for
the slot without them. Nothing else moves: every other member stays on its node, once. The
data side of the same repair (chunks re-routed to the nearest live ancestor, each update in
each chunk once) is :class:`~.cutthrough.ChunkSum`'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from .core import GroupOrder
from ...scheduler.trees import TreeNode, repair_tree

__all__ = ["repair_orders", "repaired_entry"]


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
