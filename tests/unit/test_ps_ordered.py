"""TicTac's enforcement at the sender on the PS runtime (threads): per-tensor answers in priority
order, a fresh random order per pull, and the worker's forward pre-hooks that wait for them.

    .venv/bin/python -m pytest tests/unit/test_ps_ordered.py -q
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from mlfabric.errors import CollectiveTimeoutError
from mlfabric.order import forward_dag, tio
from mlfabric.runtime.fair_share import NIC_RATE_ENV, PAYLOAD_FRACTION
from mlfabric.transport.base import SendHandle
from mlfabric.ps import ModelSpec, PSConfig, PSLayout, PSRequestError, local_jobs
from mlfabric.ps.policies.ordered import handoff_order, lift_pacing, pace_fairly, shard_pieces
from mlfabric.ps.overlap import ParameterGate, call_names
from tests.unit.test_ps import run_job


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(7, generator=g), "b": torch.randn(3, 5, generator=g), "c": torch.randn(11, generator=g),
            "d": torch.randn(2, generator=g), "e": torch.randn(9, generator=g)}


def test_pieces_cover_each_shard_and_sort_by_priority_then_registration() -> None:
    spec = ModelSpec.of("m", _tensors())
    for servers in (1, 2, 3):
        covered = []
        for offset, length in spec.shards(servers):
            pieces = shard_pieces(spec, offset, length)
            assert [p.start for p in pieces] == sorted(p.start for p in pieces)
            assert sum(p.hi - p.lo for p in pieces) == length  # no gap, no overlap inside a shard
            covered += [(p.key, i) for p in pieces for i in range(p.lo, p.hi)]
        assert sorted(covered) == sorted((t.key, i) for t in spec.tensors for i in range(t.numel))
    pieces = shard_pieces(spec, 0, spec.numel)
    prio = {"a": 2, "b": 0, "c": 2, "d": 1, "e": 0}  # TIO-style ties: registration order breaks them
    assert [p.key for p in handoff_order(pieces, "priority", prio)] == ["b", "e", "d", "a", "c"]
    shuffled = [p.key for p in handoff_order(pieces, "random", None, random.Random(1))]
    assert sorted(shuffled) == sorted(spec.keys)
    assert shuffled == [p.key for p in handoff_order(pieces, "random", None, random.Random(1))]
    with pytest.raises(ValueError, match="priorities= to init_model"):
        handoff_order(pieces, "priority", None)


@pytest.mark.parametrize("servers", [1, 2])
def test_ordered_pull_arrives_in_priority_order_with_the_right_values(servers: int) -> None:
    tensors = _tensors()
    prio = {"a": 4, "b": 3, "c": 0, "d": 2, "e": 1}
    expected = sorted(prio, key=prio.get)

    def work(w: Any) -> Any:
        w.init_model("m", tensors, priorities=prio)
        out = torch.empty(ModelSpec.of("m", tensors).numel)
        pulls = []
        for _ in range(3):
            arriving = w.pull_in_order("m", out)
            arriving.join(timeout=10)
            pulls.append(([a.key for a in arriving.arrivals], [a.server for a in arriving.arrivals],
                          arriving.reordered, out.clone(), len(arriving.transfer_spans())))
            w.clock()
        return pulls

    results, _ = run_job(PSLayout(servers=servers, workers=2), PSConfig(consistency="bsp", timeout_s=20), work)
    flat = ModelSpec.of("m", tensors).flatten(tensors, who="test", op="init")
    spec = ModelSpec.of("m", tensors)
    for rank in range(servers, servers + 2):
        for keys, sources, reordered, values, spans in results[rank]:
            assert reordered == 0
            assert torch.equal(values, flat)
            assert spans == len(keys)
            for j in range(servers):  # each server sends its own pieces in priority order
                mine = [k for k, s in zip(keys, sources) if s == j]
                offset, length = spec.shards(servers)[j]
                assert mine == [k for k in expected if k in {p.key for p in shard_pieces(spec, offset, length)}]


def test_random_order_is_fresh_per_pull_and_priority_pull_needs_priorities() -> None:
    tensors = {f"t{i}": torch.full((3,), float(i)) for i in range(12)}

    def work(w: Any) -> Any:
        w.init_model("m", tensors)
        out = torch.empty(36)
        orders = []
        for _ in range(3):
            arriving = w.pull_in_order("m", out, order="random")
            arriving.join(timeout=10)
            orders.append([a.key for a in arriving.arrivals])
            assert torch.equal(out, torch.arange(12.0).repeat_interleave(3))
            w.clock()
        with pytest.raises(PSRequestError, match="priorities= to init_model"):
            w.pull_in_order("m", out).join(timeout=10)
        with pytest.raises(ValueError, match="choose one of"):
            w.pull_in_order("m", out, order="fifo")
        return orders

    results, _ = run_job(PSLayout(servers=1, workers=1), PSConfig(consistency="async", timeout_s=20), work)
    orders = results[1]
    assert all(sorted(o) == sorted(tensors) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # a fresh shuffle each pull (12! orders)


def test_priorities_are_checked_on_the_worker() -> None:
    def work(w: Any) -> None:
        with pytest.raises(ValueError, match="miss 1 tensor"):
            w.init_model("m", {"x": torch.zeros(2), "y": torch.zeros(2)}, priorities={"x": 0})
        with pytest.raises(ValueError, match="'z', which is not one of its tensors"):
            w.init_model("m", {"x": torch.zeros(2)}, priorities={"x": 0, "z": 1})
        with pytest.raises(ValueError, match="expected an int >= 0"):
            w.init_model("m", {"x": torch.zeros(2)}, priorities={"x": -1})

    run_job(PSLayout(servers=1, workers=1), PSConfig(consistency="async", timeout_s=10), work)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_gate_waits_for_each_module_then_runs_and_traces() -> None:
    """Worker 0 pulls at clock 1 under BSP: the answer waits for worker 1's clock (0.4 s). The
    forward starts at once and its first Linear's pre-hook waits; once the pieces land the
    forward gives the served model's output, and the trace names the DAG's nodes."""
    source = _net()
    x = torch.randn(2, 4)
    md = forward_dag(source, (x,))
    prio = tio(md.dag).by_parameter(md.dag)
    delay = 0.4

    def work(w: Any) -> Any:
        w.init_model("net", source, priorities=prio)
        if w.index == 1:
            time.sleep(delay)
            w.clock()
            return None
        w.clock()
        replica = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))  # other initial values
        gate = ParameterGate(replica, node_names=call_names(md.graph_module), device_time={"_2": 0.05})
        started = time.monotonic()
        gate.attach(w.pull_in_order("net", replica))
        with torch.no_grad():
            out = replica(x)
        trace = gate.trace(worker=0)
        gate.arriving.join()
        gate.remove()
        return out, started, gate.waits, trace, gate.arriving

    results, _ = run_job(PSLayout(servers=1, workers=2), PSConfig(consistency="bsp", timeout_s=20), work)
    out, started, waits, trace, arriving = results[1]
    with torch.no_grad():
        assert torch.allclose(out, source(x))
    assert waits[0][0] == "0" and waits[0][2] - started >= delay * 0.8  # the first Linear waited for the answer
    assert [n for n, _, _ in trace.compute] == ["_0", "_1", "_2"]  # fx node names of the DAG
    assert dict((n, e - s) for n, s, e in trace.compute)["_2"] == pytest.approx(0.05)  # its device time
    assert {n for n, _, _ in trace.transfers} == set(md.dag.recvs)
    assert trace.compute[0][1] >= arriving.complete["0.weight"]  # a module starts after its own parameters
    assert trace.start == min(s for _, s, _ in trace.transfers) and trace.end == trace.compute[-1][2]


def test_gate_timeout_names_module_tensor_and_server() -> None:
    def work(w: Any) -> Any:
        w.init_model("net", _net(), priorities={k: i for i, (k, _) in enumerate(_net().named_parameters())})
        if w.index == 1:
            time.sleep(1.5)  # its clock comes after worker 0 gave up
            w.clock()
            return None
        w.clock()
        replica = _net()
        gate = ParameterGate(replica, timeout_s=0.3)
        arriving = w.pull_in_order("net", replica)
        gate.attach(arriving)
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            replica(torch.zeros(1, 4))
        waited = time.monotonic() - started
        arriving.join(timeout=10)  # the answer does come later
        return str(info.value), waited

    results, _ = run_job(PSLayout(servers=1, workers=2), PSConfig(consistency="bsp", timeout_s=20), work)
    text, waited = results[1]
    assert 0.3 <= waited < 1.0
    assert "rank 1 (worker 0)" in text and "module '0' waits for parameter '0.weight'" in text
    assert "from rank 0 (server 0)" in text and "0.3 s" in text


def test_gate_without_a_pull_does_not_wait() -> None:
    net = _net()
    with ParameterGate(net) as gate:
        gate.attach(None)
        start = time.monotonic()
        net(torch.zeros(1, 4))
        assert time.monotonic() - start < 0.5 and not gate.waits
        assert [n for n, _, _ in gate.spans] == ["0", "1", "2"]  # no fx names given: module names
    assert not net._forward_pre_hooks and not net[0]._forward_pre_hooks  # removed


class _Slow(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)  # the host busy (or descheduled) for 30 ms during this op
        return super().forward(x)


def _run_on_device(net: nn.Module, device: dict[str, float]) -> tuple[ParameterGate, float, float]:
    with ParameterGate(net, device_time=device) as gate:
        gate.attach(None)
        begin = time.monotonic()
        net(torch.zeros(1, 4))
        took = time.monotonic() - begin
    return gate, begin, took


def test_emulated_device_absorbs_a_slow_host_while_it_is_busy() -> None:
    """The device is busy with op 0 (50 ms) while the host spends 30 ms launching op 1: like
    a GPU stream, the ops run back to back and the forward takes the device's 90 ms."""
    net = nn.Sequential(nn.Linear(4, 4), _Slow(4, 4), nn.Linear(4, 4))
    gate, begin, took = _run_on_device(net, {"0": 0.05, "1": 0.02, "2": 0.02})
    (_, s0, e0), (_, s1, e1), (_, s2, e2) = gate.spans
    assert gate.host_late == 0
    assert s1 == e0 and s2 == e1  # the device never idles between ready ops
    assert [e - s for s, e in ((s0, e0), (s1, e1), (s2, e2))] == pytest.approx([0.05, 0.02, 0.02])
    assert e2 - begin == pytest.approx(0.09, abs=0.01)
    assert took >= e2 - begin  # the root's forward returns once the device is done (synchronize)
    assert took < 0.09 + 0.02  # the host's 30 ms were hidden, not added


def test_emulated_device_waits_for_a_host_that_fell_behind() -> None:
    """Op 0 runs 10 ms on the device but 30 ms on the host: op 1 cannot start before the host
    launches it, and that wait counts in host_late (the old model ended op 0's span late)."""
    net = nn.Sequential(_Slow(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    gate, begin, took = _run_on_device(net, {"0": 0.01, "1": 0.02, "2": 0.02})
    (_, s0, e0), (_, s1, e1), (_, s2, e2) = gate.spans
    assert gate.host_late == 1
    assert e0 - s0 == pytest.approx(0.01)  # an op's span is its device time
    assert s1 - begin >= 0.03 and s1 > e0  # the device idled until the host launched op 1
    assert s2 == e1 and took >= e2 - begin


class _PacingTransport:
    """Records pace_connection calls; ``can_pace`` says what the transport answers."""

    def __init__(self, can_pace: bool = True) -> None:
        self.calls: list[tuple[int, str, float | None]] = []
        self.can_pace = can_pace
        self.gone: set[int] = set()

    def pace_connection(self, peer: int, channel: str, rate_bps: float | None) -> bool:
        self.calls.append((peer, channel, rate_bps))
        return self.can_pace

    def is_gone(self, peer: int) -> bool:
        return peer in self.gone


def _pacing_server(nic_rate_bps: float | None, can_pace: bool = True, pace: bool = True) -> Any:
    return SimpleNamespace(nic_rate_bps=nic_rate_bps, channel="0", transport=_PacingTransport(can_pace),
                           paced_for_pulls=set(), ordered_in_flight={},
                           config=SimpleNamespace(pace_ordered_pulls=pace))


def test_ordered_answers_in_flight_share_the_nic_equally_and_a_flat_answer_lifts_the_caps() -> None:
    server = _pacing_server(1e9)
    pace_fairly(server, [1, 2, 3])
    assert server.transport.calls == [(r, "0", pytest.approx(PAYLOAD_FRACTION * 1e9 / 3)) for r in (1, 2, 3)]
    assert server.paced_for_pulls == {1, 2, 3}
    # Ranks 1-3's answers are in flight (2's is done) when rank 4's pull comes: three share the NIC.
    server.ordered_in_flight = {1: SendHandle(), 2: SendHandle(done=True), 3: SendHandle()}
    server.transport.calls.clear()
    pace_fairly(server, [4])
    assert server.transport.calls == [(r, "0", pytest.approx(PAYLOAD_FRACTION * 1e9 / 3)) for r in (1, 3, 4)]
    server.transport.calls.clear()
    lift_pacing(server, [2, 5])  # 5 was never capped: nothing to lift
    assert server.transport.calls == [(2, "0", None)] and server.paced_for_pulls == {1, 3, 4}
    # Rank 3 died mid-answer: its answer never completes, and it no longer takes a share.
    server.ordered_in_flight[4] = SendHandle()
    server.transport.gone.add(3)
    server.transport.calls.clear()
    pace_fairly(server, [2])
    assert server.transport.calls == [(r, "0", pytest.approx(PAYLOAD_FRACTION * 1e9 / 3)) for r in (1, 2, 4)]


def test_no_pacing_unless_asked_with_a_known_nic_rate_and_a_transport_that_paces() -> None:
    unknown = _pacing_server(None)
    pace_fairly(unknown, [1, 2])
    assert unknown.transport.calls == [] and unknown.paced_for_pulls == set()
    not_asked = _pacing_server(1e9, pace=False)
    pace_fairly(not_asked, [1, 2])
    assert not_asked.transport.calls == [] and not_asked.paced_for_pulls == set()
    cannot = _pacing_server(1e9, can_pace=False)
    pace_fairly(cannot, [1])
    lift_pacing(cannot, [1])
    assert cannot.transport.calls == [(1, "0", pytest.approx(PAYLOAD_FRACTION * 1e9))]  # nothing to lift
    assert cannot.paced_for_pulls == set()


def test_pacing_asked_without_a_nic_rate_is_warned_about(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(NIC_RATE_ENV, raising=False)
    jobs = local_jobs(PSLayout(servers=1, workers=1), PSConfig(timeout_s=10, pace_ordered_pulls=True))
    try:
        assert jobs[0].server is not None and jobs[0].server.nic_rate_bps is None
        assert "pace_ordered_pulls is set but this server's NIC rate is unknown" in caplog.text
        assert "rank 0 (server 0)" in caplog.text and "MLFABRIC_NIC_RATE" in caplog.text
    finally:
        for job in jobs:
            job.close()


def test_the_server_reads_its_nic_rate_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NIC_RATE_ENV, "500mbit")
    jobs = local_jobs(PSLayout(servers=1, workers=1), PSConfig(timeout_s=10))
    try:
        assert jobs[0].server is not None and jobs[0].server.nic_rate_bps == pytest.approx(500e6)
    finally:
        for job in jobs:
            job.close()


def test_the_server_paces_ordered_rounds_and_lifts_the_caps_for_a_flat_pull() -> None:
    """Two workers under BSP: the ordered round is answered at half the NIC each; the flat
    pull that follows gets its connection back uncapped."""
    net = _net()
    prio = {k: i for i, (k, _) in enumerate(net.named_parameters())}
    calls: list[tuple[int, float | None]] = []

    def setup(jobs: list[Any]) -> None:
        server = jobs[0].server
        server.nic_rate_bps = 1e9

        def pace(peer: int, channel: str, rate_bps: float | None) -> bool:
            calls.append((peer, rate_bps))
            return True
        server.transport.pace_connection = pace

    def work(w: Any) -> Any:
        w.init_model("net", net, priorities=prio)
        w.clock()
        replica = _net()
        w.pull_in_order("net", replica).join()
        w.clock()
        w.pull("net")

    run_job(PSLayout(servers=1, workers=2), PSConfig(consistency="bsp", timeout_s=20, pace_ordered_pulls=True), work,
            setup=setup)
    # The two pulls come in one round or one after the other: a share of 1/2 or the whole NIC.
    shares = [pytest.approx(PAYLOAD_FRACTION * 1e9 / k) for k in (1, 2)]
    assert {r for r, rate in calls if rate is not None} == {1, 2} and all(rate in shares for _, rate in calls
                                                                          if rate is not None)
    assert sorted(c for c in calls if c[1] is None) == [(1, None), (2, None)]
    assert all(calls.index((r, None)) > max(i for i, c in enumerate(calls) if c[0] == r and c[1] is not None)
               for r in (1, 2))  # lifted after the last cap
