"""Lazily resolved package exports: the one helper behind ``mlfabric``'s, ``mlfabric.runtime``'s
and ``mlfabric.emu``'s public names, so that importing a light part of the package (the CLI,
``mlfabric --help``) does not import torch or numpy (issue #39: every command took ~3.4 s).

    __getattr__ = lazy_exports(__name__, {"Communicator": "runtime.communicator"}, submodules=True)

Checked by ``tests/unit/test_cli_startup.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str], *, submodules: bool = False) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``package``: ``names`` maps each public name to
    the submodule (relative to ``package``) that defines it; it is imported on first use and
    the value cached in the package. With ``submodules``, any other attribute that names a
    submodule imports it (``mlfabric.torch`` after a bare ``import mlfabric``)."""

    def __getattr__(name: str) -> Any:
        module = sys.modules[package]
        if name in names:
            value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
            setattr(module, name, value)
            return value
        if submodules and not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
