"""``mlfabric train --sync allreduce --elastic``: synchronous SGD that survives killed workers.

    mlfabric train --workload hyperplane --workers 4 --sync allreduce --elastic \\
        --fail worker:2@3 --rejoin 2 --dim 1024 --train-samples 8192 --compute-time 20ms --json -
    .venv/bin/python -m pytest tests/local/test_elastic_processes.py -q

The parent serves the rendezvous store (it must outlive every worker: a worker's store would
die with it), starts ``workers`` processes (``python -m mlfabric.train.elastic``), each an
:class:`mlfabric.torch.Elastic` member with member id = its rank, and once the first
membership has formed (the run's start) carries out ``--fail worker:RANK@SECONDS[,...]``:
SIGKILL of that worker's process ``SECONDS`` after the start -- no goodbye, a crash -- and,
with ``--rejoin AFTER_S``, a new process for the same member id ``AFTER_S`` after the kill,
which joins the running job and receives the state from the live members. ``--fail
churn:NxK`` instead kills a random worker K times, each once the job has run N steps with
every worker in it (issue #38's churn check; the leader publishes its step in the store).

Every step has a fixed global batch (``batch_size x workers`` samples of a seeded
permutation per data epoch) that the step's members split among themselves, and the wrapper
weights each member's gradient by its sample count: a step's update is the same whatever the
membership, so an elastic run follows a fault-free run of the same seed up to float rounding
(the aborted steps are recomputed). The run's JSON adds:

* ``recovery_s`` (one per failure): the kill to the moment every survivor has committed a
  step in a membership formed after it;
* ``rejoin_s`` (one per rejoin): the restart to the joiner's first committed step;
* ``steps_lost``: step attempts aborted (their computation thrown away), most on any rank;
* ``members``: the membership after each change (epoch, members, why);
* ``parameters_equal``: every rank alive at the end holds bit-identical parameters and
  optimizer state (CRC-32 of the packed state).

Trains the ``hyperplane``, ``mlp``, ``lenet5`` and ``lstm`` workloads (:data:`WORKLOADS`; their
batch, lr, momentum and epochs default to the other modes' of ``mlfabric train``). ``--emulate`` (root) runs each worker on its own host
of an emulated star (``star:n=WORKERS``, every NIC at ``--rate``, default 1 Gbit/s): the
parent moves into host 0's namespace (the store must be reachable from every host: the root
namespace is not on the emulated fabric), each worker (and its restart) runs in its host's
namespace and binds its epoch transports to its host's address.

    sudo .venv/bin/mlfabric train --workload hyperplane --workers 4 --sync allreduce --elastic \
        --fail worker:2@3 --rejoin 2 --dim 1024 --train-samples 8192 --compute-time 20ms --emulate --json -
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from mlfabric.bench.procs import stop_processes
from mlfabric.units import parse_duration

from .failover import (WORKER_FAIL_FORM, WorkerFailure, _worker_failures, check_worker_failures, parse_fail,
                       still_running)

if TYPE_CHECKING:
    from mlfabric.runtime.membership import MembershipStore

__all__ = ["ElasticRunConfig", "ElasticRunResult", "WorkerFailure", "parse_failures", "run_elastic_training", "summary_line"]

#: ``--fail`` in elastic runs.
FAIL_FORM = WORKER_FAIL_FORM
#: The workloads an elastic run trains (LDA's count updates are sums, not the mean of
#: gradients the wrapper takes over the members of a step).
WORKLOADS = ("hyperplane", "mlp", "lenet5", "lstm")
#: Training-set sizes of elastic runs where not the workload's own: the hyperplane's 8,192
#: samples (not eager-SGD's 32,768) keep a 4-worker run with a kill and a rejoin to a minute.
TRAIN_SAMPLES = {"hyperplane": 8192}
STORE_ENV = "MLFABRIC_ELASTIC_STORE"
#: Set in the parent that runs inside an emulated cluster's host 0 (see run_elastic_training).
_IN_CLUSTER_ENV = "MLFABRIC_ELASTIC_IN_CLUSTER"
#: The leader's committed step, published for the parent's churn (only when churning).
STEP_KEY = "train/step"


class ElasticRunError(RuntimeError):
    """A worker failed on its own, or the run did not finish within its timeout."""


def parse_churn(spec: str) -> tuple[int, int] | None:
    """``churn:15x5`` -> (15, 5); None for any other ``--fail`` (one parser for every form:
    :func:`mlfabric.train.failover.parse_fail`)."""
    if not spec.startswith("churn:"):
        return None
    return parse_fail(spec).churn


def parse_failures(spec: str, workers: int) -> tuple[WorkerFailure, ...]:
    """``worker:2@3,worker:1@6.5`` -> failures, checked against the job's ``workers``
    (:func:`mlfabric.train.failover.parse_fail`'s worker form; the others are refused here)."""
    role = spec.strip().partition(":")[0]
    if role != "worker":
        # The message names the elastic forms (and where server:AT belongs).
        return _worker_failures(spec, workers)
    return parse_fail(spec, workers=workers).workers


@dataclass(frozen=True, kw_only=True)
class ElasticRunConfig:
    workers: int = 4
    failures: tuple[WorkerFailure, ...] = ()
    rejoin_s: float | None = None
    algorithm: str = "ring"
    #: One of :data:`WORKLOADS`; the settings below left None take its defaults
    #: (:data:`mlfabric.train.harness.WORKLOAD_DEFAULTS`, :data:`TRAIN_SAMPLES`, its spec's).
    workload: str = "hyperplane"
    dim: int = 1024  # the hyperplane's
    train_samples: int = None  # type: ignore[assignment]  # resolved in __post_init__
    epochs: int = None  # type: ignore[assignment]
    batch_size: int = None  # type: ignore[assignment]
    lr: float = None  # type: ignore[assignment]
    momentum: float = None  # type: ignore[assignment]
    compute_time_s: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    grace_s: float = 5.0
    #: (every N steps, K times): SIGKILL a random live worker once the job has run N steps with
    #: every worker in it, K times (``--fail churn:NxK``; each restarted after ``rejoin_s``).
    churn: tuple[int, int] | None = None
    #: ``--emulate``: every worker on its own host of an emulated star, NICs at this rate.
    emulate_rate_bps: float | None = None

    def __post_init__(self) -> None:
        from .harness import WORKLOAD_DEFAULTS

        if self.workload not in WORKLOADS:
            why = " (LDA's count updates add up; the wrapper averages gradients)" if self.workload == "lda" else ""
            raise ValueError(f"--elastic trains {', '.join(WORKLOADS)}, not {self.workload!r}{why}")
        defaults = {**WORKLOAD_DEFAULTS[self.workload],
                    "train_samples": TRAIN_SAMPLES.get(self.workload) or _spec_class(self.workload)().train_samples}
        for name in ("train_samples", "epochs", "batch_size", "lr", "momentum"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[name])
        if self.workers < 2:
            raise ValueError(f"--elastic needs at least 2 workers (got {self.workers}): with one there is "
                             "nobody to go on when it is lost")
        if self.churn is None:
            check_worker_failures(self.failures, self.workers, self.rejoin_s)
        elif self.rejoin_s is not None and self.rejoin_s < 0:
            raise ValueError("--rejoin must be >= 0 seconds")
        if self.churn is not None and (self.rejoin_s is None or min(self.churn) < 1):
            raise ValueError("--fail churn:NxK kills a worker every N steps K times (N, K >= 1) and needs --rejoin")
        if self.algorithm not in ("ring", "halving_doubling", "tree"):
            raise ValueError(f"--elastic runs ring, halving_doubling or tree, not {self.algorithm!r}")
        if min(self.dim, self.train_samples, self.epochs, self.batch_size) < 1 or self.compute_time_s < 0:
            raise ValueError("dim, train samples, epochs and batch size must be positive, compute time >= 0")
        if self.train_samples < self.batch_size * self.workers:
            raise ValueError(f"{self.train_samples} training samples make no step of {self.batch_size} x "
                             f"{self.workers} workers: raise --train-samples")

    @property
    def steps_per_epoch(self) -> int:
        return self.train_samples // (self.batch_size * self.workers)

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch


@dataclass(kw_only=True)
class ElasticRunResult:
    config: ElasticRunConfig
    wall_s: float
    steps: int
    metric: str
    final_metric: float
    recovery_s: list[float | None]
    rejoin_s: list[float]
    steps_lost: int
    members: list[dict[str, Any]]
    parameters_equal: bool
    final_members: list[int]
    transferred_bytes: list[int] = field(default_factory=list)
    rejoin_startup_s: list[float] = field(default_factory=list)
    rejoined_too_late: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # the kills and restarts, seconds after the start

    def to_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["failures"] = [asdict(f) for f in self.config.failures]
        config["churn"] = None if self.config.churn is None else list(self.config.churn)
        return {"mode": "allreduce", "elastic": True, "config": config, "wall_s": self.wall_s, "steps": self.steps,
                "metric": self.metric, "final_metric": self.final_metric, "recovery_s": self.recovery_s,
                "rejoin_s": self.rejoin_s, "steps_lost": self.steps_lost, "members": self.members,
                "parameters_equal": self.parameters_equal, "final_members": self.final_members,
                "transferred_bytes": self.transferred_bytes, "rejoin_startup_s": self.rejoin_startup_s,
                "rejoined_too_late": self.rejoined_too_late, "events": self.events}


# -- the parent ------------------------------------------------------------------------------


def run_elastic_training(config: ElasticRunConfig, *, log_dir: Path | None = None,
                         hosts: Sequence[dict[str, Any]] | None = None) -> ElasticRunResult:
    """Run the job (see module); raises :class:`ElasticRunError` naming the worker and showing
    its log when one fails by itself or the run exceeds ``config.timeout_s``. ``hosts`` (the
    emulated run's parent, inside host 0): per worker its command prefix, environment and
    address."""
    import torch.distributed as dist

    from mlfabric.runtime.membership import MembershipStore

    if config.emulate_rate_bps is not None and hosts is None:
        return _run_emulated(config, log_dir)
    address = "127.0.0.1" if hosts is None else str(hosts[0]["address"])
    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    with tempfile.TemporaryDirectory(prefix="mlfabric-elastic-") as tmp:
        work = Path(log_dir) if log_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        procs: dict[int, subprocess.Popen] = {}
        logs: dict[int, Path] = {}
        generation: dict[int, int] = {}

        def start(rank: int, joining: bool) -> None:
            generation[rank] = generation.get(rank, -1) + 1
            logs[rank] = work / f"worker{rank}-{generation[rank]}.log"
            args = {**asdict(config), "failures": [], "member": rank, "joining": joining,
                    "out": str(work / f"worker{rank}-{generation[rank]}.json"),
                    "address": "127.0.0.1" if hosts is None else hosts[rank]["address"]}
            # One intra-op thread: several workers share the host's cores, and OpenMP's
            # spinning threads starved a restarting worker for tens of seconds.
            env = {**os.environ, STORE_ENV: f"{address}:{store.port}", "OMP_NUM_THREADS": "1",
                   **({} if hosts is None else hosts[rank]["env"])}
            # Emulated: the host's prefix (ip netns exec ...; every step execs, so the pid is the
            # worker's and a SIGKILL reaches it).
            prefix = [] if hosts is None else list(hosts[rank]["prefix"])
            with open(logs[rank], "w") as log_file:
                procs[rank] = subprocess.Popen([*prefix, sys.executable, "-m", "mlfabric.train.elastic",
                                                json.dumps(args)], stdout=log_file, stderr=subprocess.STDOUT, env=env)

        deadline = time.monotonic() + config.timeout_s
        killed: list[tuple[int, float]] = []
        restarted: list[tuple[int, float]] = []
        try:
            for rank in range(config.workers):
                start(rank, joining=False)
            ms = MembershipStore(store)
            while ms.current_epoch() < 0:
                _check_alive(procs, logs, killed={}, deadline=deadline)
                time.sleep(0.02)
            t0 = time.time()
            pending = [(t0 + f.at_s, "kill", f.rank) for f in config.failures]
            dead: dict[int, subprocess.Popen] = {}
            rng = random.Random(config.seed)
            churn_at: int | None = None if config.churn is None else config.churn[0]
            while True:
                now = time.time()
                if config.churn is not None and len(killed) < config.churn[1] and not dead:
                    step = int(store.get(STEP_KEY).decode()) if store.check([STEP_KEY]) else 0
                    full = _members(ms) == tuple(range(config.workers))
                    if churn_at is None and full:
                        churn_at = step + config.churn[0]  # N more steps with every worker in
                    elif churn_at is not None and step >= churn_at and full:
                        churn_at = None
                        pending.append((now, "kill", rng.randrange(config.workers)))
                for event in sorted(pending):
                    at, what, rank = event
                    if at > now:
                        break
                    pending.remove(event)
                    if what == "kill":
                        if procs[rank].poll() is not None and config.churn is not None:
                            continue  # the job is ending: no more churn
                        if procs[rank].poll() is not None:
                            raise ElasticRunError(f"worker {rank} had already ended when --fail was due "
                                                  f"({at - t0:.1f} s into the run): the run was shorter; "
                                                  "raise --epochs or --compute-time")
                        procs[rank].send_signal(signal.SIGKILL)
                        killed.append((rank, time.time()))
                        dead[rank] = procs[rank]
                        if config.rejoin_s is not None:
                            pending.append((time.time() + config.rejoin_s, "rejoin", rank))
                    else:
                        dead.pop(rank).wait(10)
                        start(rank, joining=True)
                        restarted.append((rank, time.time()))
                _check_alive(procs, logs, killed={r for r in dead}, deadline=deadline)
                if all(p.poll() is not None for r, p in procs.items() if r not in dead) and not pending:
                    break
                time.sleep(0.01)
            wall_s = time.time() - t0
        finally:
            stop_processes(procs.values())
        outputs = [json.loads(p.read_text()) for p in sorted(work.glob("worker*.json"))]
        # What killed processes had recorded (their recoveries from earlier kills count too).
        done = {p.with_suffix("").name for p in work.glob("worker*.json")}
        partial = [json.loads(p.read_text()) for p in sorted(work.glob("worker*.partial"))
                   if p.with_suffix("").name not in done]
        result = _summarize(config, outputs, killed, restarted, wall_s, partial)
        result.events = ([{"event": "kill", "worker": r, "at_s": round(t - t0, 3)} for r, t in killed]
                         + [{"event": "restart", "worker": r, "at_s": round(t - t0, 3)} for r, t in restarted])
        return result


def _run_emulated(config: ElasticRunConfig, log_dir: Path | None) -> ElasticRunResult:
    """``--emulate``: build a star of ``config.workers`` hosts, run the parent in host 0's
    namespace (``python -m mlfabric.train.elastic --parent``) with every worker on its host,
    tear the cluster down, and return what the parent wrote."""
    from mlfabric.emu.cluster import Cluster, new_prefix, plan_cluster

    assert config.emulate_rate_bps is not None
    plan = plan_cluster(f"star:n={config.workers}", config.emulate_rate_bps, prefix=new_prefix())
    prefixes = plan.command_prefixes()
    hosts = [{"prefix": prefixes[r], "env": plan.rank_env(r), "address": plan.hosts[r].address}
             for r in range(config.workers)]
    with tempfile.TemporaryDirectory(prefix="mlfabric-elastic-emu-") as tmp:
        work = Path(log_dir) if log_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        out = Path(tmp) / "result.json"
        spec = {"config": _config_to_dict(config), "hosts": hosts, "log_dir": str(work), "out": str(out)}
        with Cluster.create(plan, temporary_dir=tmp):
            proc = subprocess.run([*prefixes[0], sys.executable, "-m", "mlfabric.train.elastic", "--parent",
                                   json.dumps(spec)], env={**os.environ, _IN_CLUSTER_ENV: plan.prefix},
                                  capture_output=True, text=True, timeout=config.timeout_s + 120)
        if proc.returncode != 0 or not out.exists():
            raise ElasticRunError(f"the emulated run's parent (in host 0 of cluster {plan.prefix}) failed "
                                  f"(exit status {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        data = json.loads(out.read_text())
    names = {f.name for f in dataclass_fields(ElasticRunResult)} - {"config"}
    result = ElasticRunResult(config=config, **{k: v for k, v in data.items() if k in names})
    result.events.append({"event": "cluster", "prefix": plan.prefix, "topology": str(plan.spec),
                          "rate_bps": plan.rate_bps})
    return result


def _spec_class(workload: str) -> Any:
    from .workloads import HyperplaneSpec, LeNet5Spec, LstmSpec, MlpSpec

    return {"hyperplane": HyperplaneSpec, "mlp": MlpSpec, "lenet5": LeNet5Spec, "lstm": LstmSpec}[workload]


def make_task(workload: str, *, dim: int, train_samples: int, seed: int) -> Any:
    """An elastic run's task (:data:`mlfabric.train.harness.TASKS`), the same on every worker."""
    from .harness import TASKS

    sizes = {"dim": dim} if workload == "hyperplane" else {}
    return TASKS[workload](_spec_class(workload)(train_samples=train_samples, **sizes), seed)


def _config_to_dict(config: ElasticRunConfig) -> dict[str, Any]:
    out = asdict(config)
    out["failures"] = [asdict(f) for f in config.failures]
    out["churn"] = None if config.churn is None else list(config.churn)
    return out


def _config_from_dict(data: dict[str, Any]) -> ElasticRunConfig:
    return ElasticRunConfig(**{**data, "failures": tuple(WorkerFailure(**f) for f in data["failures"]),
                               "churn": None if data["churn"] is None else tuple(data["churn"])})


def _members(ms: MembershipStore) -> tuple[int, ...]:
    membership = ms.closed(ms.current_epoch())
    return () if membership is None else membership.members


def _check_alive(procs: dict[int, subprocess.Popen], logs: dict[int, Path], *, killed: set[int],
                 deadline: float) -> None:
    for rank, proc in procs.items():
        code = proc.poll()
        if code not in (None, 0) and rank not in killed:
            tail = logs[rank].read_text()[-3000:]
            raise ElasticRunError(f"worker {rank} failed (exit status {code}); the end of its log:\n{tail}")
    if time.monotonic() > deadline:
        raise ElasticRunError(f"the elastic run did not finish within its timeout (--timeout); "
                              f"{still_running(procs, logs)}")


def _summarize(config: ElasticRunConfig, outputs: list[dict[str, Any]], killed: list[tuple[int, float]],
               restarted: list[tuple[int, float]], wall_s: float,
               partial: Sequence[dict[str, Any]] = ()) -> ElasticRunResult:
    finished = [o for o in outputs if o["committed"] == config.steps]
    if any(o["committed"] != config.steps for o in outputs if "late" not in o):
        raise ElasticRunError("a worker ended before the last step: "
                              + ", ".join(f"member {o['member']} at {o['committed']}" for o in outputs))
    if not finished:
        raise ElasticRunError("no worker finished the run")
    recovery = []
    for rank, t_kill in killed:
        times = []
        for o in [*finished, *partial]:
            if o["member"] == rank or o["started"] >= t_kill:
                continue  # the killed one, or a process started after the kill (a joiner)
            after = [c["epoch"] for c in o["history"] if c["began"] >= t_kill]
            if not after:
                continue
            first = next((t for t, _, epoch in o["commits"] if epoch >= min(after) and t >= t_kill), None)
            if first is not None:
                times.append(first - t_kill)
        recovery.append(round(max(times), 4) if times else None)  # None: no survivor recorded it
    rejoin: list[float] = []
    startup: list[float] = []  # of rejoin_s: the process's start (imports, data) before it asked to join
    late: list[int] = []  # restarted after the job had finished
    for rank, t_start in restarted:
        joiner = next((o for o in outputs if o["member"] == rank and o["joining"] and o["started"] >= t_start - 1), None)
        if joiner is None or joiner["committed"] < 0:
            late.append(rank)
        elif joiner["commits"]:
            rejoin.append(round(joiner["commits"][0][0] - t_start, 4))
            startup.append(round(joiner["ready"] - t_start, 4))
    changes: dict[int, dict[str, Any]] = {}
    for o in [*outputs, *partial]:
        for c in o.get("history", ()):
            changes.setdefault(c["epoch"], {"epoch": c["epoch"], "members": c["members"], "reason": c["reason"]})
    transferred = sorted({c["transferred_bytes"] for o in outputs for c in o.get("history", ()) if c["transferred_bytes"]})
    crcs = {o["state_crc32"] for o in finished}
    final = sorted(o["member"] for o in finished)
    lowest = min(finished, key=lambda o: o["member"])
    from .harness import TASKS

    return ElasticRunResult(config=config, wall_s=round(wall_s, 3), steps=config.steps,
                            metric=TASKS[config.workload].metric,
                            final_metric=lowest["metric"], recovery_s=recovery, rejoin_s=rejoin,
                            steps_lost=max(o["aborted"] for o in finished), members=[changes[e] for e in sorted(changes)],
                            parameters_equal=len(crcs) == 1, final_members=final, transferred_bytes=transferred,
                            rejoin_startup_s=startup, rejoined_too_late=late)


def summary_line(result: ElasticRunResult) -> str:
    def figures(values: Sequence[float | None]) -> str:
        known = [v for v in values if v is not None]
        if not known:
            return "none" if not values else "not recorded"
        return (f"{', '.join('?' if v is None else f'{v:.2f}' for v in values)} s "
                f"(median {statistics.median(known):.2f})")

    return (f"elastic allreduce, {result.config.workload}, on {result.config.workers} workers: {result.steps} steps in {result.wall_s:.1f} s; "
            f"recovery {figures(result.recovery_s)}; rejoin {figures(result.rejoin_s)}; steps lost "
            f"{result.steps_lost}; final {result.metric} {result.final_metric:.4f}; members at the end "
            f"{result.final_members}; parameters equal: {result.parameters_equal}")


# -- a worker --------------------------------------------------------------------------------


def _worker(args: dict[str, Any]) -> None:
    started = time.time()
    import torch
    import torch.distributed as dist

    from mlfabric.runtime.membership import JobFinishedError
    from mlfabric.torch.elastic import Elastic

    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    task = make_task(args["workload"], dim=args["dim"], train_samples=args["train_samples"], seed=args["seed"])
    x, y = task.shard(0, 1)
    xv, yv = task.val()
    torch.manual_seed(args["seed"])
    model = task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=args["momentum"])
    commits: list[tuple[float, int, int]] = []
    ready = time.time()  # imports and data done: what follows is the join itself

    def on_commit(step: int, el: Elastic) -> None:
        if not commits or commits[-1][2] != el.comm.epoch:
            # The first commit of a membership: recorded on disk at once, so that a worker
            # killed later still counts as a survivor of the failures before.
            Path(args["out"]).with_suffix(".partial").write_text(json.dumps({
                "member": args["member"], "joining": args["joining"], "started": started, "ready": ready,
                "commits": [*commits, (time.time(), step, el.comm.epoch)],
                "history": [c.to_dict() for c in el.comm.history]}))
        commits.append((time.time(), step, el.comm.epoch))
        if args["churn"] and el.rank == 0:
            store.set(STEP_KEY, str(step))

    try:
        elastic = Elastic(model, optimizer, store=store, member=args["member"],
                          initial=None if args["joining"] else range(args["workers"]), algorithm=args["algorithm"],
                          timeout=60.0, grace_s=args["grace_s"], address=args.get("address", "127.0.0.1"),
                          on_commit=on_commit)
    except JobFinishedError as exc:
        print(exc, flush=True)
        Path(args["out"]).write_text(json.dumps({"member": args["member"], "joining": True, "started": started,
                                                 "ready": ready, "committed": -1, "late": str(exc)}))
        return
    global_batch = args["batch_size"] * args["workers"]
    per_epoch = args["train_samples"] // global_batch
    total = args["epochs"] * per_epoch
    perms: dict[int, torch.Tensor] = {}
    while elastic.committed < total:
        step = elastic.committed
        epoch, within = divmod(step, per_epoch)
        if epoch not in perms:
            perms.clear()
            perms[epoch] = torch.randperm(args["train_samples"], generator=torch.Generator().manual_seed(
                args["seed"] * 1_000_003 + epoch))
        index = perms[epoch][within * global_batch:(within + 1) * global_batch][elastic.rank::elastic.world_size]
        optimizer.zero_grad()
        task.loss(model, task.batch(x, index), y[index]).backward()
        if args["compute_time_s"]:
            time.sleep(args["compute_time_s"])
        elastic.step(weight=float(len(index)))
    elastic.finish()
    _, blob = elastic.pack()
    out = {"member": args["member"], "joining": args["joining"], "started": started, "ready": ready,
           "committed": elastic.committed,
           "aborted": elastic.aborted, "commits": commits, "history": [c.to_dict() for c in elastic.comm.history],
           "metric": task.evaluate(model, xv, yv)[1], "state_crc32": zlib.crc32(blob.numpy())}
    Path(args["out"]).write_text(json.dumps(out))
    elastic.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One worker of an elastic run (started by mlfabric train --elastic).")
    parser.add_argument("config", help="the worker's settings as JSON")
    parser.add_argument("--parent", action="store_true",
                        help="run the emulated run's parent (inside host 0; the JSON has config, hosts, log_dir, out)")
    args = parser.parse_args(argv)
    if args.parent:
        spec = json.loads(args.config)
        result = run_elastic_training(_config_from_dict(spec["config"]), log_dir=Path(spec["log_dir"]),
                                      hosts=spec["hosts"])
        data = result.to_dict()
        Path(spec["out"]).write_text(json.dumps({k: v for k, v in data.items() if k not in ("mode", "elastic", "config")}))
        return
    _worker(json.loads(args.config))


if __name__ == "__main__":
    main()


# -- the command line ------------------------------------------------------------------------


def run_from_cli(*, workload: str, workers: int, sync: str | None, fail: str | None, rejoin: str | None,
                 algorithm: str, dim: int, train_samples: int | None, epochs: int | None, batch_size: int | None,
                 lr: float | None, momentum: float | None, compute_time: str, seed: int, timeout: float,
                 emulate: bool, transport: str, json_path: Path | None, elastic: bool,
                 rate: str | None = None) -> None:
    """``mlfabric train ... --elastic``: check the options (usage errors exit 2), run, print
    the summary, write the JSON."""
    import typer

    from mlfabric.cli import console, run_or_exit, write_json

    def usage(message: str) -> typer.BadParameter:
        return typer.BadParameter(message)

    if not elastic:
        raise usage("--rejoin restarts workers of an elastic run: add --elastic")
    if sync not in (None, "allreduce"):
        raise usage(f"--elastic runs --sync allreduce only, not {sync!r}")
    emulate_rate_bps = None
    if emulate:
        from mlfabric.cli import rate_option
        from mlfabric.emu.cmd import have_root

        from .harness import EMULATE_NEEDS_ROOT

        if not have_root():
            raise usage(EMULATE_NEEDS_ROOT)
        emulate_rate_bps = rate_option(rate or "1gbit", "--rate", emulated=True)
    elif rate is not None:
        raise usage("--rate sets the emulated NICs' rate: add --emulate")
    if transport != "tcp":
        raise usage(f"--elastic runs over the tcp transport, not {transport}")
    try:
        churn = parse_churn(fail) if fail is not None else None
        failures = parse_failures(fail, workers) if fail is not None and churn is None else ()
        config = ElasticRunConfig(
            workers=workers, failures=failures, churn=churn, rejoin_s=None if rejoin is None else parse_duration(rejoin),
            algorithm=algorithm, workload=workload, dim=dim, seed=seed, timeout_s=timeout,
            compute_time_s=parse_duration(compute_time), emulate_rate_bps=emulate_rate_bps,
            **{k: v for k, v in (("train_samples", train_samples), ("epochs", epochs), ("batch_size", batch_size),
                                 ("lr", lr), ("momentum", momentum)) if v is not None})
    except ValueError as exc:
        raise usage(str(exc)) from None
    result = run_or_exit(lambda: run_elastic_training(config), (ElasticRunError,))
    console.print(summary_line(result), markup=False, highlight=False)
    if json_path is not None:
        write_json(json_path, {"runs": [result.to_dict()]})
