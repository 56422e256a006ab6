"""``mlfabric train --fail server:AT|aggregator:AT``: SIGKILL a process mid-run and measure the recovery.

    mlfabric train --workload hyperplane --workers 4 --sync mlfabric-a:8 --replicas 1 \\
        --replication network --div-max 30u --fail server:6 --json -
    mlfabric train --workload hyperplane --workers 6 --sync mlnet-tree:1 --fail aggregator:2 --json -
    python -m pytest tests/local/test_ps_failover_train.py -q

Server 0's process kills itself ``AT`` seconds after the run's start barrier, at a turn of its
serving loop (between two requests, so its model is whole): it first writes that model, its
versions and the wall-clock time to ``killed-server.pt`` in the run's fault directory (a
measurement only: nothing reads it back to recover), then sends itself SIGKILL -- no goodbye,
no flush, exactly a crash. Its replica takes over (:mod:`mlfabric.ps.replica`); the workers
redirect without restarting. Afterwards the parent compares:

* ``failover_s``: the kill to the first update the promoted replica applied;
* ``lost_divergence``: ``||w_server(kill) - w_replica(takeover)||``, the model lost with the
  server (MLfabric §3.3: fresh updates on the replica's model make it up), beside Div_max;
* ``lost_updates``: updates the server had applied whose copies never reached the replica.

``aggregator:AT`` (mlnet modes, MLNET §3): an interior node of server 0's tree (a worker
process whose node has children; one below another node where there is one) kills itself AT
seconds into its training loop, after writing the time to ``killed-worker.json``; its
children re-attach (:mod:`mlfabric.ps.policies.mlnet`). The run reports ``killed_worker`` and
``repaired_s``: the kill to the first re-attachment answered.

Every ``--fail`` form (these two, ``worker:RANK@S[,...]`` -- the elastic allreduce runs'
and the PS modes' worker kills, :mod:`mlfabric.train.ps_rejoin` -- and the elastic runs'
``churn:NxK``) is parsed by :func:`parse_fail`; each kind of run takes its own forms from it
and names the others' (``tests/unit/test_fail_spec.py``); :func:`check_worker_failures` is
the check both runs that kill workers make of them.

Only one parameter-server run per command can fail this way (its process is gone for the
runs after it); run the unfailed baseline as another command.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from mlfabric.units import parse_duration

if TYPE_CHECKING:
    import torch

    from mlfabric.ps.server import ParameterServer

#: The file the killed server leaves in the fault directory.
KILL_RECORD = "killed-server.pt"
WORKER_KILL_RECORD = "killed-worker.json"
FAIL_FORM = "server:AT or aggregator:AT (seconds after the run's start, e.g. server:6 or aggregator:2.5s)"
#: ``--fail`` of elastic runs (mlfabric/train/elastic.py).
WORKER_FAIL_FORM = "worker:RANK@SECONDS[,worker:RANK@SECONDS...] (e.g. worker:2@3) or churn:NxK"
#: ``--fail`` of the PS modes' worker kills (mlfabric/train/ps_rejoin.py): RANK is the worker's
#: index (0..workers-1; its launch rank is servers + RANK), as in elastic runs.
PS_WORKER_FAIL_FORM = ("worker:RANK@SECONDS[,worker:RANK@SECONDS...] (RANK: a worker, 0..workers-1; e.g. "
                       "worker:2@3)")
ROLES = ("server", "aggregator")


class FailoverError(RuntimeError):
    """The failure was not carried out as asked (the run ended first, nobody took over)."""


@dataclass(frozen=True, kw_only=True)
class WorkerFailure:
    """SIGKILL worker ``rank`` ``at_s`` seconds after the run's start (elastic runs)."""

    rank: int
    at_s: float


@dataclass(frozen=True, kw_only=True)
class FailSpec:
    """``--fail`` parsed, every form in one place: ``server:AT`` / ``aggregator:AT`` (the
    parameter server's; ``at_s``), ``worker:RANK@S[,...]`` (elastic runs; ``workers``) or
    ``churn:NxK`` (elastic runs; ``churn`` = (N, K)). Which forms a run takes is its
    caller's to say (:meth:`Failure.parse`, :func:`mlfabric.train.elastic.parse_failures`)."""

    role: str  # "server", "aggregator", "worker" or "churn"
    at_s: float | None = None
    workers: tuple[WorkerFailure, ...] = ()
    churn: tuple[int, int] | None = None


def parse_fail(text: str, *, workers: int | None = None) -> FailSpec:
    """Parse any ``--fail`` form (see :class:`FailSpec`); ``workers``: the job's workers,
    against which ``worker:RANK`` is checked. Raises ValueError naming the form expected."""
    spec = text.strip()
    role, sep, rest = spec.partition(":")
    if role == "churn":
        every, _, times = rest.partition("x")
        try:
            return FailSpec(role="churn", churn=(int(every), int(times)))
        except ValueError:
            raise ValueError(f"--fail {spec!r}: churn:NxK kills a random worker every N steps, K times "
                             "(e.g. churn:15x5)") from None
    if role == "worker":
        return FailSpec(role="worker", workers=_worker_failures(spec, workers))
    if role not in ROLES or not sep:
        raise ValueError(f"--fail {text!r}: expected {FAIL_FORM}, or in elastic runs {WORKER_FAIL_FORM}")
    try:
        at_s = parse_duration(rest)  # "6" is seconds
    except ValueError:
        raise ValueError(f"--fail {text!r}: expected {FAIL_FORM}") from None
    if not at_s > 0:
        raise ValueError(f"--fail {text!r}: the time must be positive, got {at_s}")
    return FailSpec(role=role, at_s=at_s)


def _worker_failures(spec: str, workers: int | None) -> tuple[WorkerFailure, ...]:
    """``worker:2@3,worker:1@6.5`` -> failures in time order (ranks checked against ``workers``)."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        role, _, rest = part.partition(":")
        rank_text, at, when = rest.partition("@")
        if role != "worker" or not at:
            raise ValueError(f"--fail {part!r}: an elastic run kills workers (so does a ps-bsp, ps-ssp:S or "
                             f"ps-async run's --fail worker:...): {WORKER_FAIL_FORM}"
                             + ("; the parameter server's server:AT is for the PS modes' replica failover "
                                "(--replicas, without --rejoin)" if role == "server" else ""))
        try:
            rank = int(rank_text)
        except ValueError:
            raise ValueError(f"--fail {part!r}: {rank_text!r} is not a worker rank ({WORKER_FAIL_FORM})") from None
        if workers is not None and not 0 <= rank < workers:
            raise ValueError(f"--fail {part!r}: worker {rank} is outside the job (workers 0-{workers - 1})")
        at_s = parse_duration(when)
        if at_s < 0:
            raise ValueError(f"--fail {part!r}: the time must be >= 0 seconds")
        out.append(WorkerFailure(rank=rank, at_s=at_s))
    if not out:
        raise ValueError(f"--fail is empty: {WORKER_FAIL_FORM}")
    return tuple(sorted(out, key=lambda f: f.at_s))


def check_worker_failures(failures: tuple[WorkerFailure, ...], workers: int, rejoin_s: float | None) -> None:
    """What every run that kills workers checks (``mlfabric train --elastic`` and the PS
    modes' ``--fail worker:...``): each rank inside the job, a worker named twice only if it
    is restarted in between, ``--rejoin`` not negative and only with a worker to restart.
    Raises ValueError naming the option."""
    if rejoin_s is not None and rejoin_s < 0:
        raise ValueError("--rejoin must be >= 0 seconds")
    if rejoin_s is not None and not failures:
        raise ValueError("--rejoin restarts killed workers: give --fail worker:RANK@SECONDS")
    for failure in failures:
        if not 0 <= failure.rank < workers:
            raise ValueError(f"--fail worker:{failure.rank}: outside the job (workers 0-{workers - 1})")
    if len({f.rank for f in failures}) < len(failures) and rejoin_s is None:
        raise ValueError("--fail names one worker twice: without --rejoin it is dead after the first")


def still_running(procs: "Mapping[int, Any]", logs: "Mapping[int, Path]", chars: int = 1500) -> str:
    """For a run past its timeout: the ranks whose process still runs, each with the end of its
    log -- the message must carry them, for the log directory may be a temporary one, removed
    with the error (the elastic and the PS kill runs)."""
    running = [rank for rank, proc in procs.items() if proc.poll() is None]
    tails = "".join(f"\n--- rank {rank} ({logs[rank].name}), still running; the end of its log:\n"
                    f"{logs[rank].read_text()[-chars:]}" for rank in running)
    return f"ranks still running: {running}{tails}"


@dataclass(frozen=True)
class Failure:
    """Kill server 0 (``role="server"``) or an interior node of server 0's mlnet tree
    (``"aggregator"``) ``at_s`` seconds into the run."""

    role: str
    at_s: float

    @classmethod
    def parse(cls, text: str) -> "Failure":
        """The parameter server's forms of :func:`parse_fail`."""
        try:
            spec = parse_fail(text)
        except ValueError as exc:
            if text.strip().partition(":")[0] in ROLES:
                raise
            raise ValueError(f"--fail {text!r}: expected {FAIL_FORM}") from exc
        if spec.role not in ROLES or spec.at_s is None:
            raise ValueError(f"--fail {text!r}: expected {FAIL_FORM} ({spec.role}: is for elastic runs, "
                             "--sync allreduce --elastic"
                             + (", and for one ps-bsp, ps-ssp:S or ps-async run (mlfabric.train.ps_rejoin)"
                                if spec.role == "worker" else "") + ")")
        return cls(role=spec.role, at_s=spec.at_s)


def aggregator_victim(parents: "Any") -> int:
    """The worker an ``aggregator`` failure kills: in server 0's tree (a row of the parent
    table), the first interior node below another node, else the first with children."""
    row = [int(p) for p in parents[0]]
    interior = [w for w in range(len(row)) if w in row]
    if not interior:
        raise ValueError("--fail aggregator: server 0's mlnet tree has no interior node (every worker is a leaf): "
                         "use a deeper tree (mlnet-tree:1, mlnet-binary with 3+ workers)")
    below = [w for w in interior if row[w] >= 0]
    return (below or interior)[0]


def _record_and_crash(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` the kill record (whole or absent: written aside, then renamed), then SIGKILL
    this process: no goodbye, no flush, exactly a crash."""
    write(path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_worker(fault_dir: str, worker: int) -> None:
    """Record the time and crash this (worker) process."""
    import json

    record = json.dumps({"killed_at": time.time(), "worker": worker})
    _record_and_crash(Path(fault_dir) / WORKER_KILL_RECORD, lambda tmp: tmp.write_text(record))


def repair_figures(fault_dir: str, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """An aggregator failure's fields from the victim's record and the surviving nodes' stats."""
    import json

    path = Path(fault_dir) / WORKER_KILL_RECORD
    if not path.exists():
        raise FailoverError(f"--fail: the aggregator left no {WORKER_KILL_RECORD} in {fault_dir}: it was not killed "
                            "(the run ended before the failure time? give an earlier --fail aggregator:AT)")
    record = json.loads(path.read_text())
    attached = [t for n in nodes for t in n.get("attached_at", []) if t >= record["killed_at"]]
    return {"killed_worker": record["worker"],
            "repaired_s": (min(attached) - record["killed_at"]) if attached else None}


def kill_on_turn(server: "ParameterServer", at_s: float, fault_dir: str) -> Callable[[], None]:
    """The serving loop's per-turn hook that crashes this process ``at_s`` seconds from now."""
    deadline = time.monotonic() + at_s

    def turn() -> None:
        if time.monotonic() < deadline:
            return
        import torch

        record = {"killed_at": time.time(), "versions": {n: s.version for n, s in server.shards.items()},
                  "values": {n: s.values.clone() for n, s in server.shards.items()}}
        _record_and_crash(Path(fault_dir) / KILL_RECORD, lambda tmp: torch.save(record, tmp))

    return turn


def failover_figures(fault_dir: str, promoted: dict[str, Any] | None) -> dict[str, Any]:
    """The run's failover fields from the killed server's record and what the promoted
    replica reported (:func:`mlfabric.train.ps_modes.serve_run`'s statistics of the server it
    became, with its own under ``took_over`` and its models at the takeover)."""
    import torch

    path = Path(fault_dir) / KILL_RECORD
    if not path.exists():
        raise FailoverError(f"--fail: server 0 left no {KILL_RECORD} in {fault_dir}: it was not killed (the run "
                           "ended before the failure time? give an earlier --fail server:AT)")
    record = torch.load(path)
    if promoted is None:
        raise FailoverError("--fail: server 0 was killed but no replica took over (see the ranks' logs)")
    replica, models = promoted["took_over"], promoted["takeover_models"]
    first = promoted["first_update_at"]
    lost = [float(torch.linalg.vector_norm(record["values"][name].double() - models[name].double()))
            for name in record["values"] if name in models]
    return {"failover_s": (first - record["killed_at"]) if first is not None else None,
            "takeover_s": replica["promoted_at"] - record["killed_at"],
            "lost_divergence": max(lost) if lost else None,
            "lost_updates": replica["lost_updates"],
            "killed_version": max(record["versions"].values(), default=0),
            "takeover_version": replica["takeover_version"]}
