"""Checkpointing a server's shards to local files: the baseline MLfabric's replication is
measured against (§7.3, "checkpointing at the server every n updates", as MPI jobs do).

    python -m pytest tests/unit/test_ps_divergence.py -q -k checkpoint

With ``PSConfig(checkpoint_every=n, checkpoint_dir=DIR)`` a server writes each of its shards
to ``DIR/<model>.server<j>.pt`` whenever the shard's version passes a multiple of ``n``:
values, version and the rule's update history (what a restart needs to go on with eq. (2)
as before). The file is written beside and renamed over the old one, so a crash mid-write
leaves the previous checkpoint whole. The time it takes is the overhead the comparison
measures (``ServerStats.checkpoints``, ``checkpoint_s``, ``checkpoint_bytes``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["checkpoint_path", "read_checkpoint", "write_checkpoint"]


def checkpoint_path(directory: str | os.PathLike[str], model: str, server: int) -> Path:
    return Path(directory) / f"{model}.server{server}.pt"


def write_checkpoint(path: Path, *, values: torch.Tensor, version: int, history: torch.Tensor | None,
                     offset: int, lr: float, momentum: float) -> int:
    """Write one shard atomically; returns the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save({"values": values, "version": version, "history": history, "offset": offset, "lr": lr,
                "momentum": momentum}, partial)
    size = partial.stat().st_size
    os.replace(partial, path)
    return size


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A shard as :func:`write_checkpoint` wrote it."""
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, weights_only=True)
