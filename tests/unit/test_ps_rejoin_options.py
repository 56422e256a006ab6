"""``mlfabric train`` with a PS mode and ``--fail worker:...`` / ``--rejoin`` / ``--elastic``:
the options it refuses (usage errors, exit 2, before anything starts), and how
:mod:`mlfabric.train.ps_rejoin` turns the servers' update times into recovery_s, stall_s,
rejoin_s and the membership.

    .venv/bin/python -m pytest tests/unit/test_ps_rejoin_options.py -q
"""

from __future__ import annotations

from typing import Any

import pytest

from mlfabric.train.ps_rejoin import kills_ps_workers

BASE = ["train", "--workload", "hyperplane", "--workers", "4", "--servers", "1", "--dim", "16",
        "--train-samples", "1024"]


@pytest.mark.parametrize(("args", "message"), [
    (["--sync", "ps-bsp", "--fail", "server:3", "--rejoin", "2"],
     "server:AT kills server 0 for its replica to take over"),
    (["--sync", "ps-bsp", "--fail", "worker:4@3", "--rejoin", "2"], "worker 4 is outside the job (workers 0-3)"),
    (["--sync", "ps-async", "--fail", "worker:-1@3"], "worker -1 is outside the job"),
    (["--sync", "ps-bsp", "--rejoin", "2"], "--rejoin restarts killed workers: give --fail worker:RANK@SECONDS"),
    (["--sync", "ps-bsp", "--fail", "worker:2@3", "--rejoin", "2", "--transport", "zmq"],
     "runs over the tcp transport"),
    (["--sync", "ps-bsp,ps-async", "--fail", "worker:2@3", "--rejoin", "2"], "give one --sync mode"),
    (["--sync", "allreduce,ps-bsp", "--fail", "worker:2@3"], "give one --sync mode"),
    (["--sync", "mlfabric-a:8", "--fail", "worker:2@3", "--rejoin", "2"], "direct and mlnet routing only"),
    (["--sync", "mlfabric-s", "--fail", "worker:2@3"], "direct and mlnet routing only"),
    (["--sync", "ps-bsp", "--fail", "worker:2@3", "--rejoin", "2", "--elastic"], "drop --elastic"),
    (["--sync", "ps-bsp", "--fail", "churn:5x2", "--rejoin", "1"], "churn:NxK is for --sync allreduce --elastic"),
    (["--sync", "ps-bsp", "--fail", "worker:1@3", "--replicas", "1"], "--replicas with --fail worker"),
    (["--sync", "ps-bsp", "--fail", "worker:1@3,worker:1@5"], "names one worker twice"),
    (["--sync", "ps-bsp", "--fail", "worker:1@3", "--rejoin", "-1"], "is negative"),
])
def test_bad_ps_kill_options_are_usage_errors(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from mlfabric.cli import app

    result = CliRunner().invoke(app, [*BASE, *args], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_one_worker_is_refused() -> None:
    from typer.testing import CliRunner

    from mlfabric.cli import app

    result = CliRunner().invoke(app, ["train", "--workload", "hyperplane", "--workers", "1", "--dim", "16",
                                      "--train-samples", "1024", "--sync", "ps-bsp", "--fail", "worker:0@1"],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "needs at least 2 workers" in " ".join(result.output.split())


def test_which_options_make_a_ps_kill_run() -> None:
    assert kills_ps_workers("ps-bsp", "worker:1@2", None, False)
    assert kills_ps_workers("ps-async", None, "2", False)
    assert kills_ps_workers("ps-ssp:2", None, None, True)
    assert not kills_ps_workers("ps-bsp", "server:3", None, False)  # the replica failover (harness)
    assert not kills_ps_workers("allreduce", "worker:1@2", "2", True)  # the elastic allreduce run
    assert not kills_ps_workers(None, None, "2", False)


# -- the figures from the servers' records --------------------------------------------------------


def _launch(updates: list[list[Any]], lost: list[tuple[float, int]], killed: list[tuple[int, float]],
            restarted: list[tuple[int, float]], joiner_ready: float) -> Any:
    from mlfabric.train.ps_rejoin import _Launch

    stats = {"rejoined_workers": [w for w, _ in restarted], "lost_workers": [w for w, _ in killed],
             "delays": {"0": len(updates)}, "clock_lag": {}, "updates_applied": len(updates), "dropped": 0,
             "bytes_in": 0, "bytes_out": 0, "missing_rounds": []}
    server = {"role": "server", "rank": 0, "stats": stats, "updates": updates, "lost": lost}
    workers = [{"role": "worker", "worker": w, "incarnation": 0, "started": 0.0, "ready": 1.0, "steps": 10,
                "ps_worker": {}} for w in (0, 2)]
    workers += [{"role": "worker", "worker": w, "incarnation": 1, "started": t, "ready": joiner_ready, "steps": 4,
                 "ps_worker": {}} for w, t in restarted]
    return _Launch(outputs=[server, *workers], finals=[], killed=killed, restarted=restarted, late=[], t0=100.0,
                   wall_s=10.0)


def test_recovery_stall_and_rejoin_come_from_the_update_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """BSP, 3 workers, worker 1 killed at 101.0: its last round (with it) closed at 101.05
    (pushed before the kill), the first without it at 102.0, each survivor in it; the restart at
    101.5 is ready at 102.5 and its first update is applied at 103.0."""
    import mlfabric.train.ps_rejoin as ps_rejoin
    from mlfabric.train.failover import WorkerFailure
    from mlfabric.train.harness import EagerTrainConfig
    from mlfabric.train.workloads import HyperplaneSpec

    monkeypatch.setattr(ps_rejoin, "_evaluate", lambda config, finals: 4.2)
    train = EagerTrainConfig(workload="hyperplane", workers=3, modes=("ps-bsp",),
                             hyperplane=HyperplaneSpec(dim=8, train_samples=1024))
    config = ps_rejoin.PSRejoinConfig(train=train, failures=(WorkerFailure(rank=1, at_s=1.0),), rejoin_s=0.5,
                                      baseline=False)
    updates = [[100.9, [0, 1, 2]], [101.05, [0, 1, 2]], [102.0, [0, 2]], [102.5, [0, 2]], [103.0, [0, 1, 2]]]
    launch = _launch(updates, lost=[(101.5, 1)], killed=[(1, 101.0)], restarted=[(1, 101.5)], joiner_ready=102.5)
    result = ps_rejoin._summarize(config, launch)
    assert result.recovery_s == [1.0]  # 101.0 -> 102.0: the first round without worker 1
    assert result.detection_s == [0.5]
    assert result.stall_s == [0.95]  # 101.05 -> 102.0, after the loss (101.5) and the BSP wait (0.5 s)
    assert result.rejoin_s == [1.5] and result.rejoin_startup_s == [1.0]
    assert [m["members"] for m in result.members] == [[0, 1, 2], [0, 2], [0, 1, 2]]
    assert [m["at_s"] for m in result.members] == [0.0, 1.0, 3.0]
    assert result.rejoined_workers == [1] and result.final_members == [0, 1, 2]
    assert result.worker_steps == {"0": 10, "1.1": 4, "2": 10}
    # A restart whose worker never had an update applied (the job ended first) was too late.
    late = _launch(updates[:4], lost=[(101.5, 1)], killed=[(1, 101.0)], restarted=[(1, 101.5)], joiner_ready=102.5)
    result = ps_rejoin._summarize(config, late)
    assert result.rejoin_s == [] and result.rejoined_too_late == [1]
    assert [m["members"] for m in result.members] == [[0, 1, 2], [0, 2]]


def test_a_worker_killed_twice_has_a_recovery_and_a_rejoin_for_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: worker 1 killed at 101.0, restarted at 101.5, killed again at 105.0 and
    restarted at 105.5. The second kill's survivors are workers 0 and 2 (worker 1 itself was
    counted among them: its recovery was None), and each restart is matched with its own process."""
    import mlfabric.train.ps_rejoin as ps_rejoin
    from mlfabric.train.failover import WorkerFailure
    from mlfabric.train.harness import EagerTrainConfig
    from mlfabric.train.workloads import HyperplaneSpec

    monkeypatch.setattr(ps_rejoin, "_evaluate", lambda config, finals: 4.2)
    train = EagerTrainConfig(workload="hyperplane", workers=3, modes=("ps-bsp",),
                             hyperplane=HyperplaneSpec(dim=8, train_samples=1024))
    config = ps_rejoin.PSRejoinConfig(train=train, failures=(WorkerFailure(rank=1, at_s=1.0),
                                                             WorkerFailure(rank=1, at_s=5.0)),
                                      rejoin_s=0.5, baseline=False)
    updates = [[100.9, [0, 1, 2]], [102.0, [0, 2]], [103.0, [0, 1, 2]], [104.9, [0, 1, 2]], [106.0, [0, 2]],
               [107.5, [0, 1, 2]]]
    launch = _launch(updates, lost=[(101.5, 1), (105.5, 1)], killed=[(1, 101.0), (1, 105.0)],
                     restarted=[(1, 101.5), (1, 105.5)], joiner_ready=0.0)
    for out, ready in zip([o for o in launch.outputs if o.get("incarnation") == 1], (102.5, 106.5)):
        out["ready"] = ready
    launch.outputs[-1]["incarnation"] = 2
    result = ps_rejoin._summarize(config, launch)
    assert result.recovery_s == [1.0, 1.0]
    assert result.rejoin_s == [1.5, 2.0] and result.rejoin_startup_s == [1.0, 1.0]
    assert [m["members"] for m in result.members] == [[0, 1, 2], [0, 2], [0, 1, 2], [0, 2], [0, 1, 2]]
