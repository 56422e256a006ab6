"""Flow-level network model: max-min fair rates (water-filling), certificates, incremental updates.

Shared by the simulator's event engine (``mlfabric.sim``) and the parameter-server scheduler
(``mlfabric.ps``); it knows nothing about either, nor about topologies: flows are rows of an
:class:`Incidence` (which links each flow crosses, with weights for split flows), links are
entries of a capacity array (bit/s).

* :func:`solve_max_min` -- exact max-min fair rates, vectorized (``mlfabric.flow.maxmin``);
* :func:`check_certificate` -- independent proof that rates are max-min fair;
* :func:`naive_max_min` -- plain-Python progressive filling (baseline and cross-check);
* :class:`FlowNetwork` -- flows/capacities that change over time, re-solving only what changed;
* :func:`benchmark_solver` -- timings against the naive solver (``mlfabric.flow.bench``).

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_flow.py -q
    .venv/bin/python -m mlfabric.flow.bench
"""

from typing import Any

from mlfabric.flow.certificate import CertificateError, CertificateReport, check_certificate
from mlfabric.flow.incidence import Incidence
from mlfabric.flow.maxmin import DEFAULT_TIE_RTOL, MaxMinStats, solve_max_min, solve_max_min_with_stats
from mlfabric.flow.naive import naive_max_min
from mlfabric.flow.network import FlowNetwork, UpdateStats

__all__ = [
    "DEFAULT_TIE_RTOL",
    "BenchmarkConfig",
    "CertificateError",
    "CertificateReport",
    "FlowNetwork",
    "Incidence",
    "MaxMinStats",
    "UpdateStats",
    "benchmark_solver",
    "check_certificate",
    "format_benchmark",
    "naive_max_min",
    "solve_max_min",
    "solve_max_min_with_stats",
]

_BENCH_NAMES = ("BenchmarkConfig", "benchmark_solver", "format_benchmark")


def __getattr__(name: str) -> Any:
    # The benchmark is imported on first use, so that `python -m mlfabric.flow.bench` does
    # not find the module already imported by the package.
    if name in _BENCH_NAMES:
        from mlfabric.flow import bench

        return getattr(bench, name)
    raise AttributeError(f"module 'mlfabric.flow' has no attribute {name!r}")
