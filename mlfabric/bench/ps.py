"""Parameter-server incast benchmark: W workers push and pull a model through S servers on an emulated star.

    mlfabric bench ps --workers 8 --servers 1 --model-size 64MB --rate 1gbit --iterations 3 --json out.json  # root

Runs a real :mod:`mlfabric.ps` job (BSP, direct routing, the plain TCP transport by default)
on an emulated star of ``S + W`` hosts (:func:`mlfabric.emu.launcher.emulated_launch`): rank
``j < S`` is server ``j`` on host ``j``, worker ``i`` is rank ``S + i`` on host ``S + i``,
every NIC shaped to ``rate`` in both directions. Each iteration, every worker pushes its
gradient (the whole model, float32), calls ``clock()`` and pulls the model back; the server
sums the round, applies it (SGD, lr 1) once every worker's clock is in and answers the pulls.
That is incast twice: W flows into the server's NIC (push), then W flows out of it (pull).

**How it is timed** (timestamps taken in the ranks; ranks on one machine share CLOCK_MONOTONIC):

* ``t0``: the workers start each iteration's push at one instant, ``align_margin_s`` after the
  last worker finished the previous iteration (a max-allreduce over a gloo group of the
  workers; the server is not in it and just serves). The gradient's norm (MLfabric's
  ``update_norm``) is computed before ``t0``; the push's own copy of the gradient is timed.
* ``t_close``: the server's update callback runs when its BSP round closes, i.e. when the
  last push of the round (and the clock behind it) was taken from the transport and added
  into the round's sum; ``t_answer``: the server's request callback runs just before the first
  pull of the round is handed to the transport; ``t_pulled``: each worker, when ``pull``
  returned the whole model; the round's end is the last worker's.
* **push phase** ``t0 -> t_close``; server NIC **ingress goodput** = W x shard bytes (payload)
  / push phase. **pull phase** ``t_answer -> t_pulled``; **egress goodput** = W x shard bytes /
  pull phase. Both as a fraction of the NIC rate; the issue's bar is >= 0.9 each way. What
  lies between (``gap``: applying the round, the snapshot the replies send) counts in the
  iteration, not in either phase. With several servers each gets its own figures; the pull
  phase then ends when the last worker holds *every* shard (a lower bound per server).
* Cross-check, **nic**: a thread in each server samples ``rx_bytes``/``tx_bytes`` of its NIC
  (``/sys/class/net/<dev>/statistics`` inside its namespace) every ``sample_interval_s``; the
  bytes counted in each phase (interpolated at its ends) over its duration. A veth counts a
  GSO/GRO packet of up to 64 KiB once, headers included once, so this is the payload plus
  well under 1%, not the frames the shaper charges (which carry 66 bytes of headers per
  1448 of payload): it checks the ranks' timestamps against the kernel's own count.
* **iteration** ``t0 -> t_pulled`` (last worker), the median over the timed iterations (the
  first ``warmup`` are not counted: connection start, first-touch of buffers), against the
  simulator's time for the same iteration (:func:`mlfabric.sim.workloads.simulate_ps`: the same
  placement, model size, star and BSP, no compute) at the nominal NIC rate and at the rate
  the emulator's own reference measurement gives (one TCP flow between hosts 0 and 1, warm-up
  left out, :func:`mlfabric.emu.goodput.two_host_goodput_bps`, measured on the same cluster
  just before the job): a TCP payload can use at most 1448/1514 = 0.956 of an Ethernet link.
  The issue's bar is within 10%.

Every pulled model is checked against the exact BSP result (gradients ``(k mod 7) + i + 1``
for element ``k`` of worker ``i``), after the timestamp. :func:`run_ps_bench` returns a
:class:`PSBenchResult` (``to_dict`` for JSON, :func:`render_tables` for the terminal).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mlfabric.bench.procs import ALIGN_MARGIN_S, aligned_start, rank_env, report, run_ranks, sleep_until

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "GOODPUT_BAR", "SIM_AGREEMENT", "PSBenchConfig", "PSBenchError", "PSBenchResult", "PSIteration", "PSServerPhase",
    "render_tables", "run_ps_bench", "simulated_ps_phases",
]

ELEMENT_BYTES = 4  # float32
#: The issue's bars: server NIC goodput >= 0.9 of the rate each way; emulated vs simulated within 10%.
GOODPUT_BAR = 0.9
SIM_AGREEMENT = 0.10
LR = 1.0
MODEL = "model"


class PSBenchError(RuntimeError):
    """The benchmark could not run, or a pulled model was wrong."""


@dataclass(frozen=True, kw_only=True)
class PSBenchConfig:
    """``workers`` workers and ``servers`` servers, one per host of an emulated star with NICs
    at ``rate_bps``; a float32 model of ``model_bytes`` (rounded down to whole elements),
    ``iterations`` iterations of which the first ``warmup`` are not counted."""

    workers: int = 8
    servers: int = 1
    model_bytes: int = 64_000_000
    rate_bps: float = 1e9
    iterations: int = 3
    warmup: int = 1
    transport: str = "tcp"
    #: Bounds the whole run (the launch); ``ps_timeout_s`` every wait inside the PS job.
    timeout_s: float = 900.0
    ps_timeout_s: float = 180.0
    #: Measure one TCP flow's goodput between hosts 0 and 1 first (2.5 s) and simulate at it too.
    measure_goodput: bool = True
    sample_interval_s: float = 0.01
    align_margin_s: float = ALIGN_MARGIN_S

    def __post_init__(self) -> None:
        from mlfabric import TRANSPORTS

        if self.workers < 1 or self.servers < 1:
            raise ValueError(f"need at least one worker and one server, got workers={self.workers}, "
                             f"servers={self.servers}")
        if self.model_bytes // ELEMENT_BYTES < self.servers:
            raise ValueError(f"model of {self.model_bytes} B has fewer float32 elements than servers ({self.servers})")
        if not self.rate_bps >= 8000:
            raise ValueError(f"rate must be at least 8 kbit/s, got {self.rate_bps} bit/s")
        if self.iterations < 1 or not 0 <= self.warmup < self.iterations:
            raise ValueError(f"need iterations >= 1 and 0 <= warmup < iterations, got iterations={self.iterations}, "
                             f"warmup={self.warmup}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if not (self.timeout_s > 0 and self.ps_timeout_s > 0 and self.sample_interval_s > 0
                and self.align_margin_s >= 0):
            raise ValueError("timeout_s, ps_timeout_s and sample_interval_s must be positive, align_margin_s >= 0")

    @property
    def hosts(self) -> int:
        return self.servers + self.workers

    @property
    def topology(self) -> str:
        return f"star:n={self.hosts}"

    @property
    def numel(self) -> int:
        return self.model_bytes // ELEMENT_BYTES

    def shard_bytes(self) -> list[int]:
        """Bytes of each server's shard (the runtime's even split, :meth:`ModelSpec.shards`)."""
        from mlfabric.collectives.partition import piece_sizes

        return [n * ELEMENT_BYTES for n in piece_sizes(self.numel, self.servers)]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True)
class PSServerPhase:
    """One server in one iteration (seconds; fractions of the NIC rate)."""

    server: int
    push_s: float              # t0 -> round closed at this server
    gap_s: float               # round closed -> first pull answered
    pull_s: float              # first pull answered -> last worker held the model
    ingress_goodput: float     # W x shard payload / push_s, over the NIC rate
    egress_goodput: float      # W x shard payload / pull_s, over the NIC rate
    ingress_nic: float | None   # NIC rx_bytes counted in the push phase / push_s, over the rate
    egress_nic: float | None    # NIC tx_bytes counted in the pull phase / pull_s, over the rate


@dataclass(frozen=True, kw_only=True)
class PSIteration:
    index: int
    warmup: bool
    iteration_s: float         # t0 -> last worker held the whole model
    late_starts: int           # workers that reached t0 only after it
    correct: bool
    servers: tuple[PSServerPhase, ...]

    @property
    def ingress_goodput(self) -> float:
        return min(s.ingress_goodput for s in self.servers)

    @property
    def egress_goodput(self) -> float:
        return min(s.egress_goodput for s in self.servers)


@dataclass(frozen=True, kw_only=True)
class PSBenchResult:
    config: PSBenchConfig
    iterations: tuple[PSIteration, ...]
    #: Simulated push phase, pull phase and iteration (s) at the nominal rate, and at the
    #: measured two-host goodput (None when not measured).
    simulated: dict[str, float]
    simulated_at_goodput: dict[str, float] | None
    two_host_goodput_bps: float | None
    server_stats: tuple[dict[str, Any], ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def timed(self) -> tuple[PSIteration, ...]:
        return tuple(it for it in self.iterations if not it.warmup)

    def median(self, value: Callable[[PSIteration], float]) -> float:
        return statistics.median(value(it) for it in self.timed)

    def summary(self) -> dict[str, Any]:
        """Medians over the timed iterations, the bars and whether they are met."""
        iteration = self.median(lambda it: it.iteration_s)
        push = self.median(lambda it: max(s.push_s for s in it.servers))
        pull = self.median(lambda it: max(s.pull_s for s in it.servers))
        gap = self.median(lambda it: max(s.gap_s for s in it.servers))
        ingress = self.median(lambda it: it.ingress_goodput)
        egress = self.median(lambda it: it.egress_goodput)
        wires = [(s.ingress_nic, s.egress_nic) for it in self.timed for s in it.servers]
        out: dict[str, Any] = {
            "iteration_s": iteration, "push_s": push, "gap_s": gap, "pull_s": pull,
            "ingress_goodput": ingress, "egress_goodput": egress,
            "ingress_nic": _median_or_none([w[0] for w in wires]),
            "egress_nic": _median_or_none([w[1] for w in wires]),
            "simulated_iteration_s": self.simulated["iteration_s"],
            "emulated_vs_simulated": iteration / self.simulated["iteration_s"],
            "simulated_at_goodput_iteration_s": None, "emulated_vs_simulated_at_goodput": None,
            "goodput_bar_met": min(ingress, egress) >= GOODPUT_BAR,
            "correct": all(it.correct for it in self.iterations),
        }
        if self.simulated_at_goodput is not None:
            out["simulated_at_goodput_iteration_s"] = self.simulated_at_goodput["iteration_s"]
            out["emulated_vs_simulated_at_goodput"] = iteration / self.simulated_at_goodput["iteration_s"]
        out["sim_bar_met"] = abs(out["emulated_vs_simulated"] - 1.0) <= SIM_AGREEMENT
        if out["emulated_vs_simulated_at_goodput"] is not None:
            out["sim_at_goodput_bar_met"] = abs(out["emulated_vs_simulated_at_goodput"] - 1.0) <= SIM_AGREEMENT
        return out

    def to_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config.update(topology=self.config.topology, shard_bytes=self.config.shard_bytes(),
                      worker_hosts=list(range(self.config.servers, self.config.hosts)),
                      server_hosts=list(range(self.config.servers)), consistency="bsp", routing="direct",
                      dtype="float32")
        return {
            "benchmark": "ps-incast",
            "command": self.metadata.get("command"),
            "date": self.metadata.get("date"),
            "machine": self.metadata.get("machine"),
            "metadata": self.metadata,
            "config": config,
            "units": {"time": "s", "size": "bytes", "rate": "bit/s",
                      "goodput": "payload bit/s over the NIC rate", "nic": "NIC byte-counter bit/s over the NIC rate"},
            "bars": {"goodput_min": GOODPUT_BAR, "emulated_vs_simulated_within": SIM_AGREEMENT},
            "summary": self.summary(),
            "two_host_goodput_bps": self.two_host_goodput_bps,
            "simulated": self.simulated,
            "simulated_at_goodput": self.simulated_at_goodput,
            "iterations": [{**{k: v for k, v in asdict(it).items() if k != "servers"},
                            "servers": [asdict(s) for s in it.servers]} for it in self.iterations],
            "server_stats": list(self.server_stats),
        }


def _median_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# --------------------------------------------------------------------------- simulation


def simulated_ps_phases(config: PSBenchConfig, rate_bps: float) -> dict[str, float]:
    """The simulator's push phase (every push arrived), pull phase and iteration (s) for one
    BSP iteration of ``config`` on its star with every link at ``rate_bps``: workers on hosts
    ``S..S+W-1``, servers on ``0..S-1``, no compute (as emulated: the gradient is ready at t0)."""
    import numpy as np

    from mlfabric.sim.workloads import PSConfig, iteration_times, simulate_ps

    ps = PSConfig(workers=config.workers, servers=config.servers, model_bytes=config.numel * ELEMENT_BYTES,
                  worker_hosts=tuple(range(config.servers, config.hosts)), server_hosts=tuple(range(config.servers)),
                  staleness=0, iterations=1, name="ps-incast")
    result = simulate_ps(config.topology, rate_bps, ps)
    g = result.graph
    aggregate = g.label == g.label_names.index("aggregate")
    push = float(np.max(result.task_finish_s[aggregate]))
    iteration = float(iteration_times(result, 1, config.workers)[0])
    return {"rate_bps": float(rate_bps), "push_s": push, "pull_s": iteration - push, "iteration_s": iteration}


# --------------------------------------------------------------------------- run


def collect_metadata(config: PSBenchConfig, argv: Sequence[str] | None) -> dict[str, Any]:
    import torch

    cores = os.cpu_count()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(argv if argv is not None else sys.argv),
        "machine": f"{cores}-core {platform.machine()} Linux VM, emulated {config.topology} at "
                   f"{config.rate_bps / 1e6:g} Mbit/s per NIC (netns + veth + htb)",
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": cores,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transport": config.transport,
        # Other processes on the machine take CPU from the ranks and the kernel's shaping.
        "loadavg_at_start": list(os.getloadavg()),
    }


def run_ps_bench(config: PSBenchConfig, *, argv: Sequence[str] | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 capture_output: bool = False) -> PSBenchResult:
    """Build the star, measure its two-host goodput, run the PS job on it, tear it down and
    summarize (root needed: :class:`mlfabric.emu.cmd.EmuUnavailableError` otherwise)."""
    from mlfabric.emu.cmd import EmuUnavailableError, have_root
    from mlfabric.emu.launcher import emulated_launch

    if not have_root():
        raise EmuUnavailableError("mlfabric bench ps runs on an emulated cluster and needs root "
                                  "(or CAP_NET_ADMIN + CAP_SYS_ADMIN): run it under sudo")
    built: dict[str, Any] = {}

    def on_built(plan: Any) -> None:
        built["devices"] = [plan.hosts[j].nics[0].host_dev for j in range(config.servers)]
        if config.measure_goodput:
            from mlfabric.emu.goodput import two_host_goodput_bps

            built["goodput_bps"] = two_host_goodput_bps(plan)

    def on_report(rank: int, payload: Any) -> None:
        if on_progress is not None:
            on_progress(int(payload), config.iterations)

    metadata = collect_metadata(config, argv)
    with emulated_launch(config.topology, config.rate_bps, on_built=on_built, timeout_s=config.timeout_s,
                         capture_output=capture_output) as launch:
        records = run_ranks(_rank_main, config=launch, args=(config, tuple(built["devices"])), on_report=on_report)
    metadata["loadavg_at_end"] = list(os.getloadavg())
    servers: list[_ServerRecord] = records[:config.servers]
    workers: list[_WorkerRecord] = records[config.servers:]
    iterations = _iterations(config, servers, workers)
    goodput = built.get("goodput_bps")
    return PSBenchResult(
        config=config, iterations=iterations, simulated=simulated_ps_phases(config, config.rate_bps),
        simulated_at_goodput=None if goodput is None else simulated_ps_phases(config, goodput),
        two_host_goodput_bps=goodput, server_stats=tuple(s.stats for s in servers),
        metadata=metadata)


def _iterations(config: PSBenchConfig, servers: list[_ServerRecord],
                workers: list[_WorkerRecord]) -> tuple[PSIteration, ...]:
    """Per iteration and server, the phases from the ranks' timestamps (module docstring)."""
    import numpy as np

    w = config.workers
    rate = config.rate_bps
    shards = config.shard_bytes()
    for s in servers:
        if len(s.closes) != config.iterations or len(s.answers) != config.iterations * w:
            raise PSBenchError(f"server {s.server} closed {len(s.closes)} rounds and answered {len(s.answers)} "
                               f"pulls; expected {config.iterations} and {config.iterations * w}")
    out = []
    for k in range(config.iterations):
        t0 = max(wr.starts[k] for wr in workers)
        pulled = max(wr.pulled[k] for wr in workers)
        phases = []
        for s in servers:
            closed = s.closes[k]
            answered = min(s.answers[k * w:(k + 1) * w])
            push_s, pull_s = closed - t0, pulled - answered
            if push_s <= 0 or pull_s <= 0:
                raise PSBenchError(f"iteration {k}, server {s.server}: timestamps out of order (t0 {t0:.6f}, round "
                                   f"closed {closed:.6f}, answered {answered:.6f}, pulled {pulled:.6f})")
            payload_bits = w * shards[s.server] * 8
            nic_in = nic_out = None
            if len(s.samples) >= 2:
                t, rx, tx = (np.asarray(col, dtype=np.float64) for col in zip(*s.samples))
                if t[0] <= t0 and t[-1] >= pulled:
                    nic_in = float(np.interp(closed, t, rx) - np.interp(t0, t, rx)) * 8 / push_s / rate
                    nic_out = float(np.interp(pulled, t, tx) - np.interp(answered, t, tx)) * 8 / pull_s / rate
            phases.append(PSServerPhase(server=s.server, push_s=push_s, gap_s=answered - closed, pull_s=pull_s,
                                        ingress_goodput=payload_bits / push_s / rate,
                                        egress_goodput=payload_bits / pull_s / rate,
                                        ingress_nic=nic_in, egress_nic=nic_out))
        out.append(PSIteration(index=k, warmup=k < config.warmup, iteration_s=pulled - t0,
                               late_starts=sum(not wr.on_time[k] for wr in workers),
                               correct=all(wr.correct[k] for wr in workers), servers=tuple(phases)))
    return tuple(out)


# --------------------------------------------------------------------------- inside a rank


@dataclass(frozen=True, kw_only=True)
class _ServerRecord:
    server: int
    closes: list[float]                      # per round: when its update callback ran
    answers: list[float]                     # per pull answered, in order
    samples: list[tuple[float, int, int]]    # (monotonic s, rx_bytes, tx_bytes) of the server's NIC
    stats: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class _WorkerRecord:
    worker: int
    starts: list[float]     # the aligned instant of each iteration
    on_time: list[bool]     # reached it before it passed
    pulled: list[float]     # pull returned the whole model
    correct: list[bool]


def _rank_main(config: PSBenchConfig, devices: tuple[str, ...]) -> _ServerRecord | _WorkerRecord:
    from datetime import timedelta

    import torch.distributed as dist

    import mlfabric.ps

    env = rank_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=config.ps_timeout_s))
    try:
        # Every rank creates the workers' group (torch requires it); only workers use it.
        group = dist.new_group(ranks=list(range(config.servers, config.hosts)))
        job = mlfabric.ps.init(servers=config.servers, consistency="bsp", transport=config.transport,
                               timeout=config.ps_timeout_s)
        try:
            if job.role == "server":
                return _serve(job, config, devices[env.rank])
            return _work(job, config, group)
        finally:
            job.close()
    finally:
        dist.destroy_process_group()


class _NicSampler:
    """A thread that reads ``dev``'s byte counters every ``interval_s`` (bounded by ``stop``)."""

    def __init__(self, dev: str, interval_s: float) -> None:
        base = f"/sys/class/net/{dev}/statistics"
        self._paths = (f"{base}/rx_bytes", f"{base}/tx_bytes")
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlfabric-bench-nic", daemon=True)

    def _read(self) -> tuple[float, int, int]:
        rx, tx = (int(open(path).read()) for path in self._paths)  # noqa: SIM115 - tiny sysfs reads
        return time.monotonic(), rx, tx

    def _run(self) -> None:
        while True:
            self.samples.append(self._read())
            if self._stop.wait(self.interval_s):
                self.samples.append(self._read())
                return

    def __enter__(self) -> "_NicSampler":
        self._read()  # fail here, not in the thread, if the device is not there
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _serve(job: Any, config: PSBenchConfig, device: str) -> _ServerRecord:
    from mlfabric.ps.rules import SGDMomentum

    server = job.server
    closes: list[float] = []
    answers: list[float] = []
    rule = SGDMomentum(LR)

    def on_update(shard: Any, gradient: Any, info: Any) -> None:
        closes.append(time.monotonic())
        rule(shard, gradient, info)

    def on_request(model: str, worker: int, shard: Any) -> None:
        answers.append(time.monotonic())
        return None  # answer with the shard itself

    server.register_update_callback(on_update)
    server.register_request_callback(on_request)
    with _NicSampler(device, config.sample_interval_s) as sampler:
        stats = job.serve()
    return _ServerRecord(server=server.server, closes=closes, answers=answers, samples=sampler.samples,
                         stats=stats.as_dict())


def _work(job: Any, config: PSBenchConfig, group: Any) -> _WorkerRecord:
    import torch

    worker = job.worker
    n = config.numel
    pattern = (torch.arange(n, dtype=torch.int64) % 7).to(torch.float32)
    gradient = pattern + float(worker.index + 1)
    norm = float(torch.linalg.vector_norm(gradient.double()))
    # BSP with lr 1 applies minus the mean gradient per round: pattern + (W + 1) / 2.
    step = pattern.double() + (config.workers + 1) / 2
    worker.init_model(MODEL, torch.zeros(n, dtype=torch.float32), lr=LR)  # one tensor, key "0"
    model = torch.empty(n, dtype=torch.float32)
    record = _WorkerRecord(worker=worker.index, starts=[], on_time=[], pulled=[], correct=[])

    def latest(t: float) -> float:
        import torch.distributed as dist

        value = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return float(value[0])

    for k in range(config.iterations):
        start = aligned_start(latest, config.align_margin_s)
        record.on_time.append(sleep_until(start))
        record.starts.append(start)
        worker.push(MODEL, gradient, norm)
        worker.clock()
        worker.pull_flat(MODEL, out=model)
        record.pulled.append(time.monotonic())
        expected = step * -(k + 1) * LR
        record.correct.append(bool(torch.allclose(model.double(), expected, rtol=1e-6, atol=1e-5)))
        if worker.index == 0:
            report(k + 1)
    return record


# --------------------------------------------------------------------------- presentation


def render_tables(result: PSBenchResult) -> list[Table]:
    """Two rich tables (80 columns): per iteration, then the summary against bars and simulator."""
    from rich import box
    from rich.table import Table

    from mlfabric.units import format_size

    config = result.config
    rate = f"{config.rate_bps / 1e6:g} Mbit/s"
    per = Table(title=f"ps incast: {config.workers} workers, {config.servers} server(s), "
                      f"{format_size(config.numel * ELEMENT_BYTES)} float32, {config.topology} at {rate}, "
                      f"{config.transport}, BSP",
                caption="in/out: server NIC goodput (payload) / NIC rate during push/pull; nic: its byte "
                        "counters", caption_justify="left", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("it", "time s", "push s", "gap s", "pull s", "in", "out", "in nic", "out nic"):
        per.add_column(name, justify="right", no_wrap=True)
    for it in result.iterations:
        for s in it.servers:
            label = f"{it.index}{'w' if it.warmup else ''}" + (f"/s{s.server}" if config.servers > 1 else "")
            per.add_row(label, f"{it.iteration_s:.3f}" if s.server == 0 else "", f"{s.push_s:.3f}",
                        f"{s.gap_s:.3f}", f"{s.pull_s:.3f}", _frac(s.ingress_goodput, GOODPUT_BAR),
                        _frac(s.egress_goodput, GOODPUT_BAR), _opt(s.ingress_nic), _opt(s.egress_nic))
    summary = result.summary()
    tab = Table(title=f"median of {len(result.timed)} timed iteration(s) (w: warm-up, not counted); "
                      f"goodput = payload / NIC rate, bar >= {GOODPUT_BAR:g}; emu/sim bar "
                      f"{1 - SIM_AGREEMENT:g}..{1 + SIM_AGREEMENT:g}",
                title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("figure", "left"), ("emulated", "right"), ("simulated", "right"), ("emu/sim", "right")):
        tab.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    sim = result.simulated
    tab.add_row(f"iteration s (sim at {rate})", f"{summary['iteration_s']:.3f}", f"{sim['iteration_s']:.3f}",
                _ratio(summary["emulated_vs_simulated"]))
    at = result.simulated_at_goodput
    if at is not None:
        tab.add_row(f"iteration s (sim at {at['rate_bps'] / 1e6:.1f} Mbit/s)", f"{summary['iteration_s']:.3f}",
                    f"{at['iteration_s']:.3f}", _ratio(summary["emulated_vs_simulated_at_goodput"]))
    tab.add_row("push phase s", f"{summary['push_s']:.3f}", f"{sim['push_s']:.3f}",
                f"{summary['push_s'] / sim['push_s']:.3f}")
    tab.add_row("pull phase s", f"{summary['pull_s']:.3f}", f"{sim['pull_s']:.3f}",
                f"{summary['pull_s'] / sim['pull_s']:.3f}")
    tab.add_row("server gap s", f"{summary['gap_s']:.3f}", "0.000", "")
    tab.add_row("ingress goodput (push)", _frac(summary["ingress_goodput"], GOODPUT_BAR), "", "")
    tab.add_row("egress goodput (pull)", _frac(summary["egress_goodput"], GOODPUT_BAR), "", "")
    tab.add_row("in / out NIC counters", f"{_opt(summary['ingress_nic'])} / {_opt(summary['egress_nic'])}", "", "")
    if result.two_host_goodput_bps is not None:
        tab.add_row("two-host TCP goodput", f"{result.two_host_goodput_bps / config.rate_bps:.3f}", "", "")
    tab.add_row("pulled models correct", "yes" if summary["correct"] else "[red]NO[/]", "", "")
    return [per, tab]


def _frac(value: float, bar: float) -> str:
    return f"[{'green' if value >= bar else 'red'}]{value:.3f}[/]"


def _ratio(value: float | None) -> str:
    if value is None:
        return ""
    return f"[{'green' if abs(value - 1.0) <= SIM_AGREEMENT else 'red'}]{value:.3f}[/]"


def _opt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
