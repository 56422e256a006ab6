"""Build the optional compiled kernels: the flow solver's (mlfabric/flow/_fill.c) and the
MLfabric scheduler's (mlfabric/ps/scheduler/_sched.c).

Everything else is in pyproject.toml. ``optional=True``: without a C compiler the install
still succeeds and ``mlfabric.flow`` / ``mlfabric.ps.scheduler`` use their numpy/Python paths
(same results, slower). The scheduler's kernel must round exactly like Python, hence
``-ffp-contract=off`` (no fused multiply-add).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mlfabric.flow._fill", ["mlfabric/flow/_fill.c", "mlfabric/flow/_events.c"], depends=["mlfabric/flow/_fill.h"],
                  optional=True, extra_compile_args=["-O2"]),
        Extension("mlfabric.ps.scheduler._sched", ["mlfabric/ps/scheduler/_sched.c"], optional=True,
                  extra_compile_args=["-O2", "-ffp-contract=off"]),
    ]
)
