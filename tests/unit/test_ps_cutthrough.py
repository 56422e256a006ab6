"""Cut-through summing at aggregation tree nodes (sans I/O): integer inputs sum exactly, chunk i
goes on before the inputs' last chunks are in, deadlines give whole or torn aggregates, and a
node lost mid-tree is repaired without losing or double-counting an update.

    .venv/bin/python -m pytest tests/unit/test_ps_cutthrough.py -q
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from mlfabric.ps.policies.scheduled.cutthrough import Assembler, ChunkSum, Forward, chunk_count, chunk_span

N, CHUNK = 10, 3  # 4 chunks: 3 + 3 + 3 + 1 elements


def _update(seed: int) -> torch.Tensor:
    return torch.randint(-1000, 1000, (N,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def _chunks(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor[s:s + n] for s, n in (chunk_span(i, N, CHUNK) for i in range(chunk_count(N, CHUNK)))]


class Tree:
    """Leaves A (members 1, 2) and B (member 3) under root R (member 4); R's forwards go to the
    server's assembler; every node forwards as soon as its ChunkSum says so."""

    def __init__(self) -> None:
        self.updates = {r: _update(r) for r in (1, 2, 3, 4)}
        self.nodes = {"A": ChunkSum([("m", 1, 1), ("m", 2, 1)], N, CHUNK),
                      "B": ChunkSum([("m", 3, 1)], N, CHUNK),
                      "R": ChunkSum([("m", 4, 1), ("c", "A"), ("c", "B")], N, CHUNK)}
        self.parent = {"A": "R", "B": "R", "R": None}
        self.server = Assembler(N, CHUNK, torch.int64)
        self.result: Any = None
        self.log: list[tuple[str, str, int]] = []  # (what, node, chunk) in event order

    def forward(self, node: str, forwards: list[Forward]) -> None:
        for f in forwards:
            self.log.append(("forward", node, f.index))
            parent = self.parent[node]
            if parent is None:
                done = self.server.add(f)
                if done is not None:
                    self.result = done
            else:
                self.forward(parent, self.nodes[parent].add(("c", node), f.index, f.tensor, f.members))

    def member(self, rank: int, node: str, index: int) -> None:
        self.log.append(("member", node, index))
        part = _chunks(self.updates[rank])[index]
        self.forward(node, self.nodes[node].add(("m", rank, 1), index, part.clone(), [(rank, 1, 0)]))


HOME = {1: "A", 2: "A", 3: "B", 4: "R"}


@pytest.mark.parametrize("seed", range(6))
def test_a_two_level_tree_sums_integers_exactly_in_any_arrival_order(seed: int) -> None:
    tree = Tree()
    arrivals = [(r, i) for r in HOME for i in range(4)]
    random.Random(seed).shuffle(arrivals)
    for rank, index in arrivals:
        tree.member(rank, HOME[rank], index)
    assert tree.result is not None and not tree.result.torn
    assert torch.equal(tree.result.tensor, sum(tree.updates.values()))
    assert tree.result.members == ((1, 1, 0), (2, 1, 0), (3, 1, 0), (4, 1, 0))
    assert all(node.done for node in tree.nodes.values())


def test_chunk_i_goes_on_before_the_inputs_last_chunks_are_in() -> None:
    """Cut-through: members send chunk by chunk; the root forwards chunk 0 to the server while
    every input's chunks 1..3 are still to come (store-and-forward would wait for them)."""
    tree = Tree()
    for index in range(4):
        for rank in HOME:
            tree.member(rank, HOME[rank], index)
    first_root_forward = tree.log.index(("forward", "R", 0))
    later_members = [e for e in tree.log[first_root_forward:] if e[0] == "member"]
    assert len(later_members) == 12  # chunks 1..3 of all 4 members came after it
    assert torch.equal(tree.result.tensor, sum(tree.updates.values()))


def test_store_and_forward_is_one_chunk() -> None:
    node = ChunkSum([("m", 1, 1), ("m", 2, 1)], N, 0)
    assert node.chunks == 1 and node.add(("m", 1, 1), 0, _update(1), [(1, 1, 0)]) == []
    (out,) = node.add(("m", 2, 1), 0, _update(2), [(2, 1, 0)])
    assert out.index == 0 and torch.equal(out.tensor, _update(1) + _update(2)) and node.done


def test_a_deadline_before_any_chunk_left_gives_a_whole_partial_aggregate() -> None:
    node = ChunkSum([("m", 1, 1), ("m", 2, 1)], N, CHUNK)
    for i, part in enumerate(_chunks(_update(1))):
        assert node.add(("m", 1, 1), i, part.clone(), [(1, 1, 0)]) == []  # member 2 never comes
    server = Assembler(N, CHUNK, torch.int64)
    results = [server.add(f) for f in node.expire()]
    assert results[-1] is not None and not results[-1].torn
    assert torch.equal(results[-1].tensor, _update(1)) and results[-1].members == ((1, 1, 0),)


def test_a_deadline_after_some_chunks_left_gives_a_torn_aggregate() -> None:
    """Chunk 0 went with both members, member 2 never sent the rest: the chunks hold different
    members, the server must not apply it (it skips the entry like a late one)."""
    node = ChunkSum([("m", 1, 1), ("m", 2, 1)], N, CHUNK)
    server = Assembler(N, CHUNK, torch.int64)
    out = []
    for i, part in enumerate(_chunks(_update(1))):
        out += node.add(("m", 1, 1), i, part.clone(), [(1, 1, 0)])
    out += node.add(("m", 2, 1), 0, _chunks(_update(2))[0].clone(), [(2, 1, 0)])
    assert [f.index for f in out] == [0]
    out += node.expire()
    results = [server.add(f) for f in out]
    assert results[-1] is not None and results[-1].torn
    assert node.expire() == []  # nothing twice


def test_a_chunk_nobody_sent_by_the_deadline_is_not_forwarded() -> None:
    node = ChunkSum([("m", 1, 1), ("m", 2, 1)], N, CHUNK)
    node.add(("m", 1, 1), 2, _chunks(_update(1))[2].clone(), [(1, 1, 0)])
    assert [f.index for f in node.expire()] == [2] and node.done


@pytest.mark.parametrize("reroute_first", [False, True])
@pytest.mark.parametrize("sent_before_loss", [0, 2, 4])
def test_a_node_lost_mid_tree_is_repaired_without_losing_or_double_counting(
        sent_before_loss: int, reroute_first: bool) -> None:
    """A forwards its first ``sent_before_loss`` chunks to R, then is lost; its members send
    every chunk again, to R, standing in for A. R keeps A's chunks that came and takes the
    members' for the rest: each update exactly once in every chunk."""
    tree = Tree()
    for rank in (3, 4):
        for i in range(4):
            tree.member(rank, HOME[rank], i)
    for i in range(sent_before_loss):  # A gets (and forwards) these chunks, then dies
        tree.member(1, "A", i)
        tree.member(2, "A", i)
    assert [e[2] for e in tree.log if e[:2] == ("forward", "A")] == list(range(sent_before_loss))
    root = tree.nodes["R"]
    forwards: list[Forward] = []
    if not reroute_first:
        forwards += root.lost(("c", "A"), [("m", 1, 1), ("m", 2, 1)])
    for rank in (1, 2):  # every chunk again, from the members' kept copies
        for i, part in enumerate(_chunks(tree.updates[rank])):
            forwards += root.add(("m", rank, 1), i, part.clone(), [(rank, 1, 0)])
    if reroute_first:  # the members' chunks overtook the message naming the lost node
        forwards += root.lost(("c", "A"), [("m", 1, 1), ("m", 2, 1)])
    for f in forwards:
        done = tree.server.add(f)
        if done is not None:
            tree.result = done
    assert tree.result is not None and not tree.result.torn
    assert torch.equal(tree.result.tensor, sum(tree.updates.values()))
    assert len(tree.result.members) == 4 and root.done
    assert root.ignored == 2 * sent_before_loss  # the members' copies of A's forwarded chunks


def test_two_lost_levels_named_bottom_up_are_repaired() -> None:
    """R <- C <- D <- member 1; C holds member 2. C and D are lost; the repair messages name D
    before C (they came on different connections): R still sums each update once."""
    root = ChunkSum([("m", 3, 1), ("c", "C")], N, CHUNK)
    out = root.lost(("c", "D"), [("m", 1, 1)])
    out += root.lost(("c", "C"), [("m", 2, 1), ("c", "D")])
    for rank in (1, 2, 3):
        for i, part in enumerate(_chunks(_update(rank))):
            out += root.add(("m", rank, 1), i, part.clone(), [(rank, 1, 0)])
    server = Assembler(N, CHUNK, torch.int64)
    results = [server.add(f) for f in out]
    assert results[-1] is not None and not results[-1].torn
    assert torch.equal(results[-1].tensor, _update(1) + _update(2) + _update(3))


def test_bad_chunks_are_refused() -> None:
    node = ChunkSum([("m", 1, 1)], N, CHUNK)
    with pytest.raises(ValueError, match="chunk 4 from"):
        node.add(("m", 1, 1), 4, torch.zeros(1, dtype=torch.int64), [])
    with pytest.raises(ValueError, match="2 elements, expected 3"):
        node.add(("m", 1, 1), 0, torch.zeros(2, dtype=torch.int64), [])
    with pytest.raises(ValueError, match="at least one input"):
        ChunkSum([], N, CHUNK)
    assert node.add(("m", 1, 1), 0, torch.zeros(3, dtype=torch.int64), []) != []
    assert node.add(("m", 1, 1), 0, torch.zeros(3, dtype=torch.int64), []) == [] and node.ignored == 1


def test_reroute_goes_to_the_nearest_live_ancestor_naming_the_lost_nodes() -> None:
    from mlfabric.ps.policies.scheduled.cutthrough import TreeNode, decode_tree, encode_tree, reroute, tree_root

    # server <- 1 <- 2 <- 3 (member (3, 7)); 2 also holds member (2, 5)
    tree = {1: TreeNode(parent=None, children=(2,), members=((1, 1),)),
            2: TreeNode(parent=1, children=(3,), members=((2, 5),)),
            3: TreeNode(parent=2, children=(), members=((3, 7),))}
    assert decode_tree(encode_tree(tree)) == tree and tree_root(tree, 3) == 1
    assert reroute(tree, 2, lambda h: False) == (2, [])
    assert reroute(tree, 2, lambda h: h == 2) == (1, [(2, [("m", 2, 5), ("c", 3)])])
    dest, chain = reroute(tree, 2, lambda h: h in (1, 2))
    assert dest is None and [h for h, _ in chain] == [2, 1]  # the servers, standing in for both
    with pytest.raises(ValueError, match="loop"):
        tree_root({1: TreeNode(parent=2, children=(), members=()), 2: TreeNode(parent=1, children=(), members=())}, 1)
