"""The CLI's allreduce benchmark, the local-rank launcher and the training workload.

    .venv/bin/python -m pytest tests/local/test_cli.py -q
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlfabric.bench.procs import LaunchConfig, RankFailedError, RankTimeoutError, run_ranks
from mlfabric.cli import app

pytestmark = pytest.mark.local


def test_bench_allreduce_writes_consistent_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "allreduce", "--world-size", "2", "--algorithms", "ring,gloo",
                                      "--sizes", "4KB,64KB", "--iters", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    meta = data["metadata"]
    assert meta["world_size"] == 2 and meta["transport"] == "tcp" and meta["cpu_count"] >= 1  # the default
    assert meta["torch"] and meta["hostname"] and meta["date"]
    assert meta["command"].startswith("mlfabric bench allreduce --world-size 2")
    # Aligned starts by default: every call starts at one instant and is timed from it.
    assert "--start aligned" in meta["command"] and meta["start"] == "aligned"
    assert isinstance(meta["late_starts"], int) and meta["late_starts"] >= 0
    cells = {(r["size_bytes"], r["algorithm"]): r for r in data["results"]}
    assert set(cells) == {(4000, "ring"), (4000, "gloo"), (64000, "ring"), (64000, "gloo")}
    n = 2
    for (size, algorithm), r in cells.items():
        assert r["correct"] is True
        assert r["nbytes"] == size and r["count"] == size // 4
        assert len(r["times_s"]) == 2 and all(t > 0 for t in r["times_s"])
        # Timed from the aligned instant, not before it: were the 0.1 s margin timed, every
        # call would take longer (a late rank may legitimately make one call slow).
        assert min(r["times_s"]) < 0.1
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["algbw"] == pytest.approx(size / r["median_s"], rel=1e-9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (n - 1) / n, rel=1e-9)
        gloo = cells[(size, "gloo")]
        assert r["busbw_vs_gloo"] == pytest.approx(r["busbw"] / gloo["busbw"], rel=1e-9)
    assert "busbw" in result.output  # the table was printed


@pytest.mark.parametrize("args, message", [
    (["--sizes", "4Kb"], "bits"),
    (["--algorithms", "ring,bogus"], "unknown algorithm"),
    (["--world-size", "1"], "world_size >= 2"),
    (["--transport", "carrier-pigeon"], "unknown transport"),
])
def test_bench_allreduce_rejects_bad_options(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "allreduce", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def _fail_on_rank_1() -> int:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    if rank == 1:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # waits for rank 1 forever: the launcher must kill it
    return rank


def test_procs_reports_the_failing_rank_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_fail_on_rank_1, config=LaunchConfig(world_size=2, timeout_s=60, grace_s=1.0))
    assert time.monotonic() - start < 30
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "deliberate failure on rank 1" in str(err)
    assert "_fail_on_rank_1" in err.traceback and "raise ValueError" in err.traceback
    assert "rank 1 of 2" in str(err)


def _env_and_sleep(seconds: float) -> dict[str, str]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    time.sleep(seconds)
    return {k: os.environ[k] for k in keys}


def test_procs_sets_torchrun_env_and_times_out() -> None:
    envs = run_ranks(_env_and_sleep, 3, args=(0.0,), timeout=60)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] == [e["LOCAL_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1
    with pytest.raises(RankTimeoutError) as info:
        run_ranks(_env_and_sleep, 2, args=(60.0,), timeout=3)
    assert info.value.pending == (0, 1)


def test_training_with_mlfabric_hook_reduces_loss() -> None:
    from mlfabric.train import TrainConfig, run_training

    steps_seen: list[int] = []
    result = run_training(TrainConfig(steps=60, algorithm="ring"), world_size=2,
                          on_step=lambda step, loss: steps_seen.append(step))
    assert len(result.losses) == 60 and all(t > 0 for t in result.step_times)
    assert result.final_loss < 0.8 * result.initial_loss
    assert result.accuracy > 0.3  # 10 classes: chance is about 0.1
    assert steps_seen[-1] == 60
    assert all(r.buckets_reduced >= 60 for r in result.per_rank)  # the hook carried the gradients
    # Only rank 0 evaluates the test set (the DDP replicas are identical): the job's figures are its.
    assert result.per_rank[0].accuracy == result.accuracy and result.per_rank[0].test_loss == result.test_loss
    assert result.per_rank[1].accuracy is None and result.per_rank[1].test_loss is None


def _wrong_on_rank_1() -> None:
    import torch
    import torch.distributed as dist

    from mlfabric.bench.allreduce import _verify

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    reference = torch.arange(10.0)
    result = reference.clone()
    if rank == 1:
        result[3] += 1
    _verify(result, reference, "ring", 40, rank)


def test_bench_verification_fails_loudly_on_every_rank() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_wrong_on_rank_1, 2, timeout=60)
    err = info.value
    assert err.exc_type == "BenchmarkError" and len(err.others) == 1  # both ranks raised
    assert "rank 1: 1 of 10 elements differ (first at index 3" in str(err)
