"""``mlfabric train --sync ps-bsp|ps-ssp:S|ps-async --fail worker:RANK@SECONDS [--rejoin AFTER_S]``:
a parameter-server worker SIGKILLed mid-training and started again as a new process (issue #38).

    mlfabric train --workload hyperplane --workers 4 --servers 1 --sync ps-bsp --fail worker:2@3 --rejoin 2 --json -
    .venv/bin/python -m pytest tests/local/test_ps_rejoin_train.py tests/unit/test_ps_rejoin_options.py -q

The parent starts the servers and workers as processes on loopback with the torchrun
environment (``MLFABRIC_PS_SERVERS``; server 0, rank 0, serves the rendezvous store and is
never killed), one PS job (:func:`mlfabric.ps.init`, session 0: a restarted process rejoins
the job's first session, so the run has no per-run sessions -- which is why this is not a run
of :mod:`mlfabric.train.harness`'s PS launch). Each worker trains with
:class:`mlfabric.torch.PSOptimizer` in the harness's loop (:func:`mlfabric.train.harness.train_steps`),
each server serves with :func:`mlfabric.train.ps_modes.serve_run`. Once every worker has
started its loop (time 0: the latest of their loop starts), ``--fail worker:RANK@SECONDS``
SIGKILLs worker RANK's process (RANK: the worker's index, 0..workers-1; its launch rank is
servers + RANK) SECONDS later -- no goodbye, a crash -- and with ``--rejoin AFTER_S`` starts a
new process for the same rank AFTER_S after the kill, with ``MLFABRIC_INCARNATION=k`` (its
k-th restart). It rejoins the running job (:meth:`mlfabric.ps.PSWorker.rejoin`: the servers
take it back at the clock :meth:`ClockBook.rejoin` gives it), goes on from that global step
(BSP, SSP; async: from the epoch the servers' version is in) and trains to the end. Without
``--rejoin`` the killed worker stays out and the others finish without it.

BSP waits :data:`LOST_WORKER_WAIT_S` for a lost worker before its rounds close without it (the
launch's ``lost_worker_wait_s``): the floor of ``recovery_s`` under BSP. Every server records
the wall-clock time and workers of each update it applies (:class:`UpdateTimes`), from which
the parent computes, per kill and per restart:

* ``recovery_s`` (one per kill): from the SIGKILL to the moment every surviving worker has had
  an update applied, after the kill, that holds its gradient and not the killed worker's --
  on every server (the latest of them). Under BSP that is the first round closed without the
  killed worker (the survivors' next committed step); under SSP and async each survivor's
  next applied update (short unless a survivor is held at the staleness bound until the
  servers give the lost worker up). None if some survivor had none (the run ended first).
  ``detection_s`` (one per kill): the kill until every server's transport had reported the
  worker lost (the transport's goodbye grace, 0.5 s, after the link closed). ``stall_s`` (one
  per kill): the longest time server 0 applied no update, from its last update before the kill
  to its first after it gave the worker up (detection, plus the lost-worker wait under BSP) --
  the time training stood still: under BSP about ``recovery_s``; under SSP the time the
  survivors were held at the staleness bound, which ``recovery_s`` (their next update, often
  before the bound is reached) does not show; under async about one step.
* ``rejoin_s`` (one per restart): from the restarted process's start (``Popen``) to the first
  update holding its gradient that every server has applied; ``rejoin_startup_s`` is the part
  of it before the process asked to rejoin (Python, torch, the data, the model and its
  optimizer), as in elastic runs; the rest is the join (store, connections, the servers'
  consent, the model's layout check and pull) and one step.
* ``members``: the workers counted after each change (start, each kill, each rejoin);
  ``rejoined_workers``, ``lost_workers``: server 0's (one entry per rejoin / loss);
  ``final_members``: the workers whose process trained to the end; ``rejoined_too_late``:
  restarts that came after the job had ended, or had no update of theirs applied.
* ``final_metric``: the validation metric of the servers' final model; with the fault-free
  comparison (on by default: the same launch without the kill, first) ``baseline_final_metric``
  and ``metric_ratio`` (the run's over the fault-free one's) beside it.

The field names are those of the elastic allreduce runs (:mod:`mlfabric.train.elastic`) where
the meaning is the same. Only the PS modes whose routing takes a worker back run this way
(``ps-bsp``, ``ps-ssp:S``, ``ps-async``, and MLNET's ``mlnet-binary|rack|tree:D[+ssp:S]``,
whose restarted node re-enters the trees as a leaf; one per command), over the tcp transport, without
replicas, the emulator or ``--elastic`` (usage errors: ``--elastic`` is the allreduce runs'
membership, a PS mode takes a worker back without it).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .failover import PS_WORKER_FAIL_FORM, WorkerFailure, check_worker_failures, parse_fail, still_running

if TYPE_CHECKING:
    from mlfabric.ps.server import ParameterServer

    from .harness import EagerTrainConfig

__all__ = ["LOST_WORKER_WAIT_S", "PSRejoinConfig", "PSRejoinError", "PSRejoinResult", "UpdateTimes",
           "kills_ps_workers", "run_ps_rejoin", "summary_line"]

#: The PS modes whose workers can be killed and taken back (direct routing, and MLNET's trees,
#: which a restarted worker re-enters as a leaf).
MODES_FORM = "ps-bsp, ps-ssp:S, ps-async or mlnet-binary|rack|tree:D[+ssp:S]"
#: How long BSP waits for a lost worker before its rounds close without it (seconds).
LOST_WORKER_WAIT_S = 0.5
#: A rank's settings (the pickled config, its output file) as JSON, in the rank's environment.
_ARGS_ENV = "MLFABRIC_PS_REJOIN_ARGS"


class PSRejoinError(RuntimeError):
    """A rank failed by itself, a kill could not be carried out, or the run timed out."""


def kills_ps_workers(sync: str | None, fail: str | None, rejoin: str | None, elastic: bool) -> bool:
    """Whether ``mlfabric train``'s options ask for this kind of run: a parameter-server mode
    in ``--sync`` with ``--fail worker:...`` (or churn), ``--rejoin`` or ``--elastic`` (the
    last two refused here with a clear message when they do not fit)."""
    from .ps_modes import is_ps_mode

    modes = [m.strip() for m in (sync or "").split(",") if m.strip()]
    if not any(is_ps_mode(m) for m in modes):
        return False
    role = (fail or "").strip().partition(":")[0]
    return elastic or rejoin is not None or role in ("worker", "churn")


@dataclass(frozen=True, kw_only=True)
class PSRejoinConfig:
    """The run: ``train`` (one PS mode, one injection; every other setting as ``mlfabric
    train`` has it), the workers to kill, ``rejoin_s`` (None: not restarted), the fault-free
    comparison."""

    train: EagerTrainConfig
    failures: tuple[WorkerFailure, ...]
    rejoin_s: float | None = None
    baseline: bool = True
    lost_worker_wait_s: float = LOST_WORKER_WAIT_S

    def __post_init__(self) -> None:
        from .ps_modes import MLNET, POLICY_SEP, PREFIX, is_ps_mode

        train = self.train
        check_worker_failures(self.failures, train.workers, self.rejoin_s)
        if not self.failures:
            raise ValueError(f"a PS run with killed workers needs --fail {PS_WORKER_FAIL_FORM}")
        ps = [m for m in train.modes if is_ps_mode(m)]
        if len(train.modes) != 1 or len(ps) != 1:
            raise ValueError(f"--fail worker:... kills a process of one parameter-server run: give one --sync mode "
                             f"of {MODES_FORM} (got {','.join(train.modes)}); run others as their own commands")
        mode = ps[0]
        if not (mode.startswith(PREFIX) or mode.startswith(MLNET)) or POLICY_SEP in mode:
            raise ValueError(f"--fail worker:... under {mode}: a restarted worker is taken back under direct "
                             f"and mlnet routing only, i.e. {MODES_FORM} (the scheduler's policies refuse it)")
        if len(train.injects) != 1:
            raise ValueError(f"--fail worker:... runs one injection, got {len(train.injects)}")
        if train.workers < 2:
            raise ValueError(f"--fail worker:... needs at least 2 workers (got {train.workers}): with one, the "
                             "servers end when it is lost")
        if train.transport != "tcp":
            raise ValueError(f"--fail worker:... runs over the tcp transport (a restarted worker reconnects to the "
                             f"servers over TCP), not {train.transport}")
        refused = {"--replicas": train.replicas, "--emulate": train.emulation is not None,
                   "--workers-per-host": train.workers_per_host > 1, "--checkpoint-every": train.checkpoint_every,
                   "--trees": train.trees}
        for option, given in refused.items():
            if given:
                raise ValueError(f"{option} with --fail worker:... is not supported yet: leave it out")
        if train.workload != "hyperplane":
            raise ValueError(f"--fail worker:... in a PS mode runs the hyperplane workload so far, not "
                             f"{train.workload}")
        if self.lost_worker_wait_s < 0:
            raise ValueError("lost_worker_wait_s must be >= 0 seconds")

    @property
    def mode(self) -> str:
        return self.train.modes[0]


@dataclass(kw_only=True)
class PSRejoinResult:
    config: PSRejoinConfig
    wall_s: float
    steps: int
    metric: str
    final_metric: float
    recovery_s: list[float | None]
    detection_s: list[float | None]           # per kill: until every server's transport reported it lost
    stall_s: list[float | None]               # per kill: the longest time without an update on server 0
    rejoin_s: list[float]
    rejoin_startup_s: list[float]
    members: list[dict[str, Any]]
    rejoined_workers: list[int]
    lost_workers: list[int]
    final_members: list[int]
    rejoined_too_late: list[int]
    events: list[dict[str, Any]]
    ps: dict[str, Any]                        # ps_modes.summarize's figures of the run
    worker_steps: dict[str, int]              # per worker process ("2" or "2.1": its restart): its steps
    baseline_final_metric: float | None = None
    baseline_wall_s: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def metric_ratio(self) -> float | None:
        if self.baseline_final_metric is None or not self.baseline_final_metric:
            return None
        return self.final_metric / self.baseline_final_metric

    def to_dict(self) -> dict[str, Any]:
        train = self.config.train
        config = {"workload": train.workload, "workers": train.workers, "servers": train.servers,
                  "epochs": train.epochs_, "batch_size": train.batch_size_, "lr": train.lr_,
                  "momentum": train.momentum_, "dim": train.hyperplane.dim,
                  "train_samples": train.train_samples, "compute_time_s": train.hyperplane.compute_time_s,
                  "delay_bound": train.delay_bound, "inject": train.injects[0], "seed": train.seed,
                  "failures": [{"rank": f.rank, "at_s": f.at_s} for f in self.config.failures],
                  "rejoin_s": self.config.rejoin_s, "lost_worker_wait_s": self.config.lost_worker_wait_s}
        return {**self.ps, "mode": self.config.mode, "elastic": False, "config": config, "wall_s": self.wall_s,
                "steps": self.steps, "metric": self.metric, "final_metric": self.final_metric,
                "recovery_s": self.recovery_s, "detection_s": self.detection_s,
                "stall_s": self.stall_s, "rejoin_s": self.rejoin_s,
                "rejoin_startup_s": self.rejoin_startup_s,
                "members": self.members, "rejoined_workers": self.rejoined_workers,
                "lost_workers": self.lost_workers, "final_members": self.final_members,
                "rejoined_too_late": self.rejoined_too_late, "events": self.events,
                "worker_steps": self.worker_steps, "baseline_final_metric": self.baseline_final_metric,
                "baseline_wall_s": self.baseline_wall_s, "metric_ratio": self.metric_ratio,
                "metadata": self.metadata}


# -- the servers' record ---------------------------------------------------------------------


class UpdateTimes:
    """Every update a server applies: (wall-clock time, the workers whose gradients it holds),
    from the server's :attr:`ParameterServer.on_apply` hook; and when its transport reported
    each worker lost."""

    def __init__(self, server: ParameterServer) -> None:
        self.entries: list[tuple[float, tuple[int, ...]]] = []
        #: (wall-clock time, worker) of each worker the transport reported lost.
        self.lost: list[tuple[float, int]] = []
        layout = server.layout
        server.transport.on_peer_lost(lambda peer, reason: self.lost.append((time.time(), layout.worker_index(peer)))
                                      if layout.role(peer) == "worker" else None)
        server.on_apply = lambda info: self.entries.append((time.time(), tuple(info.workers)))


# -- a rank ------------------------------------------------------------------------------------


def _rank(args: dict[str, Any]) -> None:
    """One rank (``python -m mlfabric.train.ps_rejoin``): a server serves and writes its
    statistics, update times and shard of the final model; a worker (incarnation 0, or a
    restarted one rejoining) trains to the end and writes what it did."""
    started = time.time()
    import torch

    import mlfabric.ps
    from mlfabric.ps.job import incarnation_from_env
    from mlfabric.torch import PSOptimizer

    from .harness import train_steps
    from .ps_modes import MLNET, mlnet_options, ps_consistency, serve_run

    with open(args["config"], "rb") as f:
        config: PSRejoinConfig = pickle.load(f)
    train = config.train
    out = Path(args["out"])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    incarnation = incarnation_from_env()
    task = train.task()
    worker = rank - train.servers
    x, y = task.shard(worker, train.workers) if worker >= 0 else (None, None)
    torch.manual_seed(train.seed)  # the same initial model on every rank
    model = task.model()
    # Built before the join: torch's first optimizer imports more of torch (~0.9 s here). Workers
    # only: a server has no use for one (it cost each server that import for nothing).
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr_, momentum=train.momentum_) if worker >= 0 else None
    ready = time.time()  # imports, data and model done: what follows is the join
    routing = mlnet_options(config.mode) if config.mode.startswith(MLNET) else \
        {"consistency": ps_consistency(config.mode, train.delay_bound)}
    job = mlfabric.ps.init(servers=train.servers, replicas=0, **routing,
                           transport="tcp", timeout=min(train.timeout_s, 120.0), seed=train.seed,
                           lost_worker_wait_s=config.lost_worker_wait_s)
    joined = time.time()  # taken back (a restarted worker) or in the job
    if job.server is not None:
        times = UpdateTimes(job.server)
        try:
            stats, final = serve_run(job, sum(p.numel() for p in model.parameters()), torch.float32)
        finally:
            job.comm.close()
        torch.save(final, out.with_suffix(".pt"))
        out.write_text(json.dumps({"role": "server", "rank": rank, "stats": stats,
                                   "updates": [[t, list(w)] for t, w in times.entries],
                                   "lost": times.lost}))
        return
    try:
        assert optimizer is not None  # a worker's (built above)
        trainer = PSOptimizer(optimizer, model, job.worker)
        first_step = int(job.worker.stats.rejoined_at_clock or 0) if incarnation else 0
        if not incarnation:
            job.comm.barrier()  # serve_run's: the servers answer before anyone's clock starts
        loop_start = time.time()
        Path(f"{out}.start").write_text(str(loop_start))
        loop = train_steps(train, task, model, trainer, x, y, worker=worker, inject=train.injects[0],
                           first_step=first_step)
        ps_worker = {**trainer.stats.as_dict(), "failovers": trainer.worker.failovers}
    finally:
        job.close()
    out.write_text(json.dumps({"role": "worker", "worker": worker, "incarnation": incarnation, "started": started,
                               "ready": ready, "joined": joined, "loop_start": loop_start, "first_step": first_step,
                               "steps": loop.steps, "loop_s": loop.loop_s,
                               "ps_worker": ps_worker}))


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="One rank of a PS run with killed workers (started by mlfabric "
                                                 "train --sync ps-... --fail worker:...).")
    parser.add_argument("args", help="the rank's settings as JSON: config (a pickled PSRejoinConfig's path), out")
    _rank(json.loads(parser.parse_args(argv).args))


# -- the parent --------------------------------------------------------------------------------


@dataclass
class _Launch:
    outputs: list[dict[str, Any]]
    finals: list[Any]
    killed: list[tuple[int, float]]
    restarted: list[tuple[int, float]]
    late: list[int]
    t0: float
    wall_s: float


def run_ps_rejoin(config: PSRejoinConfig, *, log_dir: Path | None = None) -> PSRejoinResult:
    """The fault-free launch (``config.baseline``), then the one with the kills and restarts
    (see the module); raises :class:`PSRejoinError` naming the rank and showing its log when
    one fails by itself, or when the run exceeds the config's timeout."""
    import platform
    import socket

    import shutil

    load = os.getloadavg()
    work = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="mlfabric-ps-rejoin-"))
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "config.pkl"
    config_path.write_bytes(pickle.dumps(config))
    try:
        baseline = _launch(config, config_path, work / "baseline", failures=()) if config.baseline else None
        launch = _launch(config, config_path, work / "run", failures=config.failures)
    except PSRejoinError as exc:
        # The logs the message names stay for the reader (a temporary directory included).
        raise PSRejoinError(f"{exc}\n(the ranks' logs and outputs are kept in {work})") from None
    if log_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    result = _summarize(config, launch)
    if baseline is not None:
        result.baseline_final_metric = _evaluate(config, baseline.finals)
        result.baseline_wall_s = round(baseline.wall_s, 3)
    result.metadata = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hostname": socket.gethostname(),
                       "platform": platform.platform(), "cpu_count": os.cpu_count(),
                       "loadavg_at_start": [round(v, 2) for v in load]}
    return result


def _launch(config: PSRejoinConfig, config_path: Path, work: Path, *,
            failures: tuple[WorkerFailure, ...]) -> _Launch:
    from mlfabric.bench.procs import free_port, stop_processes
    from mlfabric.ps.job import INCARNATION_ENV
    from mlfabric.ps.layout import REPLICAS_ENV, SERVERS_ENV

    import shutil

    train = config.train
    shutil.rmtree(work, ignore_errors=True)  # an earlier run's files (its loop starts) would mislead this one
    work.mkdir(parents=True)
    world = train.servers + train.workers
    port = free_port()
    procs: dict[int, subprocess.Popen] = {}
    logs: dict[int, Path] = {}
    outs: list[Path] = []
    incarnations: dict[int, int] = {}

    def start(rank: int) -> None:
        incarnations[rank] = incarnations.get(rank, -1) + 1
        name = f"rank{rank}-{incarnations[rank]}"
        logs[rank] = work / f"{name}.log"
        outs.append(work / f"{name}.json")
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               # one intra-op thread: the ranks share the host's cores
               "OMP_NUM_THREADS": "1", SERVERS_ENV: str(train.servers), REPLICAS_ENV: "0",
               INCARNATION_ENV: str(incarnations[rank])}
        args = json.dumps({"config": str(config_path), "out": str(outs[-1])})
        with open(logs[rank], "w") as log_file:
            procs[rank] = subprocess.Popen([sys.executable, "-m", "mlfabric.train.ps_rejoin", args],
                                           stdout=log_file, stderr=subprocess.STDOUT, env=env)

    deadline = time.monotonic() + train.timeout_s
    killed: list[tuple[int, float]] = []
    restarted: list[tuple[int, float]] = []
    late: list[int] = []
    dead: set[int] = set()  # killed and not (yet) restarted
    servers = range(train.servers)

    def check() -> bool:
        """Raise naming a rank that failed by itself (or the timeout); True once every
        process not killed has ended. A restarted worker that fails after the servers have
        ended was too late (the job was over): recorded in ``late``, not an error."""
        over = all(procs[s].poll() == 0 for s in servers)
        for rank, proc in procs.items():
            code = proc.poll()
            if code in (None, 0) or rank in dead:
                continue
            if incarnations[rank] > 0 and over:
                if rank - train.servers not in late:
                    late.append(rank - train.servers)
                continue
            tail = logs[rank].read_text()[-3000:]
            raise PSRejoinError(f"rank {rank} ({'server' if rank in servers else f'worker {rank - train.servers}'}) "
                                f"failed (exit status {code}; log {logs[rank]}); the end of its log:\n{tail}")
        if time.monotonic() > deadline:
            raise PSRejoinError(f"the run did not finish within its timeout ({train.timeout_s:g} s, --timeout); "
                                f"{still_running(procs, logs)}")
        return all(p.poll() is not None for r, p in procs.items() if r not in dead)

    try:
        for rank in range(world):
            start(rank)
        starts = [work / f"rank{train.servers + w}-0.json.start" for w in range(train.workers)]
        while not all(p.exists() for p in starts):
            check()
            time.sleep(0.01)
        t0 = max(float(p.read_text()) for p in starts)
        pending = [(t0 + f.at_s, "kill", train.servers + f.rank) for f in failures]
        while True:
            now = time.time()
            for event in sorted(pending):
                at, what, rank = event
                if at > now:
                    break
                pending.remove(event)
                if what == "kill":
                    if procs[rank].poll() is not None:
                        raise PSRejoinError(f"worker {rank - train.servers} (rank {rank}) had already ended when "
                                            f"--fail was due ({at - t0:.1f} s into the run): the run was shorter; "
                                            "raise --epochs or --compute-time")
                    procs[rank].send_signal(signal.SIGKILL)
                    procs[rank].wait(10)
                    killed.append((rank - train.servers, time.time()))
                    dead.add(rank)
                    if config.rejoin_s is not None:
                        pending.append((time.time() + config.rejoin_s, "rejoin", rank))
                elif all(procs[s].poll() is not None for s in servers):
                    late.append(rank - train.servers)  # the job is over: nothing to rejoin
                else:
                    dead.discard(rank)
                    start(rank)
                    restarted.append((rank - train.servers, time.time()))
            if all(procs[s].poll() is not None for s in servers):
                # The job is over: a restart still due has nothing to rejoin.
                late += [rank - train.servers for _, what, rank in pending if what == "rejoin"]
                pending = [event for event in pending if event[1] != "rejoin"]
            if check() and not pending:
                break
            time.sleep(0.01)
        wall_s = time.time() - t0
    finally:
        stop_processes(procs.values())
    import torch

    outputs = [json.loads(p.read_text()) for p in outs if p.exists()]
    finals = [torch.load(p.with_suffix(".pt")) for p in outs if p.with_suffix(".pt").exists()]
    return _Launch(outputs=outputs, finals=finals, killed=killed, restarted=restarted, late=late, t0=t0,
                   wall_s=wall_s)


def _evaluate(config: PSRejoinConfig, finals: list[Any]) -> float:
    """The validation metric of the servers' final model (the sum of their shards)."""
    import torch

    if not finals:
        raise PSRejoinError("no server wrote its final model (see the ranks' logs)")
    task = config.train.task()
    torch.manual_seed(config.train.seed)
    model = task.model()
    torch.nn.utils.vector_to_parameters(sum(finals), model.parameters())
    return float(task.evaluate(model, *task.val())[1])


def _first(updates: Sequence[Sequence[Any]], after: float, holds: int, without: int | None = None) -> float | None:
    """The time of the first update applied after ``after`` that holds worker ``holds``'s
    gradient (and not ``without``'s)."""
    return next((t for t, workers in updates
                 if t > after and holds in workers and (without is None or without not in workers)), None)


def _stall(updates: Sequence[Sequence[Any]], t_kill: float, given_up: float | None) -> float | None:
    """The longest time without an update applied (on one server) from the last update
    before ``t_kill`` to the first after ``given_up`` (when the servers stopped waiting for
    the killed worker); None when either end is missing."""
    times = sorted(t for t, _ in updates)
    before = [t for t in times if t <= t_kill]
    after = [t for t in times if given_up is not None and t > given_up]
    if not before or not after:
        return None
    span = [before[-1], *(t for t in times if before[-1] < t < after[0]), after[0]]
    return round(max(b - a for a, b in zip(span, span[1:])), 4)


def _down_at(killed: Sequence[tuple[int, float]], restarted: Sequence[tuple[int, float]], t: float) -> set[int]:
    """The workers whose last kill or restart up to ``t`` was a kill (one worker may be killed,
    restarted and killed again)."""
    events = sorted([(at, 1, w) for w, at in killed if at <= t] + [(at, 0, w) for w, at in restarted if at <= t])
    down: set[int] = set()
    for _, is_kill, w in events:
        if is_kill:
            down.add(w)
        else:
            down.discard(w)
    return down


def _latest(times: Sequence[float | None]) -> float | None:
    return None if not times or any(t is None for t in times) else max(t for t in times if t is not None)


def _summarize(config: PSRejoinConfig, launch: _Launch) -> PSRejoinResult:
    from .ps_modes import summarize

    train = config.train
    servers = sorted((o for o in launch.outputs if o["role"] == "server"), key=lambda o: o["rank"])
    workers = [o for o in launch.outputs if o["role"] == "worker"]
    if len(servers) != train.servers:
        raise PSRejoinError(f"{len(servers)} of {train.servers} servers reported (see the ranks' logs)")
    updates = [s["updates"] for s in servers]
    # Which workers are counted when: a kill takes one out, its restart's first update puts it back.
    changes: list[tuple[float, str, int]] = [(t, "killed", w) for w, t in launch.killed]
    recovery: list[float | None] = []
    detection: list[float | None] = []
    stall: list[float | None] = []
    bsp = config.mode == "ps-bsp"
    for w, t_kill in launch.killed:
        seen = [next((t for t, v in s.get("lost", ()) if v == w and t >= t_kill - 0.05), None) for s in servers]
        detected = _latest(seen)
        detection.append(None if detected is None else round(max(0.0, detected - t_kill), 4))
        down = _down_at(launch.killed, launch.restarted, t_kill)  # w among them
        survivors = [v for v in range(train.workers) if v not in down]
        per_survivor = [_latest([_first(u, t_kill, v, without=w) for u in updates]) for v in survivors]
        done = _latest(per_survivor)
        recovery.append(None if done is None else round(done - t_kill, 4))
        given_up = None if detected is None else detected + (config.lost_worker_wait_s if bsp else 0.0)
        stall.append(_stall(updates[0], t_kill, given_up))
    rejoin: list[float] = []
    startup: list[float] = []
    too_late = list(launch.late)
    for k, (w, t_start) in enumerate(launch.restarted):
        back = _latest([_first(u, t_start, w) for u in updates])
        joiner = min((o for o in workers if o["worker"] == w and o["incarnation"] >= 1
                      and o["started"] >= t_start - 1), key=lambda o: o["started"], default=None)
        if back is None or joiner is None:
            too_late.append(w)  # it had no step left, or the job ended during its rejoin
            continue
        rejoin.append(round(back - t_start, 4))
        startup.append(round(joiner["ready"] - t_start, 4))
        changes.append((back, "rejoined", w))
    members = [{"at_s": 0.0, "members": list(range(train.workers)), "reason": "start"}]
    counted = set(range(train.workers))
    for t, what, w in sorted(changes):
        if what == "killed":
            counted.discard(w)
        else:
            counted.add(w)
        members.append({"at_s": round(t - launch.t0, 3), "members": sorted(counted), "reason": f"worker {w} {what}"})
    finished = sorted({o["worker"] for o in workers})
    summary = summarize([s["stats"] for s in servers], [o["ps_worker"] for o in workers])
    events = ([{"event": "kill", "worker": w, "at_s": round(t - launch.t0, 3)} for w, t in launch.killed]
              + [{"event": "restart", "worker": w, "at_s": round(t - launch.t0, 3)} for w, t in launch.restarted])
    return PSRejoinResult(
        config=config, wall_s=round(launch.wall_s, 3), steps=train.steps, metric=train.metric,
        final_metric=_evaluate(config, launch.finals), recovery_s=recovery, detection_s=detection,
        stall_s=stall, rejoin_s=rejoin,
        rejoin_startup_s=startup, members=members, rejoined_workers=list(servers[0]["stats"]["rejoined_workers"]),
        lost_workers=list(servers[0]["stats"]["lost_workers"]), final_members=finished,
        rejoined_too_late=sorted(set(too_late)), events=sorted(events, key=lambda e: e["at_s"]), ps=summary,
        worker_steps={(f"{o['worker']}.{o['incarnation']}" if o["incarnation"] else str(o["worker"])): o["steps"]
                      for o in sorted(workers, key=lambda o: (o["worker"], o["incarnation"]))})


def summary_line(result: PSRejoinResult) -> str:
    def figures(values: Sequence[float | None]) -> str:
        known = [v for v in values if v is not None]
        if not known:
            return "none" if not values else "not recorded"
        return (f"{', '.join('?' if v is None else f'{v:.2f}' for v in values)} s "
                f"(median {statistics.median(known):.2f})")

    train = result.config.train
    baseline = ("" if result.baseline_final_metric is None else
                f" (fault-free {result.baseline_final_metric:.4f}, ratio {result.metric_ratio:.3f})")
    late = f"; restarted after the job's end: {result.rejoined_too_late}" if result.rejoined_too_late else ""
    return (f"{result.config.mode} on {train.workers} workers, {train.servers} server(s): {result.steps} steps in "
            f"{result.wall_s:.1f} s; recovery {figures(result.recovery_s)}; rejoin {figures(result.rejoin_s)}; "
            f"rejoined {result.rejoined_workers}; final {result.metric} {result.final_metric:.4f}{baseline}; "
            f"workers at the end {result.final_members}{late}")


# -- the command line --------------------------------------------------------------------------


def run_from_cli(train: EagerTrainConfig, *, fail: str | None, rejoin: str | None, elastic: bool,
                 json_path: Path | None) -> None:
    """``mlfabric train --sync ps-... --fail worker:... [--rejoin S]``: check the options
    (usage errors exit 2), run, print the summary, write the JSON."""
    import typer

    from mlfabric.cli import console, run_or_exit, write_json
    from mlfabric.units import parse_duration

    if elastic:
        raise typer.BadParameter(f"--elastic runs --sync allreduce only (its membership); {','.join(train.modes)} "
                                 "takes a killed worker back without it: drop --elastic (--fail worker:RANK@SECONDS "
                                 "--rejoin AFTER_S)")
    try:
        rejoin_s = None if rejoin is None else parse_duration(rejoin)
        failures: tuple[WorkerFailure, ...] = ()
        if fail is not None:
            role = fail.strip().partition(":")[0]
            if role != "worker":
                raise ValueError(f"--fail {fail}: a PS run's worker kills are {PS_WORKER_FAIL_FORM}"
                                 + ("; churn:NxK is for --sync allreduce --elastic" if role == "churn" else "")
                                 + ("; server:AT kills server 0 for its replica to take over (--replicas, "
                                    "without --rejoin)" if role == "server" else ""))
            failures = parse_fail(fail, workers=train.workers).workers
        config = PSRejoinConfig(train=train, failures=failures, rejoin_s=rejoin_s)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    result = run_or_exit(lambda: run_ps_rejoin(config), (PSRejoinError,))
    console.print(summary_line(result), markup=False, highlight=False)
    if json_path is not None:
        write_json(json_path, {"runs": [result.to_dict()]})


if __name__ == "__main__":
    main()
