"""``mlfabric launch``: run one process per emulated host, torchrun-style, and always clean up.

    sudo mlfabric launch --hosts 8 --topology star --rate 1gbit --churn N2 --period 5s --seed 1 -- python train.py
    sudo .venv/bin/python -m mlfabric.emu launch --hosts 2 --rate 100mbit -- python -c "import os; print(os.environ['RANK'])"

:func:`launch` builds the cluster (:mod:`mlfabric.emu.cluster`), optionally starts bandwidth
churn (:mod:`mlfabric.emu.churn`, the applied schedule goes to a capacity-trace CSV), and
starts rank ``r`` as ``ip netns exec <prefix>-h<r> COMMAND`` with the torchrun environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR = host 0's address,
MASTER_PORT) plus what :meth:`ClusterPlan.rank_env` gives every rank of a cluster:
``MLFABRIC_CHANNEL_ADDRS`` (one channel per NIC / BCube level), ``MLFABRIC_TOPOLOGY`` (the
spec, which ``mlfabric.init`` reads: BML needs it), ``GLOO_SOCKET_IFNAME``,
``MLFABRIC_EMU_CLUSTER`` (the cluster description, JSON), ``MLFABRIC_EMU_PREFIX`` and
``MLFABRIC_EMU_NETNS``. Every output line of a rank is printed as ``[rank r] line``.

Rank ``r`` runs as host ``<prefix>-h<r>`` (its hostname; ``h<r>`` is an alias that every host
resolves, :meth:`ClusterPlan.hosts_file`), so torch's store and torchrun's c10d rendezvous
resolve the hosts by name: ``-- torchrun --nnodes 4 --rdzv-backend c10d --rdzv-endpoint
h0:29400 ...`` runs one torchrun agent per emulated host (docs/multi_node.md).

The ranks run with this launcher's Python environment (:func:`rank_command`): a command
that starts with a bare ``python`` or ``python3`` runs :data:`sys.executable` instead (under
``sudo`` PATH is reset and ``python`` would be the system's, without torch), and the
directory of :data:`sys.executable` comes first on the ranks' PATH (``torchrun`` and the
script's own subprocesses find this environment's too); the launcher says both at start.
:func:`emulated_launch` gives the same placement and environment to ranks started by
:func:`mlfabric.bench.procs.run_ranks` (the emulated benchmarks and training jobs).

An emulated run writes the cluster's description (``cluster.json``, which the ranks find
through ``MLFABRIC_EMU_CLUSTER``) and, with churn and no ``trace_path``, the churn trace into a
run directory: by default a new one in the temp dir, removed at the end; ``keep_run_dir``
(``--keep-run-dir``) keeps it, and a ``run_dir`` the user names (``--run-dir PATH``) is kept.

Exit status: 0 when every rank exits 0; otherwise the first failing rank's status (the others
get ``grace_s`` seconds, then are killed); 124 on timeout; 128 + signal on SIGINT/SIGTERM.
Namespaces, links, processes and the temporary run directory are removed on every one of
these paths; after a ``kill -9`` of the launcher the ranks die with it (PR_SET_PDEATHSIG)
and ``mlfabric emu cleanup`` removes the namespaces, the hosts files and the temporary run
directory.

Without root (or with ``emulate="never"``) the ranks run as plain local processes on loopback
with ``MLFABRIC_TOPOLOGY``, one loopback channel per NIC and ``MLFABRIC_PACE`` (the zmq or
tcp transport then paces every channel to the rate in user space, :mod:`mlfabric.transport.pacing`);
a warning says that this is user-space shaping and that churn and topology are not enforced.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, Callable

from mlfabric import CHUNK_ENV, TOPOLOGY_ENV
from mlfabric.emu.churn import ChurnRunner, churn_model
from mlfabric.runtime.fair_share import NIC_RATE_ENV
from mlfabric.emu.cluster import Cluster, ClusterPlan, new_prefix, pipeline_chunk_bytes, plan_cluster
from mlfabric.emu.cmd import EmuUnavailableError, have_root
from mlfabric.topo.spec import TOPOLOGY_KINDS, TopologySpec
from mlfabric.topo.trace import capacity_trace_env
from mlfabric.transport.pacing import PACE_ENV

if TYPE_CHECKING:
    from mlfabric.bench.procs import LaunchConfig
    from mlfabric.topo.trace import TraceRow

__all__ = ["LaunchSpec", "launch", "resolve_topology", "EMULATE_MODES", "RANK_PLACEMENTS", "churned_rank_envs",
           "cluster_launch_config", "emulated_launch", "fallback_env", "rank_hosts", "start_churn", "rank_command",
           "rank_path", "PYTHON_NAMES"]

EMULATE_MODES = ("auto", "always", "never")
#: Where the ranks of a cluster with several ranks per host go: ``consecutive`` (ranks
#: ``h*R .. h*R+R-1`` on host h, as torchrun numbers a node's processes) or ``interleaved``
#: (rank r on host ``r mod hosts``: every ring neighbour on another host).
RANK_PLACEMENTS = ("consecutive", "interleaved")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What :func:`launch` runs and on which emulated cluster.

    ``topology`` is a spec string (``star:n=8``, ``racks:r=2,h=4,oversub=4``,
    ``bcube:n=3,k=2``) or a bare ``star`` completed by ``hosts``. ``churn`` is ``N1``/``N2``/
    ``N3`` or ``RATE:PROB,...``; its schedule is written to ``trace_path`` (default: in the
    run directory, printed at start). ``run_dir``: where an emulated run's files go (created
    if missing, kept); by default a new directory in the temp dir, removed at the end unless
    ``keep_run_dir``. ``timeout_s=None`` waits forever.
    """

    command: tuple[str, ...]
    hosts: int | None = None
    topology: str = "star"
    rate_bps: float = 1e9
    churn: str | None = None
    period_s: float = 5.0
    seed: int = 0
    trace_path: str | None = None
    master_port: int = 29500
    timeout_s: float | None = None
    grace_s: float = 5.0
    emulate: str = "auto"
    run_dir: str | None = None
    keep_run_dir: bool = False
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no command to launch: put it after `--`, e.g. -- python train.py")
        if self.emulate not in EMULATE_MODES:
            raise ValueError(f"emulate must be one of {', '.join(EMULATE_MODES)}, got {self.emulate!r}")
        if self.hosts is not None and self.hosts < 1:
            raise ValueError(f"--hosts must be at least 1, got {self.hosts}")
        if not self.rate_bps >= 8000:
            raise ValueError(f"rate must be at least 8 kbit/s, got {self.rate_bps} bit/s")
        if self.period_s <= 0:
            raise ValueError(f"churn period must be positive, got {self.period_s}s")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s}")
        if self.churn is not None:
            churn_model(self.churn)  # validate early
        resolve_topology(self.topology, self.hosts)


def resolve_topology(topology: str, hosts: int | None) -> TopologySpec:
    """``star`` + 8 hosts -> ``star:n=8``; a full spec is checked against ``hosts``."""
    text = topology.strip()
    if ":" not in text:
        if text.lower() != "star":
            example = TOPOLOGY_KINDS[text.lower()].example if text.lower() in TOPOLOGY_KINDS else "star:n=8"
            raise ValueError(f"topology {topology!r} needs its parameters, e.g. {example}")
        if hosts is None:
            raise ValueError("--topology star needs --hosts N (or write star:n=N)")
        return TopologySpec.parse(f"star:n={hosts}")
    spec = TopologySpec.parse(text)
    if spec.kind not in ("star", "racks", "bcube"):
        raise ValueError(f"the emulator builds star, racks and bcube topologies, not {spec.kind!r}")
    n = {"star": lambda: spec.int_param("n"), "racks": lambda: spec.int_param("r") * spec.int_param("h"),
         "bcube": lambda: spec.int_param("n") ** spec.int_param("k")}[spec.kind]()
    if hosts is not None and hosts != n:
        raise ValueError(f"--hosts {hosts} contradicts topology {spec} which has {n} hosts")
    return spec


#: Bare interpreter names that :func:`rank_command` replaces with :data:`sys.executable`.
PYTHON_NAMES = ("python", "python3")


def rank_command(command: Sequence[str]) -> tuple[str, ...]:
    """``command`` as the ranks run it: a leading bare ``python``/``python3`` becomes this
    launcher's interpreter (:data:`sys.executable`), so the ranks import the torch and
    mlfabric the launcher runs with, whatever PATH says (``sudo`` resets it). A path
    (``/usr/bin/python3``) or another program is left as given."""
    if command and command[0] in PYTHON_NAMES:
        return (sys.executable, *command[1:])
    return tuple(command)


def rank_path(path: str | None) -> str:
    """The ranks' PATH: the directory of this launcher's interpreter first (its
    environment's ``torchrun``, ``python``, ...), then ``path`` without that directory."""
    own = os.path.dirname(sys.executable)
    rest = [entry for entry in (path or os.defpath).split(os.pathsep) if entry and entry != own]
    return os.pathsep.join([own, *rest])


def fallback_env(topology: TopologySpec, rate_bps: float) -> dict[str, str]:
    """What a rank gets without an emulated network: the topology (BML stays correct), one
    loopback channel per NIC, and ``MLFABRIC_PACE`` so the zmq or tcp transport shapes each of them
    to ``rate_bps`` in user space (transport/pacing.py), with the ring's pipelining chunk
    for that rate as on a built cluster."""
    nics = topology.int_param("k") if topology.kind == "bcube" else 1
    return {TOPOLOGY_ENV: str(topology), PACE_ENV: f"{rate_bps:.0f}bit", CHUNK_ENV: str(pipeline_chunk_bytes(rate_bps)),
            "MLFABRIC_CHANNEL_ADDRS": ",".join(f"{nic}=127.0.0.1" for nic in range(nics))}


def rank_hosts(n_hosts: int, ranks_per_host: int = 1, placement: str = "consecutive") -> list[int]:
    """The host of every rank when each of ``n_hosts`` hosts runs ``ranks_per_host`` ranks
    (see :data:`RANK_PLACEMENTS`); rank 0 is on host 0 either way."""
    if ranks_per_host < 1:
        raise ValueError(f"ranks per host must be at least 1, got {ranks_per_host}")
    if placement not in RANK_PLACEMENTS:
        raise ValueError(f"unknown rank placement {placement!r}; choose one of {', '.join(RANK_PLACEMENTS)}")
    world = n_hosts * ranks_per_host
    if placement == "consecutive":
        return [rank // ranks_per_host for rank in range(world)]
    return [rank % n_hosts for rank in range(world)]


def cluster_launch_config(plan: ClusterPlan, *, master_port: int = 29500, ranks_per_host: int = 1,
                          placement: str = "consecutive", hosts: Sequence[int] | None = None,
                          **options: Any) -> LaunchConfig:
    """A :class:`~mlfabric.bench.procs.LaunchConfig` that runs rank ``r`` inside host
    ``rank_hosts(...)[r]`` of ``plan`` (host ``r`` with one rank per host) with that host's
    :meth:`ClusterPlan.rank_env` (what ``mlfabric launch`` gives its ranks too). Ranks of one
    host share its namespace, so they reach each other through shared memory
    (``transport/shm.py``) and the other hosts through the host's NICs. ``options`` are the
    other ``LaunchConfig`` fields (``timeout_s``, ``capture_output``, ...). ``hosts``: the host
    of every rank given outright instead (``mlfabric train --workers-per-host``: the servers
    one to a host, the workers several)."""
    from mlfabric.bench.procs import LaunchConfig

    several = ranks_per_host > 1 or (hosts is not None and len(set(hosts)) < len(hosts))
    if hosts is None:
        hosts = rank_hosts(plan.n_hosts, ranks_per_host, placement)
    elif not hosts or min(hosts) < 0 or max(hosts) >= plan.n_hosts:
        raise ValueError(f"rank hosts {list(hosts)} outside the topology's hosts 0..{plan.n_hosts - 1}")
    prefixes, envs = plan.command_prefixes(), plan.rank_envs()
    if several:
        # The topology spec numbers hosts, one rank each (BML's digits): with several ranks
        # per host it would misdescribe the job, so the ranks learn their hosts instead.
        envs = [{k: v for k, v in env.items() if k != TOPOLOGY_ENV} for env in envs]
    # Host 0's namespace is brand new, so any port is free there (and free_port() could not
    # probe it from this namespace).
    return LaunchConfig(world_size=len(hosts), master_addr=plan.master_addr, master_port=master_port,
                        command_prefix=[prefixes[h] for h in hosts], rank_env=[envs[h] for h in hosts], **options)


def start_churn(cluster: Cluster, churn: str, *, rate_bps: float, period_s: float, seed: int,
                trace_path: str | None,
                on_apply: Callable[[float, list[TraceRow]], None] | None = None) -> ChurnRunner:
    """Start bandwidth churn ``churn`` (``N1``/``N2``/``N3`` or ``RATE:PROB,...``) on every host
    NIC of ``cluster``, drawn from ``rate_bps``, every ``period_s`` seconds under ``seed``; the
    first redraw is applied before it returns, each one is appended to ``trace_path`` (a
    capacity-trace CSV). Stop it with :meth:`ChurnRunner.stop` (which re-raises a failure).
    ``mlfabric launch --churn`` and :func:`emulated_launch` both start churn here."""
    plan = cluster.plan
    return ChurnRunner(cluster=cluster, model=churn_model(churn), n_hosts=plan.n_hosts,
                       nics_per_host=len(plan.hosts[0].nics), base_rate_bps=rate_bps, period_s=period_s,
                       seed=seed, trace_path=trace_path, on_apply=on_apply).start()


def churned_rank_envs(envs: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """The ranks' environments under churn: rates change under the ranks, so the fixed
    per-NIC fair share (``MLFABRIC_NIC_RATE``) would be wrong and is left out."""
    return [{k: v for k, v in env.items() if k != NIC_RATE_ENV} for env in envs]


@contextlib.contextmanager
def emulated_launch(topology: str | TopologySpec, rate_bps: float, *,
                    on_built: Callable[[ClusterPlan], None] | None = None, churn: str | None = None,
                    churn_period_s: float = 5.0, churn_seed: int = 0, trace_path: str | None = None,
                    on_churn: Callable[[float, list[TraceRow]], None] | None = None,
                    **options: Any) -> Iterator[LaunchConfig]:
    """Build an emulated cluster, yield the :func:`cluster_launch_config` of its ranks (for
    :func:`mlfabric.bench.procs.run_ranks`), tear it down on the way out (root needed).

    ``on_built(plan)`` runs once the cluster is up, before any rank (benchmarks measure their
    reference goodput there). With ``churn``, bandwidth churn (:func:`start_churn`, as
    ``mlfabric launch --churn``) starts after ``on_built`` and runs until the block is left;
    its trace goes to ``trace_path`` (without one, to a temp dir removed on the way out), which
    the ranks' network monitor follows (``MLFABRIC_CAPACITY_TRACE``, :class:`mlfabric.ps.monitor.TraceFeed`),
    ``on_churn(t, rows)`` sees each redraw, and a failure of the churn thread is
    raised on the way out (the ranks run on under the last rates meanwhile). Several launches
    may run one after the other in one cluster; give each its own ``master_port``
    (``dataclasses.replace``) so that no socket of the previous one is in the way.
    """
    import dataclasses

    spec = resolve_topology(str(topology), None)
    plan = plan_cluster(spec, rate_bps, prefix=new_prefix())
    if churn is not None:
        churn_model(churn)  # a bad model fails before anything is built
    # SIGINT/SIGTERM (e.g. timeout(1) around a benchmark) raise inside the block, so the
    # cluster is torn down on the way out instead of left behind (it was, by `mlfabric train`).
    with _Signals(), Cluster.create(plan) as cluster:
        if on_built is not None:
            on_built(plan)
        config = cluster_launch_config(plan, **options)
        if churn is None:
            yield config
            return
        # The ranks' network monitor (ps/monitor.py TraceFeed) follows the trace as it is
        # written: one is always kept while the ranks run (in a temp dir without trace_path).
        with tempfile.TemporaryDirectory(prefix="mlfabric-churn-") as scratch:
            followed = trace_path or os.path.join(scratch, "trace.csv")
            runner = start_churn(cluster, churn, rate_bps=rate_bps, period_s=churn_period_s, seed=churn_seed,
                                 trace_path=followed, on_apply=on_churn)
            assert runner.started_at is not None
            hosts = rank_hosts(plan.n_hosts, options.get("ranks_per_host", 1), options.get("placement", "consecutive"))
            feed = capacity_trace_env(followed, runner.started_at, hosts)
            try:
                yield dataclasses.replace(config, rank_env=[{**env, **feed}
                                                            for env in churned_rank_envs(config.rank_env or [])])
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the block's own error is the one to see
                    runner.stop()
                raise
            runner.stop()


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class _Signals:
    """SIGINT/SIGTERM raise :class:`_Interrupted` until ``defer()``; then they are only remembered."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._deferred = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if not self._deferred:
            self._deferred = True  # a second signal must not interrupt the teardown
            raise _Interrupted(signum)

    def defer(self) -> None:
        self._deferred = True

    def __exit__(self, *exc: object) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)  # type: ignore[arg-type]


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    threads: list[threading.Thread]
    code: int | None = None
    ended_at: float = 0.0


def _pump(stream: IO[bytes], rank: int, out: IO[str], lock: threading.Lock) -> None:
    prefix = f"[rank {rank}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def launch(spec: LaunchSpec, *, out: IO[str] | None = None, err: IO[str] | None = None,
           on_cluster: Callable[[ClusterPlan | None], None] | None = None) -> int:
    """Run ``spec.command`` once per host; return the exit status (see the module docstring)."""
    out = out or sys.stdout
    err = err or sys.stderr
    topology = resolve_topology(spec.topology, spec.hosts)
    emulate = spec.emulate == "always" or (spec.emulate == "auto" and have_root())
    if spec.emulate == "always" and not have_root():
        raise EmuUnavailableError("emulation was requested but needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN)")
    cluster: Cluster | None = None
    churn: ChurnRunner | None = None
    ranks: list[_Rank] = []
    temporary_dir: str | None = None  # the run directory to remove at the end
    lock = threading.Lock()
    with _Signals() as signals:
        try:
            if emulate:
                plan = plan_cluster(topology, spec.rate_bps, prefix=new_prefix())
                if spec.run_dir is not None:
                    run_dir = spec.run_dir
                    os.makedirs(run_dir, exist_ok=True)
                else:
                    run_dir = tempfile.mkdtemp(prefix=f"mlfabric-emu-{plan.prefix}-")
                    temporary_dir = None if spec.keep_run_dir else run_dir
                removed = " (removed at the end: --keep-run-dir or --run-dir PATH keeps it)" if temporary_dir else ""
                trace_removed = (" (removed at the end: --trace FILE, --keep-run-dir or --run-dir PATH keeps it)"
                                 if temporary_dir and not spec.trace_path else "")
                cluster = Cluster.create(plan, temporary_dir=temporary_dir)
                cluster_json = os.path.join(run_dir, "cluster.json")
                with open(cluster_json, "w") as handle:
                    json.dump(plan.describe(), handle, indent=2)
                err.write(f"mlfabric launch: cluster {plan.prefix}: {topology}, NICs at {spec.rate_bps / 1e6:g} Mbit/s, "
                          f"MASTER_ADDR={plan.master_addr}; description in {cluster_json}{removed}\n")
                if spec.churn is not None:
                    trace = spec.trace_path or os.path.join(run_dir, "trace.csv")
                    churn = start_churn(cluster, spec.churn, rate_bps=spec.rate_bps, period_s=spec.period_s,
                                        seed=spec.seed, trace_path=trace)
                    err.write(f"mlfabric launch: churn {spec.churn} every {spec.period_s:g}s (seed {spec.seed}); "
                              f"trace in {trace}{trace_removed}\n")
                n_hosts = plan.n_hosts
                master_addr = plan.master_addr
                prefixes = plan.command_prefixes()
                extra = plan.rank_envs(cluster_json=cluster_json)
                if churn is not None:
                    assert churn.started_at is not None
                    follow = capacity_trace_env(trace, churn.started_at, range(n_hosts))  # rank r on host r
                    extra = [{**env, **follow} for env in churned_rank_envs(extra)]
                port = spec.master_port
            else:
                from mlfabric.bench.procs import free_port

                plan = None
                n_hosts = {"star": lambda: topology.int_param("n"),
                           "racks": lambda: topology.int_param("r") * topology.int_param("h"),
                           "bcube": lambda: topology.int_param("n") ** topology.int_param("k")}[topology.kind]()
                why = "not root" if spec.emulate == "auto" else "--emulate never"
                what = "churn and topology" if spec.churn else "topology"
                err.write(f"mlfabric launch: WARNING: {why}, so no emulated network: the ranks run as local "
                          f"processes on loopback; the zmq or tcp transport paces each NIC to {spec.rate_bps / 1e6:g} "
                          f"Mbit/s in user space (egress only, per message) and {what} are NOT enforced\n")
                master_addr = "127.0.0.1"
                prefixes = [[] for _ in range(n_hosts)]
                extra = [fallback_env(topology, spec.rate_bps) for _ in range(n_hosts)]
                port = free_port()
            if on_cluster is not None:
                on_cluster(plan)
            command = rank_command(spec.command)
            if command[0] != spec.command[0]:
                err.write(f"mlfabric launch: running `{spec.command[0]}` as {command[0]} (this launcher's interpreter; "
                          f"give a path, e.g. /usr/bin/python3, to run another)\n")
            path = rank_path(spec.env.get("PATH", os.environ.get("PATH")))
            err.write(f"mlfabric launch: the ranks' PATH starts with {os.path.dirname(sys.executable)}"
                      + (f"; hosts are named {plan.hosts[0].hostname} .. {plan.hosts[-1].hostname} "
                         f"(aliases h0 .. h{n_hosts - 1})" if plan is not None else "") + "\n")
            for rank in range(n_hosts):
                env = dict(os.environ)
                env.update(spec.env)
                env["PATH"] = path
                env.update(extra[rank])
                env.update({"RANK": str(rank), "WORLD_SIZE": str(n_hosts), "LOCAL_RANK": str(rank),
                            "LOCAL_WORLD_SIZE": str(n_hosts), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                            "ROLE_WORLD_SIZE": str(n_hosts), "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
                            "PYTHONUNBUFFERED": "1"})
                env.setdefault("OMP_NUM_THREADS", "1")
                proc = subprocess.Popen([*prefixes[rank], *command], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                        start_new_session=True, preexec_fn=_pdeathsig)
                threads = [threading.Thread(target=_pump, args=(stream, rank, sink, lock), daemon=True)
                           for stream, sink in ((proc.stdout, out), (proc.stderr, err))]
                for thread in threads:
                    thread.start()
                ranks.append(_Rank(rank=rank, proc=proc, threads=threads))
            return _supervise(ranks, spec, err, lock, churn)
        except _Interrupted as exc:
            with lock:
                err.write(f"mlfabric launch: {exc}; stopping the ranks and tearing down\n")
            return 128 + exc.signum
        finally:
            signals.defer()
            _stop_ranks(ranks, spec.grace_s)
            churn_error: BaseException | None = None
            if churn is not None:
                try:
                    churn.stop()
                except RuntimeError as exc:
                    churn_error = exc
            if cluster is not None:
                cluster.teardown()
            if temporary_dir is not None:
                shutil.rmtree(temporary_dir, ignore_errors=True)
            if churn_error is not None:
                err.write(f"mlfabric launch: {churn_error}\n")


def _supervise(ranks: list[_Rank], spec: LaunchSpec, err: IO[str], lock: threading.Lock,
               churn: ChurnRunner | None) -> int:
    deadline = None if spec.timeout_s is None else time.monotonic() + spec.timeout_s
    first_failure: _Rank | None = None
    while True:
        now = time.monotonic()
        for r in ranks:
            if r.code is None and (code := r.proc.poll()) is not None:
                r.code, r.ended_at = code, now
                if code != 0 and first_failure is None:
                    first_failure = r
                    with lock:
                        err.write(f"mlfabric launch: rank {r.rank} exited with status {_exit_code(code)}; "
                                  f"the others get {spec.grace_s:g}s before they are killed\n")
        if all(r.code is not None for r in ranks):
            break
        if first_failure is not None and now > first_failure.ended_at + spec.grace_s:
            break
        if churn is not None and churn.error is not None:
            with lock:
                err.write(f"mlfabric launch: bandwidth churn failed ({churn.error}); stopping the ranks\n")
            return 1
        if deadline is not None and now > deadline:
            pending = [r.rank for r in ranks if r.code is None]
            with lock:
                err.write(f"mlfabric launch: ranks {pending} still running after {spec.timeout_s:g}s; killing them\n")
            return 124
        time.sleep(0.05)
    for r in ranks:
        for thread in r.threads:
            thread.join(timeout=2.0)
    return 0 if first_failure is None else _exit_code(first_failure.code or 1)


def _stop_ranks(ranks: Sequence[_Rank], grace_s: float) -> None:
    """SIGTERM the ranks still running (their whole process group), SIGKILL after ``grace_s``."""
    alive = [r for r in ranks if r.proc.poll() is None]
    for r in alive:
        try:
            os.killpg(r.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for r in alive:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            r.proc.wait(timeout=5.0)
    for r in ranks:
        for thread in r.threads:
            thread.join(timeout=1.0)
