"""MLNET's tree node as a sans-I/O core: one recorded sequence of a node's inputs (its worker's
events, its children's messages, the answers from above, peers lost), fed once to the
runtime's driver (:class:`~mlfabric.ps.policies.mlnet.TreeNode`: messages on the transport,
decoded once) and once to the simulator's (:class:`~mlfabric.sim.mlnet.SimTreeDriver`: typed
inputs), gives the same actions: what is summed and forwarded, what is answered from the
copy and what is asked above, adoption, re-attachment and the fall back. And the simulator's
MLNET PS model runs on those cores.

    .venv/bin/python -m pytest tests/unit/test_ps_mlnet_core.py -q
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mlfabric.ps import PSLayout, protocol
from mlfabric.ps.policies.mlnet import _NODE_IDS, Deliver, MLNetSettings, Send
from mlfabric.sim.mlnet import SimTreeDriver, simulate_tree_ps
from mlfabric.transport.base import Message

from tests.unit.test_ps_mlnet_repair import _hand_driven_node

MODEL_META = protocol.encode(op="model", version=1, model_clock=1)
MODEL = memoryview(bytes(range(8)))

# The node of worker 1 in a chain (server <- w0 <- w1 <- w2 <- w3; ranks 1..4), pass by pass:
# (events of its worker, messages from children (worker, header, tensor), replies from above
# (rank, request id, header), ranks lost before the pass).
SEQUENCE: list[dict[str, Any]] = [
    {"events": [("push", 0, "m", 0, torch.ones(2), {"version": 0}), ("clock", 0),
                ("pull", 0, {"model": "m", "id": 7, "clock": 1, "staleness": None})],
     "messages": [(2, {"op": "push", "tree": 0, "model": "m", "clock": 0, "workers": [2, 3], "versions": [0, 0],
                       "dtype": "float32"}, torch.full((2,), 2.0)),
                  (2, {"op": "clock", "tree": 0, "clock": 0, "workers": [2, 3]}, None)]},
    {"replies": [(1, _NODE_IDS, {"op": "model", "version": 1, "model_clock": 1})]},  # from w0: the copy of round 1
    {"messages": [(2, {"op": "pull", "tree": 0, "id": 11, "model": "m", "need": 1.0}, None),  # from the copy
                  (2, {"op": "pull", "tree": 0, "id": 12, "model": "m", "need": 2.0}, None)]},  # asked above
    {"lost": [3]},  # child w2 (interior) lost: w3 adopted
    {"events": [("push", 0, "m", 1, torch.ones(2), {"version": 1}), ("clock", 1)],
     "messages": [(3, {"op": "attach", "tree": 0, "id": 5}, None),
                  (3, {"op": "push", "tree": 0, "model": "m", "clock": 1, "workers": [3], "versions": [1],
                       "dtype": "float32"}, torch.full((2,), 4.0)),
                  (3, {"op": "clock", "tree": 0, "clock": 1, "workers": [3]}, None)]},
    {"lost": [1]},  # the parent w0 lost too, within the window: the trees fall back
    {"replies": [(0, _NODE_IDS + 2, {"op": "attached", "through": 0})]},  # the server has clock 0: send 1 again
]


def _comparable(action: Any) -> tuple[Any, ...]:
    def payload(p: Any) -> Any:
        if p is None:
            return None
        return p.tolist() if isinstance(p, torch.Tensor) else bytes(p)

    if isinstance(action, Deliver):
        return ("deliver", action.src, None, action.request_id, action.fields, action.meta, payload(action.payload),
                None)
    assert isinstance(action, Send)
    return ("send", action.peer, action.on, action.request_id, action.fields, action.meta, payload(action.payload),
            action.track)


def _runtime_actions() -> list[tuple[Any, ...]]:
    with _hand_driven_node(worker=1) as (node, _tree, _sent):
        del node.core._up  # the hand-driven harness captures what goes up: here it goes out as actions
        node.record = []
        transport = node.transport
        for step in SEQUENCE:
            for rank in step.get("lost", []):
                transport._peer_lost(rank, "test: killed")
            node._events.extend(step.get("events", []))
            for worker, header, part in step.get("messages", []):
                data = memoryview(b"") if part is None else memoryview(part.numpy().tobytes())
                transport._deliver(Message(node.layout.worker_rank(worker), node.tag, node.channel,
                                           protocol.encode(**header), data))
            for rank, request_id, header in step.get("replies", []):
                meta = MODEL_META if header["op"] == "model" else protocol.encode(**header)
                transport._deliver(Message(rank, protocol.reply_tag(node.session, request_id), node.channel, meta,
                                           MODEL if header["op"] == "model" else memoryview(b"")))
            node._pass()
        return [_comparable(a) for a in node.record]


def _simulated_actions() -> list[tuple[Any, ...]]:
    layout = PSLayout(servers=1, workers=4)
    driver = SimTreeDriver(layout, 1, MLNetSettings(tree="tree:1").parents(4, 1))
    actions = []
    for t, step in enumerate(SEQUENCE):
        for rank in step.get("lost", []):
            driver.lost[rank] = "test: killed"
        replies = [(request_id, header, MODEL_META if header["op"] == "model" else protocol.encode(**header),
                    MODEL if header["op"] == "model" else memoryview(b""))
                   for _rank, request_id, header in step.get("replies", [])]
        actions += driver.turn(float(t), events=step.get("events", []),
                               messages=[(layout.worker_rank(w), h, p) for w, h, p in step.get("messages", [])],
                               replies=replies)
    return [_comparable(a) for a in actions]


def test_one_recorded_sequence_gives_the_same_actions_in_the_runtime_and_the_simulator() -> None:
    runtime, simulated = _runtime_actions(), _simulated_actions()
    assert runtime == simulated
    ops = [(a[1], a[2], a[3], (a[4] or {}).get("op")) for a in runtime]
    assert ops == [
        (1, "tree", None, "pull"),        # the worker's pull: no copy yet, asked of w0
        (1, "tree", None, "push"),        # clock 0: w1's update + w2's sum (w2, w3), then its clock
        (1, "tree", None, "clock"),
        (0, None, 7, None),               # the copy came: the worker's pull answered (deliver, as from the server)
        (3, "reply", 11, None),           # w2's pull answered from the copy, its header passed on as it came
        (1, "tree", None, "pull"),        # w2's second pull needs more: asked of w0
        (4, "reply", 5, "attached"),      # w2 lost: w3 adopted, re-attaches here, learns clock 0 is in
        (1, "tree", None, "push"),        # clock 1: w1's + w3's
        (1, "tree", None, "clock"),
        (0, "request", None, "attach"),   # w0 lost too within 3 s: fall back, attach to the server
        (4, "tree", None, "fall_back"),   # and tell the live nodes
        (0, "request", None, "push"),     # the server has clock 0: clock 1 again, this worker's own push only
        (0, "request", None, "clock"),
        (0, "request", None, "pull"),     # the waiting pull asked again, of the server
    ]
    assert runtime[1][6] == [3.0, 3.0] and runtime[1][4]["workers"] == [1, 2, 3]
    assert runtime[7][6] == [5.0, 5.0] and runtime[11][6] == [1.0, 1.0] and runtime[11][4]["workers"] == [1]
    assert runtime[4][5] == MODEL_META and runtime[4][6] == bytes(MODEL)


@pytest.mark.parametrize("tree", ["binary", "tree:2"])
def test_the_simulators_mlnet_model_runs_the_runtimes_tree_nodes(tree: str) -> None:
    """Trees send the server one sum and take one model per root-level node per round, where
    BASELINE (direct) moves one per worker each way: the server's bytes drop accordingly."""
    args = {"workers": 8, "update_bytes": 4e6, "rate_bps": 1e9, "compute_s": 0.05, "iterations": 4}
    direct, trees = simulate_tree_ps("direct", **args), simulate_tree_ps(tree, **args)
    roots = int((MLNetSettings(tree=tree).parents(8, 1)[0] < 0).sum())
    assert direct["server_bytes_in"] == 8 * 4 * 4e6 and trees["server_bytes_in"] == roots * 4 * 4e6
    assert trees["server_bytes_out"] == roots * 4 * 4e6
    assert trees["time_s"] < direct["time_s"]  # the server's NIC bounds BASELINE
