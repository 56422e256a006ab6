"""Build the optional compiled kernel of the flow solver (mlfabric/flow/_fill.c).

Everything else is in pyproject.toml. ``optional=True``: without a C compiler the install
still succeeds and ``mlfabric.flow`` uses its numpy path (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mlfabric.flow._fill", ["mlfabric/flow/_fill.c", "mlfabric/flow/_events.c"], depends=["mlfabric/flow/_fill.h"],
                  optional=True, extra_compile_args=["-O2"]),
    ]
)
