"""Scheduler scalability benchmark (MLfabric §7.4): fast scheduler vs the plain reference.

    mlfabric bench scheduler --updates 100,500,1000 --json out.json

The paper's setting: a batch of |U| updates on a star of |U|/2 hosts with a congestion-free
core, deadlines drawn from Uniform(1, 2|U|), random NIC rates. Here: host 0 is the server,
hosts 1..k the aggregators, every update comes from a uniformly drawn host 1..|U|/2-1 (so
about two per host), is 10-100 MB (uniform), and every NIC direction draws its rate from
the paper's §7 set {1, 2.5, 3.3, 5, 10} Gbps. ``tau_max = v_init = 2|U|`` and
``v(g) = dl(g)`` turn eq. 9 into ``dl(g) = v(g)``, the drawn deadline.

For each |U| and repeat the fast pipeline (:func:`~mlfabric.ps.scheduler.plan_batch`, with
the compiled loops of ``_sched.c`` when built) plans the batch; on the first
``reference_repeats`` batches the same pipeline on its Python path (``native=False``) and
the plain reference (:func:`~mlfabric.ps.scheduler.reference.reference_plan`) plan it too,
in the same process; the JSON's ``results[]`` carry the median ms per batch of each, the
ratios, and whether every decision of all three was identical.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from mlfabric.ps.scheduler import native
from mlfabric.ps.scheduler.netstate import NetState
from mlfabric.ps.scheduler.ordering import Batch
from mlfabric.ps.scheduler.reference import reference_plan
from mlfabric.ps.scheduler.scheduler import Plan, plan_batch

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["PAPER_MS", "SchedulerBenchConfig", "plan_key", "render_table", "run_scheduler_bench", "section_7_4_batch"]

PAPER_MS = {100: 30.0, 500: 440.0, 1000: 1460.0}
NIC_GBPS = (1.0, 2.5, 3.3, 5.0, 10.0)


@dataclass(frozen=True, kw_only=True)
class SchedulerBenchConfig:
    updates: tuple[int, ...] = (100, 500, 1000)
    repeats: int = 5
    """Batches per |U| for the fast scheduler (the median is reported)."""
    reference_repeats: int = 1
    """Batches per |U| the reference also plans (the first ``reference_repeats`` of them)."""
    aggregators: int = 2
    mode: str = "async"
    seed: int = 0
    trees: bool = False
    """#36: also plan every batch with pipelined trees (the same ordering, then
    :func:`~mlfabric.ps.scheduler.trees.tree_aggregate`), timed beside the fast pipeline."""
    chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.updates or any(u < 4 for u in self.updates):
            raise ValueError(f"updates must be >= 4 each, got {self.updates}")
        if self.repeats < 1 or not 0 <= self.reference_repeats <= self.repeats:
            raise ValueError("need repeats >= 1 and 0 <= reference_repeats <= repeats")
        if self.aggregators < 0 or any(u // 2 < self.aggregators + 2 for u in self.updates):
            raise ValueError("need |U|/2 >= aggregators + 2 hosts")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be async or sync, got {self.mode!r}")


def section_7_4_batch(n_updates: int, *, aggregators: int, seed: int, mode: str = "async"
                      ) -> tuple[Batch, NetState, list[tuple[int, ...]]]:
    rng = np.random.default_rng((seed, n_updates))
    hosts = n_updates // 2
    rates = np.asarray(NIC_GBPS) * 1e9 / 8  # bytes/s
    net = NetState(rng.choice(rates, hosts), rng.choice(rates, hosts))
    src = tuple(int(h) for h in rng.integers(1, hosts, n_updates))
    sizes = rng.uniform(10e6, 100e6, n_updates)
    deadlines = tuple(int(d) for d in rng.integers(1, 2 * n_updates + 1, n_updates)) if mode == "async" else None
    batch = Batch(src=src, sizes=sizes, servers=(0,), deadlines=deadlines)
    return batch, net, [(h,) for h in rng.permutation(np.arange(1, aggregators + 1)).tolist()]


def plan_key(plan: Plan) -> tuple[Any, ...]:
    """Everything the scheduler decides, for exact comparison (floats included)."""
    o, a = plan.ordered, plan.aggregated
    return (tuple((d.index, d.dropped, d.reason, d.position, d.end) for d in o.decisions), a.split,
            tuple((g.slot, g.members, g.ready, g.arrival, g.commit) for g in a.groups),
            tuple(sorted((g, tuple((t.end, t.times, t.rates) for t in trs)) for g, trs in a.member_transfers.items())),
            a.obj_async, a.obj_sync)


def _plan_trees(batch: Batch, net: NetState, objective: str, chunk_bytes: int) -> Plan:
    """What the scheduler runs with ``trees``: the ordering step, then the trees."""
    from mlfabric.ps.scheduler.ordering import order_updates
    from mlfabric.ps.scheduler.trees import tree_aggregate

    ordered = order_updates(batch, net)
    trees = tree_aggregate(batch, ordered, net=net, objective=objective,  # type: ignore[arg-type]
                           chunk_bytes=chunk_bytes)
    return Plan(ordered=ordered, aggregated=trees)


def _timed(fn: Callable[[], Plan]) -> tuple[float, Plan]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def run_scheduler_bench(config: SchedulerBenchConfig, *, argv: list[str] | None = None,
                        on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    objective = "async" if config.mode == "async" else "sync"
    results = []
    for u in config.updates:
        fast_ms, py_ms, ref_ms, identical, stats = [], [], [], True, []
        trees_ms: list[float] = []
        trees_groups: list[int] = []
        same_order = True
        for r in range(config.repeats):
            batch, net, hosts = section_7_4_batch(u, aggregators=config.aggregators, seed=config.seed + r,
                                                  mode=config.mode)
            if on_step:
                on_step(f"|U|={u} batch {r + 1}/{config.repeats}")
            ms, plan = _timed(lambda: plan_batch(batch, net, hosts, objective=objective))
            fast_ms.append(ms)
            if config.trees:
                tms, tplan = _timed(lambda: _plan_trees(batch, net, objective, config.chunk_bytes))
                trees_ms.append(tms)
                trees_groups.append(len(tplan.aggregated.groups))
                # the order (and so every delay) is the ordering step's, as without trees; the
                # MLfabric-S pipeline may pick its longest-first list instead, so only async compares
                same_order = same_order and (objective == "sync" or tplan.ordered.order == plan.ordered.order)
            agg = plan.aggregated
            stats.append((len(plan.ordered.order), agg.split, len(agg.groups), agg.splits_tried))
            if r < config.reference_repeats:
                if on_step:
                    on_step(f"|U|={u} batch {r + 1}: reference")
                pms, py = _timed(lambda: plan_batch(batch, net, hosts, objective=objective, native=False))
                py_ms.append(pms)
                rms, ref = _timed(lambda: reference_plan(batch, net, hosts, objective=objective))
                ref_ms.append(rms)
                identical = identical and plan_key(ref) == plan_key(plan) == plan_key(py)
        ms = statistics.median(fast_ms)
        rms = statistics.median(ref_ms) if ref_ms else None
        pms = statistics.median(py_ms) if py_ms else None
        results.append({
            "updates": u, "ms": ms, "python_ms": pms, "reference_ms": rms, "speedup": (rms / ms) if rms else None,
            "identical": identical if ref_ms else None, "paper_ms": PAPER_MS.get(u),
            "fast_ms_all": fast_ms, "python_ms_all": py_ms, "reference_ms_all": ref_ms,
            "kept_mean": float(np.mean([s[0] for s in stats])), "split_mean": float(np.mean([s[1] for s in stats])),
            "groups_mean": float(np.mean([s[2] for s in stats])),
            "splits_walked_mean": float(np.mean([s[3] for s in stats])),
            **({"trees_ms": statistics.median(trees_ms), "trees_ms_all": trees_ms,
                "trees_groups_mean": float(np.mean(trees_groups)), "trees_same_order": same_order}
               if config.trees else {}),
        })
    return {
        "command": " ".join(argv) if argv else None,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "processor": platform.machine()},
        "config": asdict(config),
        "compiled": native.available(),
        "results": results,
    }


def render_table(result: dict[str, Any]) -> "Table":
    from rich.table import Table

    table = Table(title=f"MLfabric scheduler per batch (§7.4 setting, {result['config']['aggregators']} aggregators, "
                        f"mode {result['config']['mode']})")
    fast = "fast ms" + (" (C)" if result.get("compiled") else " (Python)")
    trees = bool(result["config"].get("trees"))
    for col in ("|U|", fast, "python ms", "reference ms", "speedup", "identical", "paper ms", "kept", "split", "groups",
                "splits walked", *(("trees ms", "trees", "same order") if trees else ())):
        table.add_column(col, justify="right")
    for r in result["results"]:
        table.add_row(str(r["updates"]), f"{r['ms']:.2f}",
                      "-" if r.get("python_ms") is None else f"{r['python_ms']:.1f}",
                      "-" if r["reference_ms"] is None else f"{r['reference_ms']:.1f}",
                      "-" if r["speedup"] is None else f"{r['speedup']:.1f}x",
                      "-" if r["identical"] is None else ("yes" if r["identical"] else "NO"),
                      "-" if r["paper_ms"] is None else f"{r['paper_ms']:.0f}",
                      f"{r['kept_mean']:.0f}", f"{r['split_mean']:.0f}", f"{r['groups_mean']:.1f}",
                      f"{r['splits_walked_mean']:.0f}",
                      *((f"{r['trees_ms']:.2f}", f"{r['trees_groups_mean']:.1f}",
                         "yes" if r["trees_same_order"] else "NO") if trees else ()))
    return table
