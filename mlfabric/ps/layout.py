"""Which rank plays which parameter-server role, from the rank and a layout.

    python -m pytest tests/unit/test_ps.py -k layout

One launch (``torchrun`` or ``mlfabric launch``) runs every role of a PS job: ranks
``0..S-1`` are the servers (server ``j`` holds shard ``j`` of every model), ranks
``S..S+R-1`` the replicas (replica ``i`` mirrors server ``i % S``), the rest are workers
(worker ``i`` is rank ``S + R + i``). Servers come first so that rank 0, which serves the
rendezvous store, is a process that lives as long as the job.

The layout comes from arguments or from ``MLFABRIC_PS_SERVERS`` / ``MLFABRIC_PS_REPLICAS``
(``mlfabric train --servers``/``--replicas`` set them for every rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SERVERS_ENV = "MLFABRIC_PS_SERVERS"
REPLICAS_ENV = "MLFABRIC_PS_REPLICAS"
ROLES = ("server", "replica", "worker")


@dataclass(frozen=True, kw_only=True)
class PSLayout:
    """``servers`` servers, ``replicas`` replicas and ``workers`` workers in ranks of one job."""

    servers: int
    workers: int
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"a parameter server job needs at least one server, got servers={self.servers}")
        if self.workers < 1:
            raise ValueError(f"a parameter server job needs at least one worker, got workers={self.workers} "
                             f"(world size = servers + replicas + workers)")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")

    @classmethod
    def for_world(cls, world_size: int, servers: int | None = None, replicas: int | None = None) -> "PSLayout":
        """The layout of a job of ``world_size`` ranks: the arguments, else the environment
        (``MLFABRIC_PS_SERVERS``, default 1; ``MLFABRIC_PS_REPLICAS``, default 0)."""
        s = servers if servers is not None else _env_count(SERVERS_ENV, 1)
        r = replicas if replicas is not None else _env_count(REPLICAS_ENV, 0)
        if world_size - s - r < 1:
            raise ValueError(f"world size {world_size} leaves no worker after {s} server(s) and {r} replica(s): "
                             f"launch at least {s + r + 1} ranks or lower {SERVERS_ENV}/{REPLICAS_ENV}")
        return cls(servers=s, replicas=r, workers=world_size - s - r)

    @property
    def world_size(self) -> int:
        return self.servers + self.replicas + self.workers

    def role(self, rank: int) -> str:
        self._check(rank)
        if rank < self.servers:
            return "server"
        return "replica" if rank < self.servers + self.replicas else "worker"

    def server_rank(self, server: int) -> int:
        if not 0 <= server < self.servers:
            raise ValueError(f"server {server} does not exist: this job has servers 0..{self.servers - 1}")
        return server

    @property
    def server_ranks(self) -> range:
        return range(self.servers)

    @property
    def replica_ranks(self) -> range:
        return range(self.servers, self.servers + self.replicas)

    @property
    def worker_ranks(self) -> range:
        return range(self.servers + self.replicas, self.world_size)

    def worker_rank(self, worker: int) -> int:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} does not exist: this job has workers 0..{self.workers - 1}")
        return self.servers + self.replicas + worker

    def worker_index(self, rank: int) -> int:
        if self.role(rank) != "worker":
            raise ValueError(f"rank {rank} is a {self.role(rank)}, not a worker")
        return rank - self.servers - self.replicas

    def replicated_server(self, rank: int) -> int:
        """The server a replica rank mirrors by default (replica ``i`` -> server ``i % S``)."""
        if self.role(rank) != "replica":
            raise ValueError(f"rank {rank} is a {self.role(rank)}, not a replica")
        return (rank - self.servers) % self.servers

    def replicas_of(self, server: int) -> list[int]:
        """Replica ranks that mirror ``server`` by default."""
        return [r for r in self.replica_ranks if self.replicated_server(r) == server]

    def describe(self, rank: int) -> str:
        """``"rank 5 (worker 3)"``: how errors name a rank."""
        role = self.role(rank)
        index = {"server": rank, "replica": rank - self.servers, "worker": rank - self.servers - self.replicas}[role]
        return f"rank {rank} ({role} {index})"

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this PS job's {self.world_size} ranks")


def _env_count(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
