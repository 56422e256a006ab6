"""The settings of one parameter-server instance, shared by every role of the job.

    python -m pytest tests/unit/test_ps.py -k config
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .consistency import Consistency

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class PSConfig:
    """``consistency``: bsp, ssp:s or async[:tau] (:mod:`mlfabric.ps.consistency`).
    ``timeout_s`` bounds every wait (a pull, an init, an allreduce). ``lost_worker_wait_s``:
    how long BSP rounds wait for a worker that was lost before going on without it.
    ``session`` keeps consecutive PS instances of one job apart (every rank must create them
    in the same order). ``routing``: the routing policy's name (:mod:`mlfabric.ps.policy`'s registry).
    ``seed`` seeds the allreduce roots (the same on every rank)."""

    consistency: Consistency = field(default_factory=Consistency)
    timeout_s: float = DEFAULT_TIMEOUT_S
    lost_worker_wait_s: float | None = None  # default: timeout_s / 6
    session: int = 0
    routing: str = "direct"
    seed: int = 0
    #: The ``scheduled`` policy's settings (:class:`mlfabric.ps.policies.scheduled.ScheduledSettings`);
    #: None: the defaults.
    scheduled: Any = None
    #: The ``mlnet`` policy's settings (:class:`mlfabric.ps.policies.mlnet.MLNetSettings`: the trees);
    #: None: binary trees.
    mlnet: Any = None
    #: Checkpoint each shard to ``checkpoint_dir`` every ``checkpoint_every`` versions (0: never;
    #: :mod:`mlfabric.ps.checkpoint`, the baseline of MLfabric's replication).
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    #: Pace the answers to ordered pulls (TicTac, :mod:`mlfabric.ps.policies.ordered`) at equal shares
    #: of the server's NIC when its rate is known (:func:`mlfabric.ps.policies.ordered.pace_fairly`):
    #: every worker then gets its tensors at a steady share, which suits forward passes that
    #: all wait for the slowest worker; unpaced, the TCP flows share unevenly, which staggers
    #: the workers, and training gains from that (the first ones push while the last pull).
    pace_ordered_pulls: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.consistency, str):
            object.__setattr__(self, "consistency", Consistency.parse(self.consistency))
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.lost_worker_wait_s is None:
            object.__setattr__(self, "lost_worker_wait_s", self.timeout_s / 6)
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint_dir):
            raise ValueError(f"checkpoint_every must be >= 0 and needs a checkpoint_dir, got "
                             f"{self.checkpoint_every}, {self.checkpoint_dir!r}")
        if not self.lost_worker_wait_s >= 0:
            raise ValueError(f"lost_worker_wait_s must be >= 0, got {self.lost_worker_wait_s}")
        if self.lost_worker_wait_s >= self.timeout_s and self.consistency.kind == "bsp":
            raise ValueError(f"lost_worker_wait_s ({self.lost_worker_wait_s}) must be below timeout_s "
                             f"({self.timeout_s}): BSP pulls would time out before a lost worker is given up on")
        # the policy says which consistency models (and settings) it runs under
        from .policy import validate_policy

        validate_policy(self)
