"""Every parameter-server header is typed in ``mlfabric/ps/protocol.py`` (#35): no untyped
``protocol.encode(...)`` left in the package, the typed scheduled-policy headers put the same
dicts on the wire as the ad-hoc ones they replace, and the scheduled server encodes its model
header once per distinct meta without decoding what it encoded itself.

    .venv/bin/python -m pytest tests/unit/test_ps_protocol_typed.py -q
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs, protocol
from mlfabric.ps.policies.scheduled import ScheduledSettings
from tests.unit.ps_pulls_by_hand import waiting_pulls

PS = Path(protocol.__file__).parent


def untyped_encodes(source: str, filename: str) -> list[str]:
    """``file:line`` of every use of protocol's ``encode`` in ``source`` (``protocol.encode``,
    called or not, or a call of an ``encode`` imported from a ``protocol`` module), and of every
    such import."""
    tree = ast.parse(source, filename)
    imported: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "protocol":
            for alias in node.names:
                if alias.name == "encode":
                    imported.add(alias.asname or alias.name)
                    found.append(f"{filename}:{node.lineno} (imports protocol.encode)")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "encode" and isinstance(node.value, ast.Name)
                and node.value.id == "protocol") or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                                                     and node.func.id in imported):
            found.append(f"{filename}:{node.lineno}")
    return found


def test_the_scan_finds_an_untyped_header() -> None:
    """The scan below can fail: it sees both spellings of an untyped encode."""
    source = ("from mlfabric.ps import protocol\nfrom .protocol import encode as enc\n"
              "meta = protocol.encode(op='decision', drop=True)\nother = enc(op='x')\nok = protocol.Ok(version=1).encode()\n"
              "alias = protocol.encode\n")
    assert sorted(untyped_encodes(source, "x.py")) == ["x.py:2 (imports protocol.encode)", "x.py:3", "x.py:4", "x.py:6"]


def test_no_untyped_header_is_encoded_outside_protocol_py() -> None:
    """Every sender builds a typed header (:class:`protocol.Header`) and calls its ``encode``:
    a ``protocol.encode(...)`` of ad-hoc fields anywhere in ``mlfabric/ps/`` but protocol.py
    fails here (type it in protocol.py, with its fields as sent)."""
    files = sorted(p for p in PS.rglob("*.py") if p != PS / "protocol.py")
    assert len(files) > 20  # the package was found (policies/ and policies/scheduled/ included)
    found = [hit for p in files for hit in untyped_encodes(p.read_text(), str(p.relative_to(PS.parent.parent)))]
    assert found == [], "untyped headers (type them in mlfabric/ps/protocol.py): " + ", ".join(found)


# The wire format is unchanged: each typed header decodes to the dict the ad-hoc
# ``protocol.encode(**fields)`` of the same message gave before it was typed (the literal dicts
# below are what service.py, aggregator.py, worker.py, server.py and replica.py built).
TREE = [[5, -1, [6]], [6, 5, []]]
CASES: list[tuple[protocol.Header, dict[str, Any]]] = [
    (protocol.Order(batch=3, model="m", v_init=7, entries=[["u", [1, 2], 0.5]], sync=True, clocks={"1": 2}),
     {"op": "order", "batch": 3, "model": "m", "v_init": 7, "entries": [["u", [1, 2], 0.5]], "sync": True,
      "clocks": {"1": 2}}),
    (protocol.Dropped(reason="stale", batch=3),
     {"op": "decision", "drop": True, "reason": "stale", "batch": 3}),
    (protocol.Planned(batch=3, group=None, position=None, hop=[0, 0], start_in=0.25, rates=[1e6, 2e6]),
     {"op": "decision", "drop": False, "batch": 3, "group": None, "position": None, "hop": [0, 0],
      "start_in": 0.25, "rates": [1e6, 2e6]}),
    (protocol.Planned(batch=3, group=2, position=1, hop=[5, 5], start_in=0.0, rates=[1e6], tree=TREE,
                      chunk_bytes=1024, hold_in=1.5, host_members=[[7, 11]]),
     {"op": "decision", "drop": False, "batch": 3, "group": 2, "position": 1, "hop": [5, 5], "start_in": 0.0,
      "rates": [1e6], "tree": TREE, "chunk_bytes": 1024, "hold_in": 1.5, "host_members": [[7, 11]]}),
    (protocol.ToHost(drop=False, reason=None, batch=3, host=5, host_id=9),
     {"op": "decision", "drop": False, "reason": None, "batch": 3, "host": 5, "host_id": 9}),
    (protocol.GroupPlan(batch=3, slot=1, model="m", members=[[1, 4], [2, 5]], servers=[0], deadline_in=0.5,
                        rates=[1e6]),
     {"op": "group", "batch": 3, "slot": 1, "model": "m", "members": [[1, 4], [2, 5]], "servers": [0],
      "deadline_in": 0.5, "rates": [1e6]}),
    (protocol.GroupPlan(batch=3, slot=1, model="m", members=[[1, 4]], servers=[0], deadline_in=0.5, rates=[1e6],
                        tree=TREE, chunk_bytes=0),
     {"op": "group", "batch": 3, "slot": 1, "model": "m", "members": [[1, 4]], "servers": [0], "deadline_in": 0.5,
      "rates": [1e6], "tree": TREE, "chunk_bytes": 0}),
    (protocol.ScheduledPush(model="m", clock=2, version=6, norm=0.5, batch=3, id=4, rank=1),
     {"op": "push", "model": "m", "clock": 2, "version": 6, "norm": 0.5, "batch": 3, "id": 4, "rank": 1}),
    (protocol.Member(model="m", clock=2, version=6, norm=None, batch=3, id=4, rank=1, workers=[0, 1],
                     versions=[6, 5], members=[[1, 4], [2, 8]], slot=2, server=0),
     {"op": "member", "model": "m", "clock": 2, "version": 6, "norm": None, "batch": 3, "id": 4, "rank": 1,
      "workers": [0, 1], "versions": [6, 5], "members": [[1, 4], [2, 8]], "slot": 2, "server": 0}),
    (protocol.GroupSum(model="m", clock=2, version=6, norm=0.0, batch=3, slot=2, workers=[0, 1], versions=[6, 6],
                       members=[[1, 4], [2, 8]]),
     {"op": "push", "model": "m", "batch": 3, "slot": 2, "clock": 2, "version": 6, "norm": 0.0, "workers": [0, 1],
      "versions": [6, 6], "members": [[1, 4], [2, 8]]}),
    (protocol.HostPart(server=0, rank=2, id=8, version=6, clock=2),
     {"op": "hostpart", "server": 0, "rank": 2, "id": 8, "version": 6, "clock": 2}),
    (protocol.TreeChunk(model="m", batch=3, slot=2, server=0, chunk=1, elems=256, source=["m", 1, 4],
                        members=[[1, 4, 6]], clock=2, root=5),
     {"op": "tchunk", "model": "m", "batch": 3, "slot": 2, "server": 0, "chunk": 1, "elems": 256,
      "source": ["m", 1, 4], "members": [[1, 4, 6]], "clock": 2, "root": 5}),
    (protocol.TreeChunk(model="m", batch=3, slot=2, server=0, chunk=1, elems=256, source=["c", 6],
                        members=[[1, 4, 6]], clock=2, root=5, lost=[[6, [["m", 1, 4]]]]).to_server(),
     {"op": "push", "model": "m", "batch": 3, "slot": 2, "server": 0, "chunk": 1, "elems": 256,
      "source": ["c", 6], "members": [[1, 4, 6]], "clock": 2, "root": 5, "lost": [[6, [["m", 1, 4]]]]}),
    (protocol.TreeReroute(batch=3, slot=2, lost=6, dest=5),
     {"op": "treroute", "batch": 3, "slot": 2, "lost": 6, "dest": 5}),
    (protocol.Via(distributor=3), {"op": "via", "distributor": 3}),
    (protocol.Via(distributor=3, mtree={"3": [[4, 12]]}), {"op": "via", "distributor": 3, "mtree": {"3": [[4, 12]]}}),
    (protocol.ModelReply(version=7, model_clock=None, forward=[[2, 10], [3, 11]]),
     {"op": "model", "version": 7, "model_clock": None, "forward": [[2, 10], [3, 11]]}),
    (protocol.ModelChunk.of(protocol.ModelReply(version=7, model_clock=4), mtree={"3": [[4, 12]]}, chunk=0,
                            chunks=8, elems=256, itemsize=4, nbytes=8000),
     {"op": "model", "version": 7, "model_clock": 4, "mtree": {"3": [[4, 12]]}, "chunk": 0, "chunks": 8,
      "elems": 256, "itemsize": 4, "nbytes": 8000}),
    (protocol.Units(model="m", units=[4, 5], commit_in=[0.5, 0.75]),
     {"op": "units", "model": "m", "units": [4, 5], "commit_in": [0.5, 0.75]}),
    (protocol.Unit(unit=4, model="m"), {"op": "unit", "unit": 4, "model": "m"}),
    (protocol.Replicate(unit=4, model="m", id=9, server=0, dest=6, replica=6, start_in=0.1, rate=1e6),
     {"op": "replicate", "unit": 4, "model": "m", "id": 9, "server": 0, "dest": 6, "replica": 6, "start_in": 0.1,
      "rate": 1e6}),
    (protocol.Replicate(unit=4, model="m", id=9, server=0, dest=2, replica=6, start_in=0.0, rate=None, recovery=True),
     {"op": "replicate", "unit": 4, "model": "m", "id": 9, "server": 0, "dest": 2, "replica": 6, "start_in": 0.0,
      "rate": None, "recovery": True}),
    (protocol.ReplicaUnit(unit=4, model="m", server=0, dest=6, members=[[1, 9], [2, 3]], rate=None),
     {"op": "runit", "unit": 4, "model": "m", "server": 0, "dest": 6, "members": [[1, 9], [2, 3]], "rate": None}),
    (protocol.ReplicaMember(unit=4, model="m", server=0, rank=2, replica=6, id=3),
     {"op": "rmember", "unit": 4, "model": "m", "server": 0, "rank": 2, "replica": 6, "id": 3}),
    (protocol.Probe(model="m", batch=3, version=7, t=12.5),
     {"op": "probe", "model": "m", "batch": 3, "version": 7, "t": 12.5}),
]


@pytest.mark.parametrize("header,before", CASES, ids=[f"{type(h).__name__}-{i}" for i, (h, _) in enumerate(CASES)])
def test_a_typed_header_puts_the_same_dict_on_the_wire_as_before(header: protocol.Header, before: dict[str, Any]) -> None:
    assert protocol.decode(header.encode()) == before
    assert protocol.decode(protocol.encode(**before)) == before  # the old sender's bytes decode alike


def test_the_scheduled_order_is_the_plans_fields() -> None:
    """The scheduler's order is ``BatchPlan.order()`` typed: no field of the plan's left out."""
    from types import SimpleNamespace

    from mlfabric.ps.policies.scheduled.core import BatchPlan

    plan = SimpleNamespace(batch=3, model="m", v_init=7, entries=[["g", 1, 2, 0.5, [1, 2]]], sync=False, clocks=[4, 4])
    fields = BatchPlan.order(plan)  # type: ignore[arg-type]
    assert protocol.decode(protocol.Order(**fields).encode()) == {"op": protocol.ORDER, **fields}


@pytest.mark.parametrize("trees", [False, True])
def test_the_scheduled_server_encodes_its_model_header_once_per_meta_and_never_decodes_it(
        monkeypatch: pytest.MonkeyPatch, trees: bool) -> None:
    """§10.3 distributors and #36 multicast chunks, answered by hand: the server's thread
    decodes nothing (it used to decode the header it had just encoded, to re-encode it with
    each distributor's ``forward``); every worker still gets the values and the version."""
    layout = PSLayout(servers=1, workers=4)
    settings = (ScheduledSettings(distributors=1, rate_bps=8e6, trees=True, chunk_bytes=1024) if trees
                else ScheduledSettings(distributors=1, rate_bps=8e6))
    jobs = local_jobs(layout, PSConfig(consistency="async:4", timeout_s=10, routing="scheduled", scheduled=settings))
    server = jobs[0].server
    values = torch.arange(1000.0)
    decoded_on: list[int] = []
    decode = protocol.decode

    def recording_decode(meta: bytes) -> dict[str, Any]:
        decoded_on.append(threading.get_ident())
        return decode(meta)

    monkeypatch.setattr(protocol, "decode", recording_decode)
    metas: list[dict[str, Any]] = []
    send = server.transport.send

    def recording_send(dest: int, tag: int, payload: Any, *, meta: bytes = b"", **kwargs: Any) -> Any:
        metas.append(decode(meta))
        return send(dest, tag, payload, meta=meta, **kwargs)

    monkeypatch.setattr(server.transport, "send", recording_send)

    try:
        pulls, collect = waiting_pulls(layout, jobs)
        server.routing.answer_pulls(server, pulls, values, protocol.ModelReply(version=7, model_clock=None))
        assert threading.get_ident() not in decoded_on  # the server decoded none of its own headers
        got = collect()
        assert sorted(got) == [1, 2, 3, 4]
        for version, payload in got.values():
            assert version == 7 and torch.equal(payload, values)
        models = [m for m in metas if m["op"] == "model"]
        assert models and all(m["version"] == 7 and m["model_clock"] is None for m in models)
        if trees:  # every chunk names the tree; the shard is whole at each root
            assert all("chunk" in m and "mtree" in m and "forward" not in m for m in models)
        else:  # the distributor's answer names who it relays to, the others' are plain
            assert [m for m in models if "forward" in m]
            assert all(set(m) == {"op", "version", "model_clock"} for m in models if "forward" not in m)
        assert server.stats.pulls_relayed >= 1
    finally:
        for j in jobs:
            j.comm.close()


def test_mlnet_actions_carry_typed_headers_with_the_same_dicts_as_before() -> None:
    """MLNET's tree core (ps/policies/mlnet.py) hands its driver typed headers: a node's sum,
    clock and pull toward its parent node (with the tree), toward the server (without), and the
    fall-back note decode to the dicts the core built before they were typed."""
    from mlfabric.ps.policies.mlnet import FALL_BACK, Deliver, Send

    total = dict(model="m", clock=3, workers=[1, 2], versions=[4, 5], dtype="float32")
    cases = [
        (Send(peer=1, on="tree", header=protocol.TreeSum(**total), tree=0),
         {"op": "push", "tree": 0, **total}),
        (Send(peer=0, on="request", header=protocol.TreeSum(**total, version=4, norm=2.5)),
         {"op": "push", **total, "version": 4, "norm": 2.5}),
        (Send(peer=1, on="tree", header=protocol.TreePull(id=9, model="m", need=2.0), tree=1),
         {"op": "pull", "tree": 1, "id": 9, "model": "m", "need": 2.0}),
        (Send(peer=0, on="request", header=protocol.Pull(id=9, model="m", clock=2, staleness=0)),
         {"op": "pull", "id": 9, "model": "m", "clock": 2, "staleness": 0}),
        (Send(peer=3, on="tree", header=protocol.FallBack(tree=0, why="two lost")),
         {"op": FALL_BACK, "tree": 0, "why": "two lost"}),
        (Deliver(src=0, request_id=4, header=protocol.ErrorReply(message="lost", lost_peer=2)),
         {"op": "error", "message": "lost", "lost_peer": 2}),
    ]
    for action, before in cases:
        assert action.fields == before and protocol.decode(action.encode()) == before
    copy = protocol.ModelReply(version=1, model_clock=1).encode()
    relayed = Send(peer=2, on="reply", meta=copy, request_id=5)
    assert relayed.fields is None and relayed.encode() is copy  # a model copy goes on as it came
