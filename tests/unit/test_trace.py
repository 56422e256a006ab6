"""The per-rank timeline (MLFABRIC_TRACE=DIR) and ``mlfabric trace merge`` (issue #26, part 3):
valid Chrome trace JSON with one event per collective and per transfer, whose fields agree with
the schedule that ran.

Run: python -m pytest tests/unit/test_trace.py
"""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

import mlfabric
from mlfabric.cli import app
from mlfabric.collectives import build
from mlfabric.runtime.trace import FORMAT, TRACE_ENV, merge
from mlfabric.schedule import Recv, Send

WORLD = 3
COUNT = 30_000


def _job(comm: mlfabric.Communicator) -> None:
    comm.allreduce(torch.ones(COUNT), algorithm="ring")
    comm.broadcast(torch.ones(10), root=1)


def test_each_rank_writes_a_timeline_of_its_collectives_and_transfers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    mlfabric.run_threads(WORLD, _job)
    files = sorted(tmp_path.glob("rank*.json"))
    assert len(files) == WORLD
    for path in files:
        document = json.loads(path.read_text())  # valid JSON
        assert document["otherData"]["format"] == FORMAT
        rank = document["otherData"]["rank"]
        events = document["traceEvents"]
        assert all(e["pid"] == rank for e in events)
        collectives = [e for e in events if e.get("cat") == "collective"]
        assert [(e["args"]["seq"], e["args"]["algorithm"], e["args"]["bytes"], e["args"]["outcome"])
                for e in collectives] == [(1, "allreduce:ring", 4 * COUNT, "ok"), (2, "broadcast", 40, "ok")]
        assert collectives[0]["name"] == f"allreduce(ring, sum) of {COUNT} x float32"
        # The transfers of the allreduce are the schedule's sends and receives, op for op.
        schedule = build("allreduce:ring", WORLD, rank, COUNT, op="sum")
        transfers = {(e["args"]["op"], e["name"].split()[0], e["args"]["peer"], e["args"]["bytes"])
                     for e in events if e.get("cat") == "transfer" and e["args"]["seq"] == 1}
        expected = {(i, "send" if isinstance(op, Send) else "recv", op.peer,
                     4 * (op.src if isinstance(op, Send) else op.dst).length)
                    for i, op in enumerate(schedule.ops) if isinstance(op, (Send, Recv))}
        assert transfers == expected
        start, end = collectives[0]["ts"], collectives[0]["ts"] + collectives[0]["dur"]
        for e in events:
            if e.get("cat") == "transfer" and e["args"]["seq"] == 1:
                assert e["dur"] >= 0 and start <= e["ts"] <= e["ts"] + e["dur"] <= end + 1
        lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert lanes[0] == "collectives" and any(name.startswith("send to rank") for name in lanes.values())


def test_merge_joins_the_ranks_into_one_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    mlfabric.run_threads(WORLD, _job)
    (tmp_path / "unrelated.json").write_text("{}")  # other JSON in the directory is left alone
    result = CliRunner().invoke(app, ["trace", "merge", str(tmp_path)])
    assert result.exit_code == 0, result.output
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["otherData"]["ranks"] == list(range(WORLD))
    events = merged["traceEvents"]
    assert {e["pid"] for e in events} == set(range(WORLD))
    assert sum(e.get("cat") == "collective" for e in events) == 2 * WORLD
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert names == [f"rank {r}" for r in range(WORLD)]
    timed = [e["ts"] for e in events if e["ph"] == "X"]
    assert timed == sorted(timed)
    # Merging again (merged.json is now in the directory) gives the same file.
    path, files = merge(tmp_path)
    assert files == WORLD and json.loads(path.read_text())["traceEvents"] == events


def test_merge_says_what_is_wrong(tmp_path) -> None:
    result = CliRunner().invoke(app, ["trace", "merge", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "no trace directory" in result.output
    result = CliRunner().invoke(app, ["trace", "merge", str(tmp_path)])
    assert result.exit_code == 1 and "no mlfabric rank traces" in result.output


def test_no_trace_without_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    comms = mlfabric.local_world(2)
    assert all(c.executor.tracer is None for c in comms)
    for comm in comms:
        comm.close()
