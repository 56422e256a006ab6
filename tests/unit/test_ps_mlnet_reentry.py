"""MLNET's recovered node re-entering the tree (MLNET §3), on the sans-I/O tree core: what a
restarted worker's node asks and sends, what its new parent answers, and how the repairs
after it treat its place (as built: gone; where it is now: a leaf).

    .venv/bin/python -m pytest tests/unit/test_ps_mlnet_reentry.py -q

The chain of server 0 is server <- w0 <- w1 <- w2 <- w3 (worker w is rank w + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mlfabric.ps import PSLayout, protocol
from mlfabric.ps.policies.mlnet import FALL_BACK, Send, TreeCore

LAYOUT = PSLayout(servers=1, workers=4)
CHAIN = np.array([[-1, 0, 1, 2]])
ENDPOINTS = {"0": "127.0.0.1:9"}


@dataclass
class _Port:
    index: int
    layout: PSLayout = LAYOUT
    pull_staleness: float = 0.0

    @property
    def rank(self) -> int:
        return self.layout.worker_rank(self.index)

    @property
    def who(self) -> str:
        return f"worker {self.index}"

    def server_rank(self, server: int) -> int:
        return self.layout.server_ranks[server]

    def fail_over(self, peer: int) -> bool:
        return False


def _core(worker: int, *, rejoining: bool = False, lost: tuple[int, ...] = ()) -> TreeCore:
    core = TreeCore(_Port(worker), CHAIN, rejoining=rejoining)
    core.lost = {LAYOUT.worker_rank(w): "test: killed" for w in lost}
    return core


def _sends(core: TreeCore) -> list[tuple[int, str, str]]:
    """(peer worker or -1 for the server, tag kind, op) of every action taken."""
    out = []
    for action in core.take_actions():
        assert isinstance(action, Send)
        op = (action.fields or {}).get("op") or protocol.decode(action.meta)["op"]
        peer = LAYOUT.worker_index(action.peer) if LAYOUT.role(action.peer) == "worker" else -1
        out.append((peer, action.on, op))
    return out


def _attach_id(core: TreeCore) -> int:
    (request_id, _), = core.waiting_replies()
    return request_id


def _re_entered(worker: int, through: int, clock: int) -> TreeCore:
    """Worker ``worker``'s restarted node, taken back by its parent after ``through`` and
    counted by the servers from ``clock``, its actions so far taken."""
    core = _core(worker, rejoining=True)
    core.event("enter", ENDPOINTS)
    _sends(core)
    core.attached(_attach_id(core), through, 0.0)
    core.event("rejoined", clock)
    core.take_actions()
    return core


def test_a_restarted_node_tells_everyone_then_enters_below_its_first_live_ancestor() -> None:
    core = _core(2, rejoining=True, lost=(1,))  # its parent as built, w1, is lost: w0 takes it
    assert core.trees[0].members == [2]  # its children as built were adopted when it was lost
    core.event("enter", ENDPOINTS)
    assert _sends(core) == [(0, "tree", "reentered"), (3, "tree", "reentered"), (0, "tree", "attach")]
    assert not core.entered() and core.entering_parents() == [LAYOUT.worker_rank(0)]
    core.attached(_attach_id(core), 9, 0.0)  # w0 sent clock 9 up without it
    assert core.entered() and core.entry_clock() == 10
    core.event("rejoined", 12)  # the servers count it from 12: w0 gets empty clocks 10 and 11
    fillers = core.take_actions()
    assert [(a.peer, a.fields["op"], a.fields["clock"], a.fields["workers"]) for a in fillers] == \
        [(LAYOUT.worker_rank(0), "clock", c, []) for c in (10, 11)]
    core.event("push", 0, "m", 12, torch.ones(2), {"version": 12})
    core.event("clock", 12)
    core.forward()
    up = core.take_actions()
    assert [(a.fields["op"], a.fields["clock"], a.fields["workers"]) for a in up] == \
        [("push", 12, [2]), ("clock", 12, [2])]


def test_the_losses_a_restarted_node_finds_are_old_ones_not_a_burst_that_tears_the_trees_down() -> None:
    core = _core(3, rejoining=True, lost=(1, 2))  # two interior nodes gone when it comes back
    core.event("enter", ENDPOINTS)
    assert _sends(core) == [(0, "tree", "reentered"), (0, "tree", "attach")]
    core.watch({LAYOUT.worker_rank(w): "lost: test" for w in (1, 2)}, 100.0)
    assert not core.fallen_back
    # while a node that saw them go within the window falls back (MLNET §3)
    other = _core(0, lost=(1, 2))
    other.watch({LAYOUT.worker_rank(w): "lost: test" for w in (1, 2)}, 100.0)
    assert other.fallen_back


def test_a_parent_lost_while_the_node_enters_is_passed_over() -> None:
    core = _core(2, rejoining=True)
    core.event("enter", ENDPOINTS)
    _sends(core)
    core.lost = {LAYOUT.worker_rank(1): "test: killed"}
    core.watch({LAYOUT.worker_rank(1): "lost: test"}, 0.0)
    assert _sends(core) == [(0, "tree", "attach")]  # asked again, one step up
    assert core.trees[0].parent == 0 and not core.entered()


def test_a_node_that_finds_the_trees_torn_down_goes_to_the_servers() -> None:
    core = _core(2, rejoining=True)
    core.event("enter", ENDPOINTS)
    _sends(core)
    core.attached(_attach_id(core), -1, 0.0, fell_back=True)
    assert core.entered() and core.fallen_back and core.trees[0].parent == -1
    assert core.entry_clock() == 0 and core.take_actions() == []


def test_a_re_entered_leaf_whose_parent_is_lost_tears_the_trees_down() -> None:
    core = _re_entered(2, through=4, clock=5)
    core.lost = {LAYOUT.worker_rank(1): "test: killed"}
    core.watch({LAYOUT.worker_rank(1): "lost: test"}, 50.0)
    assert core.fallen_back
    sent = _sends(core)
    assert (-1, "request", "attach") in sent and (3, "tree", FALL_BACK) in sent


def test_the_parent_takes_it_back_as_a_leaf_and_adopts_nobody_when_it_is_lost_again() -> None:
    core = _core(0)  # w0: members w0, w1
    core.lost = {LAYOUT.worker_rank(1): "test: killed"}
    core.watch({LAYOUT.worker_rank(1): "lost: test"}, 0.0)
    tree = core.trees[0]
    assert tree.members == [0, 2]  # w1's child adopted
    tree.next_clock = 7
    core.lost = {}  # the transport readmitted it (the driver, on its note)
    rank1 = LAYOUT.worker_rank(1)
    core.from_child(rank1, protocol.Reentered(tree=0, endpoints=ENDPOINTS).fields())
    core.from_child(rank1, protocol.Attach(id=33, rejoin=True).fields(tree=0))
    assert tree.members == [0, 2, 1] and tree.through[1] == 6 and core.stats.taken_back == [1]
    (answer,) = core.take_actions()
    assert (answer.peer, answer.on, answer.request_id, answer.fields) == \
        (rank1, "reply", 33, {"op": "attached", "through": 6})
    # lost again: a leaf, nobody to adopt (its children as built are w0's already)
    core.lost = {rank1: "test: killed again"}
    core.watch({rank1: "lost: test"}, 10.0)
    assert tree.members == [0, 2]


def test_repairs_pass_over_a_re_entered_node_as_over_a_lost_one() -> None:
    # w3's parent w2 is lost; its first ancestor as built is w1, which re-entered elsewhere as
    # a leaf: w3 goes to w0, which holds w1's subtree as built
    core = _core(3)
    core.from_child(LAYOUT.worker_rank(1), protocol.Reentered(tree=0, endpoints=ENDPOINTS).fields())
    core.lost = {LAYOUT.worker_rank(2): "test: killed"}
    core.watch({LAYOUT.worker_rank(2): "lost: test"}, 0.0)
    assert core.trees[0].parent == 0
    assert _sends(core) == [(0, "tree", "attach")]


def test_an_attachment_that_cannot_be_placed_tears_the_trees_down_instead_of_waiting() -> None:
    core = _core(1)  # w1 (members w1, w2); w0 re-attaches here, which is above it
    core.from_child(LAYOUT.worker_rank(0), protocol.Attach(id=3).fields(tree=0))
    assert core.fallen_back
    assert (0, "tree", FALL_BACK) in _sends(core)


def test_a_re_entered_leaf_lost_again_leaves_its_children_as_built_where_they_are() -> None:
    # w1 and w2 were lost; w0 adopted w3. w1 came back (a leaf of w0), then w2, whose first
    # live ancestor as it sees it is w1: w1 takes it as a leaf. w2 lost again: w1 must not
    # adopt w3 (it sends to w0), or it would wait for w3's clocks forever.
    core = _re_entered(1, through=3, clock=4)
    rank2 = LAYOUT.worker_rank(2)
    core.from_child(rank2, protocol.Reentered(tree=0, endpoints=ENDPOINTS).fields())
    core.from_child(rank2, protocol.Attach(id=8, rejoin=True).fields(tree=0))
    assert core.trees[0].members == [1, 2]
    core.lost = {rank2: "test: killed"}
    core.watch({rank2: "lost: test"}, 10.0)
    assert core.trees[0].members == [1] and core.stats.adopted == 0


def test_a_restarted_parent_answers_a_restarted_child_only_once_it_is_counted_again() -> None:
    # w1 and w2 restarted together: w2 asks w1, which does not know its own first clock yet;
    # answered with it, so that w2's clocks are neither sent too early nor dropped as late
    core = _core(1, rejoining=True)
    core.event("enter", ENDPOINTS)
    _sends(core)
    rank2 = LAYOUT.worker_rank(2)
    core.from_child(rank2, protocol.Reentered(tree=0, endpoints=ENDPOINTS).fields())
    core.from_child(rank2, protocol.Attach(id=8, rejoin=True).fields(tree=0))
    assert core.take_actions() == [] and core.trees[0].members == [1]
    core.attached(_attach_id(core), 3, 0.0)
    core.event("rejoined", 9)
    answers = [a for a in core.take_actions() if a.on == "reply"]
    assert [(a.peer, a.request_id, a.fields) for a in answers] == [(rank2, 8, {"op": "attached", "through": 8})]
    assert core.trees[0].members == [1, 2] and core.trees[0].through[2] == 8
