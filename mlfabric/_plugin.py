"""Registers the "mlfabric" torch.distributed backend, cheaply and without import cycles.

``import mlfabric`` registers it (:func:`register_backend_when_torch_loads`: at once if torch
is loaded, else as soon as it is, for ``import mlfabric`` does not import torch), and so does
torch itself at ``import torch`` through this package's ``torch.backends`` entry point (torch >= 2.5 loads that group;
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off), so that ``init_process_group("mlfabric")``
works in a script that never imports mlfabric. torch calls the entry point while it is still
initialising, possibly in the middle of ``import mlfabric`` itself: so this module imports
nothing of mlfabric, and the backend (``mlfabric/torch/backend.py``) is only imported when
the first process group is created.

Exercise it with ``python -m pytest tests/unit/test_torch_backend_options.py tests/unit/test_cli_startup.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

BACKEND_NAME = "mlfabric"
#: Tensors on these devices are accepted (CUDA tensors are staged through host memory).
DEVICES = ("cpu", "cuda")


def register_backend() -> None:
    """Make ``"mlfabric"`` a torch.distributed backend name; idempotent."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True,
                                  devices=list(DEVICES))


def register_backend_when_torch_loads() -> None:
    """``import mlfabric``'s registration: now if torch is loaded, else right after ``import torch``
    finishes (``import mlfabric`` does not import torch itself: the CLI starts without it). torch
    >= 2.5 also calls :func:`register_backend` through the entry point; this covers
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` and older torch."""
    if "torch" in sys.modules:
        register_backend()
    elif not any(isinstance(finder, _AfterTorchImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: finds ``torch`` through the other finders and wraps its loader
    so that :func:`register_backend` runs once torch's ``__init__`` has completed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot, and the search below must not find this finder
        spec = importlib.util.find_spec("torch")
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            register_backend()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]  # this spec's loader only
        return spec


def _create_process_group(store_and_ranks: object, options: object) -> object:
    """torch's hook for every new group of this backend (``extended_api``: it passes the
    store, ranks and timeout in ``store_and_ranks`` and ``pg_options`` as ``options``)."""
    from mlfabric.torch.backend import create_process_group

    return create_process_group(store_and_ranks, options)
