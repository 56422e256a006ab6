"""The parameter-server runtime on threads (in-process transport): layout, sharding, the
consistency models exactly, the update rule, the APIs of both papers, bad input and faults.

    python -m pytest tests/unit/test_ps.py -q
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Collection

import pytest
import torch

from mlfabric.errors import PeerLostError
from mlfabric.ps import (ClockBook, Consistency, ModelSpec, PSConfig, PSJob, PSLayout, PSRequestError, ServerStats,
                         SGDMomentum, UpdateInfo, local_jobs, protocol)
from mlfabric.ps.layout import SERVERS_ENV

# --- pure parts -----------------------------------------------------------------------------


def test_layout_roles_and_names() -> None:
    layout = PSLayout(servers=2, replicas=1, workers=3)
    assert [layout.role(r) for r in range(6)] == ["server", "server", "replica", "worker", "worker", "worker"]
    assert list(layout.worker_ranks) == [3, 4, 5] and layout.worker_index(4) == 1
    assert layout.replicated_server(2) == 0 and layout.replicas_of(0) == [2] and layout.replicas_of(1) == []
    assert layout.describe(5) == "rank 5 (worker 2)"
    with pytest.raises(ValueError, match="not a worker"):
        layout.worker_index(0)
    with pytest.raises(ValueError, match="no worker"):
        PSLayout.for_world(3, servers=2, replicas=1)


def test_layout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SERVERS_ENV, "3")
    assert PSLayout.for_world(5) == PSLayout(servers=3, workers=2)
    monkeypatch.setenv(SERVERS_ENV, "x")
    with pytest.raises(ValueError, match="MLFABRIC_PS_SERVERS"):
        PSLayout.for_world(5)


def test_spec_flattens_checks_and_shards_evenly() -> None:
    tensors = {"w": torch.arange(12.0).view(3, 4), "b": torch.arange(5.0), "big": torch.ones(1000)}
    spec = ModelSpec.of("m", tensors)
    flat = spec.flatten(tensors, who="rank 3 (worker 0)", op="push")
    assert flat.tolist()[:17] == list(range(12)) + list(range(5))
    assert {k: v.shape for k, v in spec.unflatten(flat).items()} == {k: v.shape for k, v in tensors.items()}
    assert ModelSpec.from_json(spec.to_json()) == spec
    for servers in (1, 2, 3, 7):
        sizes = [n for _, n in spec.shards(servers)]
        assert sum(sizes) == spec.numel and max(sizes) - min(sizes) <= 1
        offsets = [o for o, _ in spec.shards(servers)]
        assert offsets == [sum(sizes[:i]) for i in range(servers)]
    with pytest.raises(ValueError, match=r"rank 3 \(worker 0\).*key 'w'.*shape \(4, 3\), expected \(3, 4\)"):
        spec.flatten({**tensors, "w": torch.zeros(4, 3)}, who="rank 3 (worker 0)", op="push")
    with pytest.raises(TypeError, match="key 'b'.*dtype float64, expected float32"):
        spec.flatten({**tensors, "b": torch.zeros(5, dtype=torch.float64)}, who="w", op="push")
    with pytest.raises(KeyError, match="unknown key 'nope'"):
        spec.flatten({**tensors, "nope": torch.zeros(1)}, who="w", op="push")
    with pytest.raises(KeyError, match="key 'big' is missing"):
        spec.flatten({"w": tensors["w"], "b": tensors["b"]}, who="w", op="push")
    # One tensor: the flat vector, or the only tensor of a one-tensor model whatever its key
    # (regression: a module's flat gradient was taken for a tensor keyed "0").
    torch.testing.assert_close(spec.flatten(flat, who="w", op="push"), flat)
    single = ModelSpec.of("s", {"weight": torch.zeros(1, 4)})
    assert single.flatten(torch.arange(4.0), who="w", op="push").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert single.flatten(torch.ones(1, 4), who="w", op="push").tolist() == [1.0] * 4
    with pytest.raises(ValueError, match=r"shape \(3,\) is neither the flat vector \(1017,\)"):
        spec.flatten(torch.zeros(3), who="w", op="push")
    with pytest.raises(ValueError, match="mixes dtypes"):
        ModelSpec.of("m", {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.int64)})


def test_consistency_parsing() -> None:
    assert Consistency.parse("ssp:2") == Consistency(kind="ssp", staleness=2)
    assert Consistency.parse("async:8").delay_bound == 8 and Consistency.parse("async").delay_bound is None
    assert Consistency.parse("bsp").pull_staleness == 0 and Consistency.parse("async").pull_staleness == math.inf
    assert str(Consistency.parse("ssp:3")) == "ssp:3"
    for bad in ("ssp", "bsp:1", "async:x", "lazy"):
        with pytest.raises(ValueError):
            Consistency.parse(bad)


def test_clocks_ssp_model_clock_and_departures() -> None:
    book = ClockBook(3, Consistency.parse("ssp:1"))
    book.tick(0, 0), book.tick(0, 1), book.tick(1, 0)
    assert book.model_clock(0.0) == 0
    assert book.pull_ready(1, 1, 0.0) and not book.pull_ready(2, 1, 0.0)
    book.lose(2, 0.0)  # SSP: out at once
    assert book.model_clock(0.0) == 1
    book.leave(1)
    assert book.model_clock(0.0) == 2
    book.leave(0)
    assert book.model_clock(0.0) == math.inf and book.everyone_gone()
    with pytest.raises(ValueError, match="clock 5 but its clock here is 2"):
        book.tick(0, 5)


def test_clocks_bsp_waits_for_a_lost_worker_then_reports_it() -> None:
    book = ClockBook(2, Consistency(), lost_worker_wait_s=5.0)
    book.tick(0, 0)
    assert book.closable_rounds(0.0) == []
    book.lose(1, 10.0)
    assert book.closable_rounds(12.0) == [] and book.next_deadline(12.0) == 15.0
    assert book.closable_rounds(15.0) == [0]
    assert book.missing == [(0, (1,))] and book.model_clock(15.0) == 1


def test_rule_is_torch_sgd_with_momentum() -> None:
    torch.manual_seed(0)
    w = torch.randn(10)
    ref = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    rule = SGDMomentum(0.1, 0.9)
    ours = w.clone()
    for step in range(5):
        g = torch.randn(10)
        ref.grad = g.clone()
        opt.step()
        rule(ours, g, UpdateInfo(model="m", server=0, version=step, workers=(0,), computed_from=(step,), weight=1.0))
    torch.testing.assert_close(ours, ref.detach())


def test_tags_stay_out_of_the_collectives_namespace() -> None:
    from mlfabric.runtime.executor import message_tag

    assert protocol.request_tag(0) != protocol.reply_tag(0, 0) != protocol.request_tag(1)
    assert protocol.tag(protocol.REPLY, 5, 7) & protocol.NAMESPACE
    assert not message_tag(10**6, (1 << 24) - 1) & protocol.NAMESPACE


# --- on threads ---------------------------------------------------------------------------------


def run_job(layout: PSLayout, config: PSConfig, worker_fn: Callable[[Any], Any],
            setup: Callable[[list[PSJob]], None] | None = None,
            killed: Collection[int] = ()) -> tuple[dict[int, Any], list[PSJob]]:
    """Every rank on a thread; returns {rank: worker_fn result or server stats}. Ranks in
    ``killed`` (the test kills them) may fail: their errors are not raised."""
    jobs = local_jobs(layout, config)
    if setup is not None:
        setup(jobs)
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def body(job: PSJob) -> None:
        try:
            results[job.rank] = job.serve() if job.role != "worker" else worker_fn(job.worker)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[job.rank] = exc
        finally:
            if job.worker is not None and job.rank not in killed:  # a killed rank's transport is gone
                job.worker.leave()

    threads = [threading.Thread(target=body, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for job in jobs:
        job.comm.close()
    errors = {rank: exc for rank, exc in errors.items() if rank not in killed}
    if errors:
        raise next(iter(errors.values()))
    return results, jobs


def quadratic_gradient(params: torch.Tensor, worker: int) -> torch.Tensor:
    """The gradient of 0.5 |params - target_w|^2: deterministic, differs per worker."""
    return params - torch.arange(params.numel(), dtype=params.dtype) * (worker + 1)


def test_bsp_is_synchronous_sgd_exactly() -> None:
    layout = PSLayout(servers=2, workers=3)
    steps, lr, momentum = 6, 0.1, 0.5

    def worker(w: Any) -> torch.Tensor:
        w.init_model("m", {"a": torch.zeros(4), "b": torch.zeros(3)}, lr=lr, momentum=momentum)
        for _ in range(steps):
            params = w.pull_flat("m")
            time.sleep(0.01 * w.index)  # arrive in different orders
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()
        return w.pull_flat("m")

    results, _ = run_job(layout, PSConfig(consistency="bsp", timeout_s=10), worker)
    ref = torch.nn.Parameter(torch.zeros(7))
    opt = torch.optim.SGD([ref], lr=lr, momentum=momentum)
    for _ in range(steps):
        ref.grad = torch.stack([quadratic_gradient(ref.detach(), i) for i in range(3)]).mean(0)
        opt.step()
    for rank in layout.worker_ranks:
        torch.testing.assert_close(results[rank], ref.detach())
    for server in layout.server_ranks:
        stats = results[server]
        assert stats.updates_applied == steps and stats.worker_updates == 3 * steps
        assert dict(stats.delays) == {0: 3 * steps} and stats.dropped == 0 and stats.errors == []


@pytest.mark.parametrize("routing", ["direct", "mlnet"])
def test_a_clock_that_rides_with_the_pull_is_the_same_bsp(routing: str) -> None:
    """pull_flat / pull_in_order(clock=True) = clock() then the pull: the same synchronous
    SGD, the same clocks; on direct routes the CLOCK header is handed over with the pull, in
    one call per server (mlnet's clocks climb the trees with the sums instead)."""
    layout = PSLayout(servers=2, workers=3)
    steps, lr = 5, 0.1
    handed: dict[int, list[list[str]]] = {}

    def worker(w: Any) -> tuple[torch.Tensor, int]:
        calls = handed[w.index] = []
        send_many = w.transport.send_many

        def recording(peer: int, messages: Any, **kw: Any) -> Any:
            calls.append([protocol.decode(meta)["op"] for _, _, meta in messages])
            return send_many(peer, messages, **kw)

        w.transport.send_many = recording
        w.init_model("m", {"a": torch.zeros(4), "b": torch.zeros(3)}, lr=lr)
        params = w.pull_flat("m")
        for k in range(steps):
            time.sleep(0.01 * w.index)  # arrive in different orders
            w.push("m", quadratic_gradient(params, w.index))
            if k % 2:
                params = w.pull_flat("m", clock=True).clone()
            else:
                params = torch.empty(7)
                w.pull_in_order("m", params, order="random", clock=True).join(timeout=10)
        return params, w.clock_value

    results, _ = run_job(layout, PSConfig(consistency="bsp", timeout_s=10, routing=routing), worker)
    ref = torch.nn.Parameter(torch.zeros(7))
    opt = torch.optim.SGD([ref], lr=lr)
    for _ in range(steps):
        ref.grad = torch.stack([quadratic_gradient(ref.detach(), i) for i in range(3)]).mean(0)
        opt.step()
    for rank in layout.worker_ranks:
        params, clock = results[rank]
        torch.testing.assert_close(params, ref.detach())
        assert clock == steps
    for index, calls in handed.items():
        together = [c for c in calls if c == ["clock", "pull"]]
        assert len(together) == (2 * steps if routing == "direct" else 0), (index, calls)
        assert "clock" not in sum((c for c in calls if c != ["clock", "pull"]), [])


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_ssp_pull_never_older_than_the_bound(staleness: int) -> None:
    layout = PSLayout(servers=1, workers=3)

    def worker(w: Any) -> list[tuple[int, int | None]]:
        w.init_model("m", torch.zeros(8), lr=0.01)
        for _ in range(6):
            params = w.pull_flat("m")
            time.sleep(0.03 if w.index == 0 else 0.0)  # worker 0 is the straggler
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()
        w.pull_flat("m")
        return w.stats.pull_clocks

    results, _ = run_job(layout, PSConfig(consistency=f"ssp:{staleness}", timeout_s=10), worker)
    seen_waiting = False
    for rank in layout.worker_ranks:
        for clock, model_clock in results[rank]:
            assert model_clock is None or model_clock >= clock - staleness, (rank, clock, model_clock)
            seen_waiting |= model_clock is not None and model_clock == clock - staleness and clock > staleness
    assert seen_waiting, "the straggler never held a fast worker at the bound: the test exercised nothing"
    stats = results[0]
    assert stats.worker_updates == 18 and sum(stats.delays.values()) == 18 and stats.dropped == 0


def test_async_delay_bound_drops_late_updates_and_records_every_delay() -> None:
    layout = PSLayout(servers=1, workers=3)

    def worker(w: Any) -> int:
        w.init_model("m", torch.zeros(8), lr=0.01)
        for _ in range(8):
            params = w.pull_flat("m")
            time.sleep(0.08 if w.index == 0 else 0.005)  # worker 0's updates go stale
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()
        return w.stats.pushes

    results, _ = run_job(layout, PSConfig(consistency="async:1", timeout_s=10), worker)
    stats = results[0]
    assert max(stats.delays) <= 1
    assert stats.dropped > 0, "the slow worker's updates should have exceeded the bound"
    assert stats.worker_updates + stats.dropped == 24 == sum(stats.delays.values()) + stats.dropped


def test_async_without_bound_applies_everything_with_delays() -> None:
    layout = PSLayout(servers=1, workers=2)

    def worker(w: Any) -> None:
        w.init_model("m", torch.zeros(4), lr=0.01)
        for _ in range(6):
            params = w.pull_flat("m")
            time.sleep(0.05 if w.index == 0 else 0.0)
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()

    results, _ = run_job(layout, PSConfig(consistency="async", timeout_s=10), worker)
    assert results[0].dropped == 0 and results[0].worker_updates == 12 and max(results[0].delays) >= 2


def test_mlfabric_spelling_get_push_to_server_and_allreduce() -> None:
    layout = PSLayout(servers=2, workers=3)

    def worker(w: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w.init_model("m", torch.arange(5.0), lr=1.0)
        shard1 = w.get(1, "m")
        summed = w.allreduce(torch.full((2, 2), float(w.index + 1)))
        again = w.allreduce(torch.tensor([w.index], dtype=torch.int64))
        if w.index == 0:
            w.push(1, torch.ones(2), update_norm=1.0)  # server 1 holds elements 3..4
        w.clock()
        return shard1, summed, again

    results, _ = run_job(layout, PSConfig(consistency="async", timeout_s=10), worker)
    for rank in layout.worker_ranks:
        shard1, summed, again = results[rank]
        assert shard1.tolist() == [3.0, 4.0]
        assert summed.shape == (2, 2) and summed.tolist() == [[6.0, 6.0], [6.0, 6.0]]
        assert again.tolist() == [3]
    assert results[1].worker_updates == 1 and results[0].worker_updates == 0


def test_async_futures() -> None:
    layout = PSLayout(servers=1, workers=1)

    def worker(w: Any) -> dict[str, torch.Tensor]:
        w.init_model("m", {"x": torch.zeros(3)}, lr=1.0)
        w.push_async("m", {"x": torch.ones(3)}).wait()
        w.clock()
        return w.pull_async("m").wait()

    results, _ = run_job(layout, PSConfig(consistency="ssp:0", timeout_s=10), worker)
    assert results[1]["x"].tolist() == [-1.0, -1.0, -1.0]


def test_replica_applies_the_servers_order() -> None:
    layout = PSLayout(servers=1, replicas=1, workers=2)

    def worker(w: Any) -> torch.Tensor:
        w.init_model("m", torch.zeros(6), lr=0.1, momentum=0.9)
        for _ in range(5):
            params = w.pull_flat("m")
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()
        return w.pull_flat("m")

    captured: dict[str, Any] = {}

    def setup(jobs: list[PSJob]) -> None:
        captured["server"], captured["replica"] = jobs[0].server, jobs[1].replica

    results, _ = run_job(layout, PSConfig(consistency="async", timeout_s=10), worker, setup)
    assert results[1] == {"m": 10}
    torch.testing.assert_close(captured["replica"].values["m"], captured["server"].shards["m"].values)


# --- bad input: at once, on the caller, naming worker, key and expectation ------------------------


def test_bad_input_fails_at_once_with_names() -> None:
    layout = PSLayout(servers=2, workers=1)

    def worker(w: Any) -> list[str]:
        messages = []
        started = time.monotonic()
        with pytest.raises(KeyError, match=r"rank 2 \(worker 0\): pull\('m'\) before init_model\('m'\)"):
            w.pull("m")
        w.init_model("m", {"w": torch.zeros(2, 2), "b": torch.zeros(2)}, lr=0.1)
        with pytest.raises(ValueError, match=r"rank 2 \(worker 0\): push of model 'm', key 'w': shape \(4,\), "
                                             r"expected \(2, 2\)"):
            w.push("m", {"w": torch.zeros(4), "b": torch.zeros(2)})
        with pytest.raises(TypeError, match="key 'b': dtype float64, expected float32"):
            w.push("m", {"w": torch.zeros(2, 2), "b": torch.zeros(2, dtype=torch.float64)})
        with pytest.raises(KeyError, match="unknown key 'bias'"):
            w.push("m", {"w": torch.zeros(2, 2), "bias": torch.zeros(2)})
        with pytest.raises(KeyError, match=r"push\('other'\) before init_model"):
            w.push("other", torch.zeros(1))
        with pytest.raises(ValueError, match="servers 0..1"):
            w.get(2, "m")
        with pytest.raises(ValueError, match="component of 5 elements, expected 3"):
            w.push(0, torch.zeros(5))
        with pytest.raises(ValueError, match="staleness -1"):
            w.pull("m", staleness=-1)
        # A layout that disagrees with the servers' is refused by them, as an answer.
        w.models.pop("m")
        with pytest.raises(PSRequestError, match=r"rank 0 \(server 0\).*refused.*differs"):
            w.init_model("m", {"w": torch.zeros(3)}, lr=0.1)
        messages.append(f"{time.monotonic() - started:.3f}")
        return messages

    results, _ = run_job(layout, PSConfig(timeout_s=10), worker)
    assert float(results[2][0]) < 1.0


# --- faults -------------------------------------------------------------------------------------


def test_server_lost_raises_peer_lost_naming_it_within_two_seconds() -> None:
    layout = PSLayout(servers=2, workers=2)
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=30, lost_worker_wait_s=5))
    servers = [threading.Thread(target=j.serve, daemon=True) for j in jobs[:2]]
    for t in servers:
        t.start()
    outcome: dict[int, tuple[BaseException | None, float]] = {}
    ready = threading.Barrier(3)

    def worker(job: PSJob) -> None:
        w = job.worker
        w.init_model("m", torch.zeros(4), lr=0.1)
        w.pull("m")
        w.push("m", torch.ones(4))
        w.clock()
        if w.index == 1:
            ready.wait()
            return  # never pushes iteration 1: worker 0's BSP pull waits
        ready.wait()
        started = time.monotonic()
        try:
            w.push("m", torch.ones(4))
            w.clock()
            w.pull("m")
            outcome[w.index] = (None, time.monotonic() - started)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome[w.index] = (exc, time.monotonic() - started)

    threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in jobs[2:]]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(0.3)
    jobs[1].comm.transport.fabric.kill(1)  # server 1 crashes
    jobs[1].server.stop()
    for t in threads:
        t.join(10)
    exc, elapsed = outcome[0]
    assert isinstance(exc, PeerLostError) and exc.peer == 1
    assert "rank 1 (server 1) was lost" in str(exc) and "rank 2 (worker 0)" in str(exc)
    assert elapsed < 2.0
    jobs[0].server.stop()
    for j in jobs:
        j.comm.close()


@pytest.mark.parametrize("consistency", ["ssp:1", "async"])
def test_lost_worker_ssp_and_async_go_on_at_once(consistency: str) -> None:
    layout = PSLayout(servers=1, workers=3)
    jobs = local_jobs(layout, PSConfig(consistency=consistency, timeout_s=20, lost_worker_wait_s=10))
    stats: dict[str, Any] = {}
    server = threading.Thread(target=lambda: stats.update(s=jobs[0].serve()), daemon=True)
    server.start()
    times: dict[int, float] = {}

    def worker(job: PSJob) -> None:
        w = job.worker
        w.init_model("m", torch.zeros(4), lr=0.1)
        steps = 1 if w.index == 2 else 6
        for _ in range(steps):
            w.pull_flat("m")
            w.push("m", torch.ones(4))
            w.clock()
        if w.index == 2:
            job.comm.transport.fabric.kill(job.rank)  # dies without leaving
            return
        started = time.monotonic()
        w.pull_flat("m")
        times[w.index] = time.monotonic() - started
        w.leave()

    threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in jobs[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    server.join(15)
    assert not server.is_alive() and max(times.values()) < 2.0
    assert stats["s"].lost_workers == [2] and sorted(stats["s"].departed_workers) == [0, 1]
    for j in jobs:
        j.comm.close()


def test_lost_worker_bsp_goes_on_after_the_wait_and_reports_the_missing_rounds() -> None:
    layout = PSLayout(servers=1, workers=2)
    wait = 0.6
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=10, lost_worker_wait_s=wait))
    stats: dict[str, Any] = {}
    server = threading.Thread(target=lambda: stats.update(s=jobs[0].serve()), daemon=True)
    server.start()
    waited: list[float] = []

    def worker(job: PSJob) -> None:
        w = job.worker
        w.init_model("m", torch.zeros(4), lr=0.1)
        w.pull_flat("m")
        if w.index == 1:
            job.comm.transport.fabric.kill(job.rank)
            return
        time.sleep(0.1)
        w.push("m", torch.ones(4))
        w.clock()
        started = time.monotonic()
        w.pull_flat("m")
        waited.append(time.monotonic() - started)
        w.leave()

    threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in jobs[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    server.join(10)
    assert wait * 0.7 <= waited[0] < wait + 1.5
    assert stats["s"].missing_rounds == [(0, (1,))] and stats["s"].updates_applied == 1
    for j in jobs:
        j.comm.close()


def test_a_worker_that_leaves_early_is_not_waited_for() -> None:
    layout = PSLayout(servers=1, workers=2)

    def worker(w: Any) -> float:
        w.init_model("m", torch.zeros(2), lr=0.1)
        if w.index == 1:
            w.leave()
            return 0.0
        started = time.monotonic()
        for _ in range(5):
            w.pull_flat("m")
            w.push("m", torch.ones(2))
            w.clock()
        w.pull_flat("m")
        return time.monotonic() - started

    results, _ = run_job(layout, PSConfig(consistency="bsp", timeout_s=10, lost_worker_wait_s=5), worker)
    # Worker 1 (rank 2) left first; worker 0 (rank 1) ran 5 BSP rounds alone, not held back.
    assert results[1] < 2.0 and results[0].departed_workers == [1, 0] and results[0].updates_applied == 5


def test_replica_registering_late_gets_the_model_and_its_momentum_history() -> None:
    layout = PSLayout(servers=1, replicas=1, workers=2)
    jobs = local_jobs(layout, PSConfig(consistency="bsp", timeout_s=10))
    halfway, registered = threading.Barrier(3), threading.Event()
    versions: dict[str, Any] = {}

    def worker(job: PSJob) -> None:
        w = job.worker
        w.init_model("m", torch.zeros(6), lr=0.1, momentum=0.9)
        for step in range(6):
            if step == 3:
                halfway.wait()  # the replica registers now, with 3 updates and a momentum history behind
                registered.wait(5)
            params = w.pull_flat("m")
            w.push("m", quadratic_gradient(params, w.index))
            w.clock()
        w.leave()

    def replica(job: PSJob) -> None:
        halfway.wait()
        job.replica.register_as_replica(0)
        time.sleep(0.2)  # the server takes the registration before the next round
        registered.set()
        versions.update(job.replica.serve())

    threads = [threading.Thread(target=jobs[0].serve, daemon=True), threading.Thread(target=replica, args=(jobs[1],))]
    threads += [threading.Thread(target=worker, args=(j,), daemon=True) for j in jobs[2:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert versions == {"m": 6}
    torch.testing.assert_close(jobs[1].replica.values["m"], jobs[0].server.shards["m"].values)
    with pytest.raises(RuntimeError, match="already replicates server 0"):
        jobs[1].replica.register_as_replica(0)
    for j in jobs:
        j.comm.close()


@pytest.mark.parametrize("consistency", ["async", "ssp:1"])
def test_a_replica_takes_over_a_lost_server_and_the_workers_go_on(consistency: str) -> None:
    layout = PSLayout(servers=1, replicas=1, workers=2)
    jobs = local_jobs(layout, PSConfig(consistency=consistency, timeout_s=10))
    results: dict[int, Any] = {}
    killed = threading.Event()
    both_at_step_4 = threading.Barrier(2)

    def serve(job: PSJob) -> None:
        results[job.rank] = job.serve()

    def work(job: PSJob) -> None:
        w = job.worker
        w.init_model("m", torch.zeros(8), lr=0.1, momentum=0.5)
        waits = []
        for step in range(12):
            if step == 4:
                both_at_step_4.wait(5)
                if w.index == 0:
                    # The server crashes mid-training: its loop stops first (a dead process does
                    # nothing more), then its transport vanishes without a goodbye.
                    jobs[0].server.stop()
                    server_thread.join(5)
                    job.comm.transport.fabric.kill(0)
                    killed.set()
                killed.wait(5)
            started = time.monotonic()
            params = w.pull_flat("m")
            waits.append(time.monotonic() - started)
            w.push("m", params - 1)
            w.clock()
        results[job.rank] = (w.failovers, max(waits), w.pull_flat("m"))
        w.leave()

    threads = [threading.Thread(target=serve, args=(j,), daemon=True) for j in jobs[:2]]
    server_thread = threads[0]
    threads += [threading.Thread(target=work, args=(j,), daemon=True) for j in jobs[2:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and killed.is_set()
    promoted = results[1]  # the replica's statistics as the server it became
    assert isinstance(promoted, ServerStats) and promoted.server == 0
    assert promoted.worker_updates == 16  # every update after the kill (none was in flight at the barrier)
    assert sorted(promoted.departed_workers) == [0, 1] and promoted.errors == []
    for rank in (2, 3):
        failovers, longest_wait, final = results[rank]
        assert failovers == 1 and longest_wait < 2.0
        assert torch.all(final > 0.5)  # the model kept moving toward 1 on the replica
    for j in jobs:
        j.comm.close()
