"""Reports of simulation runs: the rows of the CLI table and the link-load / makespan plot.

``plot_results`` needs matplotlib, which mlfabric does not depend on; without it,
:func:`require_matplotlib` raises a ``RuntimeError`` that says to ``pip install matplotlib``
(the CLI checks this before simulating).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_sim.py -q -k "cli or plot"
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.units import format_size

from .engine import SimResult

__all__ = ["require_matplotlib", "plot_results", "summary_rows"]

PLOT_HELP = "--plot needs matplotlib, which is not installed: pip install matplotlib"


def require_matplotlib() -> Any:
    """Import matplotlib with a non-interactive backend, or raise a RuntimeError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(PLOT_HELP) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def summary_rows(result: SimResult) -> list[tuple[str, str]]:
    """(name, value) rows: times, counts and link loads, for a table."""
    rows = [
        ("simulated time", f"{result.time_s:.6g} s"),
        ("topology", f"{result.topology.spec} ({result.topology.n_hosts} hosts, "
                     f"{result.topology.link_rate_bps / 1e9:g} Gbps host links)"),
        ("routing", f"{result.config.routing} (seed {result.config.seed})"),
        ("tasks / flows / events", f"{result.graph.n_tasks} / {result.flows} / {result.events}"),
        ("wall time", f"{result.wall_s:.3f} s"),
    ]
    if len(result.graph.job_names) > 1:
        times = result.job_time_s
        rows.append(("job makespans", f"min {times.min():.6g} s, median {float(np.median(times)):.6g} s, "
                                      f"max {times.max():.6g} s ({times.size} jobs)"))
    summary = result.link_summary()
    rows.append(("bytes on links", f"{format_size(summary['total_bytes'])} total, "
                                   f"{format_size(summary['max_bytes'])} on the busiest link, "
                                   f"{summary['busy_links']} links used"))
    for layer, figures in summary["layers"].items():
        if figures["total_bytes"]:
            rows.append((f"  {layer}", f"max {format_size(figures['max_bytes'])}, "
                                       f"mean {format_size(figures['mean_bytes'])} over {figures['links']} links"))
    return rows


def plot_results(results: Sequence[tuple[str, SimResult]], path: str | Path, *, title: str = "") -> Path:
    """Draw the CDF of bytes per link (links that carried traffic; MLNET Fig. 2) and the
    makespan of every job of every run, side by side, into ``path`` (PNG, PDF, ...)."""
    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, result in results:
        used = np.sort(result.link_bytes[result.link_bytes > 0])
        if used.size:
            left.step(used / 1e6, np.arange(1, used.size + 1) / used.size, where="post", label=label)
    left.set_xlabel("traffic per link (MB)")
    left.set_ylabel("CDF of links")
    left.grid(alpha=0.3)
    left.legend(loc="lower right")
    names: list[str] = []
    values: list[float] = []
    for label, result in results:
        for job, t in zip(result.graph.job_names, result.job_time_s):
            names.append(label if len(result.graph.job_names) == 1 else f"{label}/{job}")
            values.append(float(t))
    right.bar(range(len(values)), values)
    right.set_xticks(range(len(values)), names, rotation=60 if len(values) > 6 else 0, ha="right" if len(values) > 6 else "center")
    right.set_ylabel("makespan (s)")
    right.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
