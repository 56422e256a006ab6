"""Multi-level pipelined aggregation trees and multicast model distribution (issue #36).

    .venv/bin/python -m pytest tests/unit/test_ps_trees.py -q
    mlfabric bench scheduler --updates 1000 --trees

Alg. 3 aggregates at one level, store-and-forward, through ``k`` fixed aggregators, and
§10.3 distributes the model through one level of distributors: every update and every model
copy that is not aggregated crosses the one server NIC. This module generalises both to
trees chosen per batch from the residual bandwidths, pure (a :class:`NetState` in, a plan
out; nothing here sends or reads a clock):

* :func:`tree_aggregate` -- the aggregation step with trees. The ordering step (Alg. 2) is
  run by the caller exactly as today, so the application order, the positions, the drops
  and therefore every applied update's delay are today's; only *how* the kept updates reach
  the server changes. The kept updates are cut, in application order, into consecutive
  groups (one order entry each, as Alg. 3's groups): a group's hosts are its members' own
  hosts (each member's update is summed where it is: no NIC), and its tree is shaped by
  :func:`shape_tree`. Grouping rule: an update joins the open group unless its host's
  up-rate and the group's rates would differ by more than ``spread`` (x1.5) -- a slow
  NIC would hold the whole pipelined tree to its rate, so slow hosts form their own trees
  (which cost, pipelined, about what one slow transfer costs) -- or the tree would grow past
  :func:`max_nodes` hosts (then its pipeline latency would exceed a quarter of a transfer).
* :func:`shape_tree` -- one pipelined tree over a set of hosts: every node sends the sum
  once (up link), an interior node receives one stream per child (down link), the root
  sends to the sink. All edges of a cut-through tree carry the same bytes at the same rate
  ``r``, so ``r <= min(sink, every up)`` and a node may take ``floor(down / r)`` children:
  the largest ``r`` whose child slots cover the tree is found (bisection), the hosts with
  the most slots are placed nearest the root, breadth first (equal NICs give a chain, the
  bandwidth-optimal shape; slow down-links become leaves). A link's rate here is its
  largest residual (:func:`_rate`); the reservation then follows the timelines exactly.
* :func:`reserve_tree` -- a tree's reservation on the residual timelines: one rate profile
  for every edge, at every instant the minimum over the tree's links of residual /
  multiplicity (a node's down link carries one stream per child), and ``depth - 1`` chunks
  more (cut-through: each relay adds one chunk time; store-and-forward, ``chunk_bytes = 0``,
  adds a whole transfer per level instead). Trees are reserved slowest first, so the fast
  ones get the residual the slow ones leave, not the reverse.
* :func:`plan_multicast` -- model distribution: the pullers' hosts in trees rooted at the
  server (the same shaping, up and down swapped: each node receives once, forwards to its
  children), so a model version leaves the server once per tree (about once).
* :func:`repair_multicast` -- a relay lost in the middle of a multicast: the hosts it fed are
  fed by its own sender; everyone else still gets exactly one copy.
* :func:`repair_tree` -- a node lost in the middle of a tree: its children's subtrees are
  re-attached to its parent (a lost root's first child becomes the root and adopts the
  others); the lost node's own members are reported lost (their updates were on it),
  nothing else moves, so no update is lost twice or counted twice.

Multi-server batches (§10.2) keep Alg. 3 (docs/mlfabric_scheduler.md, "Trees").
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence


from mlfabric.ps.scheduler.aggregation import AggregationResult, GroupPlan, Objective, PullBatchPlan, objectives
from mlfabric.ps.scheduler.netstate import INF, NetState, Transfer, _stats, _subtract, down_link, up_link
from mlfabric.ps.scheduler.ordering import Batch, OrderResult

__all__ = ["SPREAD", "TreeNode", "max_nodes", "plan_multicast", "repair_tree", "reserve_tree", "shape_tree",
           "tree_aggregate", "tree_depth"]

#: An update joins an open group while the group's host rates stay within this factor.
SPREAD = 1.5


@dataclass(frozen=True, kw_only=True)
class TreeNode:
    """One node of a tree: its host, where it sends (``parent``; None: the sink, i.e. the
    server for aggregation, or for multicast the node is fed by the server), the hosts it
    receives from (aggregation) or forwards to (multicast) and the batch indices of the
    updates summed in on this host (aggregation; empty for multicast)."""

    host: int
    parent: int | None
    children: tuple[int, ...] = ()
    members: tuple[int, ...] = ()


def max_nodes(size: float, chunk_bytes: int) -> int:
    """Hosts one pipelined tree takes at most: each level adds a chunk time, so the latency of
    a chain of ``n`` stays under a quarter of a transfer (``n * chunk <= size / 4``).
    Store-and-forward (``chunk_bytes = 0``) keeps one level: a star of members into a root."""
    if chunk_bytes <= 0:
        return 1 << 30
    return max(2, int(size / (4 * chunk_bytes)))


def tree_depth(nodes: Sequence[TreeNode]) -> int:
    """Edges on the longest path from a node to the sink (1 for a lone root)."""
    by_host = {n.host: n for n in nodes}
    depth = 0
    for n in nodes:
        d, cur = 1, n
        while cur.parent is not None:
            cur = by_host[cur.parent]
            d += 1
        depth = max(depth, d)
    return depth


def _rate(net: NetState, link: int) -> float:
    """What a link offers a tree: its largest residual (its capacity once the reservations
    running now end). Why not the residual now, nor its mean over the next transfer time:
    hosts busy for a moment with another tree or model would fall into groups and shapes of
    their own (more server transfers); the reservation (:func:`reserve_tree`) then waits
    for them exactly (measured: docs/mlfabric_scheduler.md, "Trees")."""
    return float(net.peak[link])


def shape_tree(hosts: Sequence[int], *, send: Sequence[float], fan: Sequence[float], sink: float,
               limit: int | None = None) -> tuple[dict[int, int | None], float]:
    """The shape of one pipelined tree over ``hosts`` (distinct): ``send[i]`` the rate host
    ``i`` can send its stream at (aggregation: its up link; multicast: its down link, where
    it receives), ``fan[i]`` the rate its other side offers its children (aggregation: its
    down link; multicast: its up link), ``sink`` the rate at the root's end (the server).
    Returns ``{host: parent or None}`` and the tree's rate. ``limit``: at most this many
    children per node (None: as many as the rates allow)."""
    n = len(hosts)
    if n == 0:
        return {}, sink
    top = float(min(sink, min(send)))
    if n == 1 or top <= 0.0:
        # one node (or nothing moves now: a chain, the timelines decide when)
        parent: dict[int, int | None] = {hosts[0]: None}
        for a, b in zip(hosts, hosts[1:]):
            parent[b] = a
        return parent, max(top, 0.0)

    if limit is None and all(top <= f < 2 * top for f in fan):
        # every host can relay exactly one stream at the top rate: the chain the search below
        # would build (same order), without the search (the common case: equal NICs)
        order_ = sorted(range(n), key=lambda i: (-fan[i], hosts[i]))
        parent = {hosts[order_[0]]: None}
        for a, b in zip(order_, order_[1:]):
            parent[hosts[b]] = hosts[a]
        return parent, top

    fan_l = [float(f) for f in fan]

    def slots(r: float) -> list[int]:
        out = [int(f / r * (1 + 1e-12)) for f in fan_l]
        return [min(x, limit) for x in out] if limit is not None else out

    # the largest rate whose child slots cover the tree: lower the rate to the next value at
    # which some host gains a slot until they do (each step adds one slot or more: <= n - 1
    # steps of n hosts; trees have at most max_nodes hosts)
    rate = top
    cap = slots(rate) if rate > 0.0 else [0] * n
    while rate > 0.0 and sum(cap) < n - 1:
        gains = [f / (c + 1) for f, c in zip(fan_l, cap) if limit is None or c < limit]
        nxt = max(gains, default=0.0)
        if nxt <= 0.0 or nxt >= rate:
            rate = 0.0
            break
        rate = nxt
        cap = slots(rate)
    if rate <= 0.0:  # no host can forward now: a chain, the timelines decide when
        cap = [1] * n
    order = sorted(range(n), key=lambda i: (-cap[i], -fan_l[i], hosts[i]))
    parent = {hosts[order[0]]: None}
    free = [[order[0], int(cap[order[0]])]]  # breadth first: nodes with slots, shallowest first
    head = 0
    for i in order[1:]:
        while head < len(free) and free[head][1] <= 0:
            head += 1
        if head == len(free):  # not reachable: the slots cover n - 1 (guard for rounding)
            free.append([order[0], 1])
        p = free[head]
        parent[hosts[i]] = hosts[p[0]]
        p[1] -= 1
        if cap[i] > 0:
            free.append([i, int(cap[i])])
    return parent, rate


def _nodes(parent: dict[int, int | None], members: dict[int, list[int]]) -> tuple[TreeNode, ...]:
    kids: dict[int, list[int]] = {h: [] for h in parent}
    for h, p in parent.items():
        if p is not None:
            kids[p].append(h)
    # root first, then breadth first (a stable, readable order)
    roots = [h for h, p in parent.items() if p is None]
    out, queue = [], list(roots)
    while queue:
        h = queue.pop(0)
        out.append(TreeNode(host=h, parent=parent[h], children=tuple(kids[h]), members=tuple(members.get(h, ()))))
        queue += kids[h]
    return tuple(out)


def _walk_common(net: NetState, links: dict[int, int], size: float, start: float) -> tuple[float, list[float], list[float]]:
    """Send ``size`` bytes from ``start`` on every link of ``links`` (link -> streams on it)
    at one common rate, at every instant ``min(residual / streams)``: the end and profile
    (segments from the first positive rate on, equal neighbours merged)."""
    items = [(net.times[l], net.rates[l], m) for l, m in links.items()]
    idx = [bisect_right(tl, start) - 1 for tl, _, _ in items]
    if min(idx) < 0:
        raise ValueError(f"start {start} is before the network state's origin")
    # each link's current (residual / streams, next breakpoint); only links at a breakpoint move
    cur = [(rl[i] / m, tl[i + 1] if i + 1 < len(tl) else INF) for (tl, rl, m), i in zip(items, idx)]
    t, rem = start, size
    pt: list[float] = []
    pr: list[float] = []
    while True:
        r = min([c[0] for c in cur])
        if r <= 0.0:
            # nothing moves until every full link has residual again: jump there at once
            # (the other links' breakpoints on the way change nothing: the rate is 0)
            nxt = min([c[1] for c in cur if c[0] <= 0.0])
            if nxt == INF:
                return INF, pt, pr
            if pt and pr[-1] != 0.0:
                pt.append(t)
                pr.append(0.0)
            t = nxt
            for k, (tl, rl, m) in enumerate(items):
                if cur[k][1] <= t:
                    i = idx[k] = bisect_right(tl, t, idx[k]) - 1
                    cur[k] = (rl[i] / m, tl[i + 1] if i + 1 < len(tl) else INF)
            continue
        nxt = min([c[1] for c in cur])
        if not pr or pr[-1] != r:
            pt.append(t)
            pr.append(r)
        if nxt == INF or r * (nxt - t) >= rem:
            return t + rem / r, pt, pr
        rem -= r * (nxt - t)
        t = nxt
        for k, c in enumerate(cur):
            if c[1] == nxt:
                tl, rl, m = items[k]
                i = idx[k] = idx[k] + 1
                cur[k] = (rl[i] / m, tl[i + 1] if i + 1 < len(tl) else INF)


def _apply_common(net: NetState, links: dict[int, int], pt: list[float], pr: list[float], end: float) -> None:
    """Subtract ``streams x profile`` from each link (clamped at 0: ``residual / streams x
    streams`` may round an ulp above the residual)."""
    if not pt:
        return
    for link, m in links.items():
        scaled = pr if m == 1 else [m * r for r in pr]
        tl, rl = _subtract(net.times[link], net.rates[link], pt, scaled, end)
        if m != 1:
            ct, cr = [tl[0]], [max(0.0, rl[0])]
            for t, r in zip(tl[1:], rl[1:]):
                r = max(0.0, r)
                if r != cr[-1]:
                    ct.append(t)
                    cr.append(r)
            tl, rl = ct, cr
        net.times[link] = tl
        net.rates[link] = rl
        net.first_free[link], net.peak[link] = _stats(tl, rl)


def _tree_links(edges: Sequence[tuple[int, int]]) -> dict[int, int]:
    links: dict[int, int] = {}
    for src, dst in edges:
        if src == dst:
            continue
        for l in (up_link(src), down_link(dst)):
            links[l] = links.get(l, 0) + 1
    return links


def reserve_tree(net: NetState, edges: Sequence[tuple[int, int]], size: float, start: float, *, depth: int,
                 chunk_bytes: int) -> tuple[tuple[Transfer, ...], float]:
    """Reserve a pipelined tree's ``edges`` (src, dst) on ``net``: one common rate profile
    (module docstring) for ``size`` bytes plus the pipeline's fill, ``depth - 1`` chunks
    (store-and-forward: ``depth - 1`` whole transfers). Returns one :class:`Transfer` per
    edge (all with that profile, for the ledger and the pacing) and when the sink has all of
    it. Edges inside a host cost nothing."""
    fill = (depth - 1) * (chunk_bytes if chunk_bytes > 0 else size)
    links = _tree_links(edges)
    total = size + fill
    if not links or total <= 0.0:
        return tuple(Transfer(s, d, float(size), start, start, (), ()) for s, d in edges), start
    end, pt, pr = _walk_common(net, links, total, start)
    if end == INF:
        raise ValueError(f"tree {list(edges)} never completes: a link on it has no capacity left")
    _apply_common(net, links, pt, pr, end)
    tp, rp = tuple(pt), tuple(pr)
    trs = tuple(Transfer(s, d, float(size), start, end, tp, rp) if s != d else Transfer(s, d, float(size), start, start, (), ())
                for s, d in edges)
    return trs, end


def _edges_up(nodes: Sequence[TreeNode], sink: int) -> list[tuple[int, int]]:
    return [(n.host, sink if n.parent is None else n.parent) for n in nodes]


def tree_aggregate(batch: Batch, ordered: OrderResult, *, net: NetState, objective: Objective = "async",
                   start: float = 0.0, chunk_bytes: int, spread: float = SPREAD) -> AggregationResult:
    """The aggregation step with trees (module docstring) for a one-server batch: ``ordered``
    is Alg. 2's result (kept order and drops, untouched here); ``net`` the residual network
    the ordering started from (not changed). Every kept update is in exactly one group; the
    groups are consecutive in the application order; ``split`` is 0 (nothing goes direct:
    a tree's root costs the server one transfer, whatever the group's size)."""
    if len(batch.servers) != 1:
        raise ValueError("tree_aggregate plans one-server batches (§10.2's several servers keep Alg. 3)")
    server = batch.servers[0]
    order = list(ordered.order)
    state = net.fork()
    sizes = batch.sizes[:, 0].tolist()
    if not order:
        return AggregationResult(split=0, direct=(), groups=(), member_transfers={}, commit={}, obj_async=0.0,
                                 obj_sync=0.0, splits_tried=1)
    big = float(max(sizes[g] for g in order))
    peaks = state.peak.tolist()  # the shaping reads the state before any tree is reserved

    def rate(link: int) -> float:
        return peaks[link]

    limit = max_nodes(big, chunk_bytes)
    sink = rate(down_link(server))
    # consecutive groups: (indices, hosts in first-seen order)
    groups: list[tuple[list[int], list[int]]] = []
    lo = hi = 0.0
    for g in order:
        h = batch.src[g]
        # what the host's stream can get: no tree into the server goes faster than its NIC,
        # so hosts faster than the server are all alike (one tree, not one per NIC speed)
        u = min(rate(up_link(h)), sink) if h != server else INF
        if groups:
            idx, hosts = groups[-1]
            if h in hosts:
                idx.append(g)
                continue
            nlo, nhi = min(lo, u), max(hi, u)
            if len(hosts) < limit and (nlo * spread >= nhi or nhi == INF):
                idx.append(g)
                hosts.append(h)
                lo, hi = nlo, nhi
                continue
        groups.append(([g], [h]))
        lo = hi = u
    shaped = []
    for idx, hosts in groups:
        parent, r = shape_tree(hosts, send=[rate(up_link(h)) for h in hosts],
                               fan=[rate(down_link(h)) for h in hosts], sink=sink)
        members: dict[int, list[int]] = {}
        for g in idx:
            members.setdefault(batch.src[g], []).append(g)
        nodes = _nodes(parent, members)
        shaped.append((idx, nodes, r))
    # slowest first: the fast trees take what the slow ones leave
    arrival: dict[int, float] = {}
    transfers: dict[int, tuple[Transfer, ...]] = {}
    for j in sorted(range(len(shaped)), key=lambda j: (shaped[j][2], j)):
        idx, nodes, _ = shaped[j]
        size = float(max(sizes[g] for g in idx))
        trs, end = reserve_tree(state, _edges_up(nodes, server), size, start, depth=tree_depth(nodes),
                                chunk_bytes=chunk_bytes)
        transfers[j], arrival[j] = trs, end
    commit: dict[int, float] = {}
    member_tr: dict[int, tuple[Transfer, ...]] = {}
    plans = []
    t_max = start
    for j, (idx, nodes, _) in enumerate(shaped):
        t_max = max(t_max, arrival[j])
        for g in idx:
            commit[g] = t_max
            member_tr[g] = (Transfer(batch.src[g], batch.src[g], float(sizes[g]), start, start, (), ()),)
        plans.append(GroupPlan(slot=j + 1, hosts=(nodes[0].host,), members=tuple(idx), ready=start,
                               transfers=transfers[j], arrival=arrival[j], commit=t_max, nodes=nodes,
                               chunk_bytes=chunk_bytes))
    oa, osy = objectives([commit[g] for g in order])
    return AggregationResult(split=0, direct=(), groups=tuple(plans), member_transfers=member_tr, commit=commit,
                             obj_async=oa, obj_sync=osy, splits_tried=1)


def plan_multicast(net: NetState, *, server: int, pullers: Sequence[int], model_size: float, chunk_bytes: int,
                   start: float, spread: float = SPREAD) -> PullBatchPlan:
    """One model version to every host of ``pullers`` (distinct) down pipelined trees rooted
    at the ``server`` (module docstring): hosts grouped by their residual down-rate (within
    ``spread``, at most :func:`max_nodes` a tree), each group shaped by :func:`shape_tree`
    (receive once, forward to ``floor(up / r)`` children), reserved slowest first.
    ``PullBatchPlan.tree`` says who forwards to whom (the server to each tree's root);
    ``by_server`` lists the roots. ``net`` is not changed."""
    if len(set(pullers)) != len(pullers):
        raise ValueError("one model request per host")
    state = net.fork()
    if not pullers:
        return PullBatchPlan(groups=(), by_server=(), transfers=(), tree={}, chunk_bytes=chunk_bytes)
    src = _rate(state, up_link(server))
    down = {h: min(_rate(state, down_link(h)), src) for h in pullers}  # no tree goes faster than the server
    up = {h: _rate(state, up_link(h)) for h in pullers}
    limit = max_nodes(model_size, chunk_bytes)
    ranked = sorted(pullers, key=lambda h: (-down[h], h))
    groups: list[list[int]] = []
    for h in ranked:
        if groups and len(groups[-1]) < limit and down[h] * spread >= down[groups[-1][0]]:
            groups[-1].append(h)
        else:
            groups.append([h])
    tree: dict[int, list[int]] = {server: []}
    transfers: list[Transfer] = []
    for hosts in reversed(groups):  # slowest first
        parent, _ = shape_tree(hosts, send=[down[h] for h in hosts], fan=[up[h] for h in hosts], sink=src)
        nodes = _nodes(parent, {})
        edges = [(server if n.parent is None else n.parent, n.host) for n in nodes]
        trs, _ = reserve_tree(state, edges, model_size, start, depth=tree_depth(nodes), chunk_bytes=chunk_bytes)
        transfers += trs
        for n in nodes:
            tree.setdefault(server if n.parent is None else n.parent, []).append(n.host)
    roots = tuple(tree[server])
    return PullBatchPlan(groups=(), by_server=roots, transfers=tuple(transfers),
                         tree={h: tuple(v) for h, v in tree.items() if v}, chunk_bytes=chunk_bytes)


def multicast_depths(tree: dict[int, tuple[int, ...]], server: int) -> dict[int, int]:
    """Each host's depth below the server in a multicast ``tree`` (the server's children: 1)."""
    depth: dict[int, int] = {}
    queue = [(h, 1) for h in tree.get(server, ())]
    while queue:
        h, d = queue.pop(0)
        depth[h] = d
        queue += [(c, d + 1) for c in tree.get(h, ())]
    return depth


def repair_tree(nodes: Sequence[TreeNode], lost: int) -> tuple[tuple[TreeNode, ...], tuple[int, ...]]:
    """The tree without host ``lost`` (module docstring): its children re-attached to its
    parent; a lost root is replaced by its first child, which takes the other children (a
    tree keeps one root: one entry at the server). Its own members are returned as lost.
    Every other member stays on its node, once."""
    by_host = {n.host: n for n in nodes}
    if lost not in by_host:
        raise ValueError(f"host {lost} is not a node of this tree ({sorted(by_host)})")
    gone = by_host[lost]
    if gone.parent is None and gone.children:
        # promote the first child: it is the new root and adopts its siblings
        heir = gone.children[0]
        gone = TreeNode(host=lost, parent=heir, children=gone.children[1:], members=gone.members)
        nodes = [TreeNode(host=heir, parent=None, children=(*by_host[heir].children, lost),
                          members=by_host[heir].members) if n.host == heir else
                 gone if n.host == lost else n for n in nodes]
    out = []
    for n in nodes:
        if n.host == lost:
            continue
        children = tuple(c for c in n.children if c != lost)
        parent = n.parent
        if n.host in gone.children:
            parent = gone.parent
        if n.host == gone.parent:
            children = (*children, *gone.children)
        out.append(TreeNode(host=n.host, parent=parent, children=children, members=n.members))
    return tuple(out), gone.members


def attach_to_multicast(net: NetState, *, tree: dict[int, tuple[int, ...]], server: int, host: int,
                        model_size: float, start: float) -> tuple[int, Transfer]:
    """A pull that arrives while a multicast is in flight is answered from it (#36: the
    freshest version already in flight): ``host`` becomes a leaf of ``tree`` under the relay
    whose up-link has the most residual (leaves first: their up-links carry nothing of this
    tree), which forwards the chunks it holds and those still coming. Returns the relay and
    the reserved transfer (on ``net``, changed). A relay cannot send a chunk before it has
    it: the transfer ends no earlier than the relay's own copy, the caller's to add."""
    nodes = [h for dsts in tree.values() for h in dsts if h != host]
    if not nodes:
        raise ValueError("attach_to_multicast: the tree has no node to relay from")
    forwarding = {h for h, dsts in tree.items() if dsts}
    relay = max(nodes, key=lambda h: (h not in forwarding, float(net.peak[up_link(h)]), -h))
    return relay, net.reserve(relay, host, model_size, start)


def repair_multicast(tree: dict[int, tuple[int, ...]], lost: int) -> dict[int, tuple[int, ...]]:
    """A multicast ``tree`` (``PullBatchPlan.tree``) without the relay ``lost``: the hosts it
    forwarded to are fed by its own sender instead (the server, for a root), in its place;
    every other host is still reached exactly once. Raises if ``lost`` is not in the tree."""
    sender = next((src for src, dsts in tree.items() if lost in dsts), None)
    if sender is None:
        raise ValueError(f"host {lost} does not receive in this multicast tree")
    orphans = tree.get(lost, ())
    out: dict[int, tuple[int, ...]] = {}
    for src, dsts in tree.items():
        if src == lost:
            continue
        new: list[int] = []
        for h in dsts:
            new += list(orphans) if h == lost else [h]
        if new:
            out[src] = tuple(new)
    return out


__all__ += ["attach_to_multicast", "multicast_depths", "repair_multicast"]
