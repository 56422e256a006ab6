"""Registers the "mlfabric" torch.distributed backend, cheaply and without import cycles.

``import mlfabric`` calls :func:`register_backend`, and so does torch itself at ``import
torch`` through this package's ``torch.backends`` entry point (torch >= 2.5 loads that group;
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off), so that ``init_process_group("mlfabric")``
works in a script that never imports mlfabric. torch calls the entry point while it is still
initialising, possibly in the middle of ``import mlfabric`` itself: so this module imports
nothing of mlfabric, and the backend (``mlfabric/torch/backend.py``) is only imported when
the first process group is created.

Exercise it with ``python -m pytest tests/unit/test_torch_backend_options.py``.
"""

from __future__ import annotations

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


def _create_process_group(store_and_ranks: object, options: object) -> object:
    """torch's hook for every new group of this backend (``extended_api``: it passes the
    store, ranks and timeout in ``store_and_ranks`` and ``pg_options`` as ``options``)."""
    from mlfabric.torch.backend import create_process_group

    return create_process_group(store_and_ranks, options)
