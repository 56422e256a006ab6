"""Find the rest of the job: rank, world size and a shared key-value store.

Reads the ``torchrun`` environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless the
caller passes values, and returns a torch.distributed TCPStore. Under ``torchrun`` the
agent already serves a store on MASTER_PORT and workers join it as clients; otherwise rank 0
serves it (multi-tenant, so ``torch.distributed.init_process_group`` can share the port).
Each communicator gets its own key prefix so several can coexist in one job.

Exercise it with ``python -m pytest tests/local/test_socket_transports.py``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

_instances_created = 0


@dataclass(frozen=True, kw_only=True)
class JobInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def job_info(*, rank: int | None = None, world_size: int | None = None,
             master_addr: str | None = None, master_port: int | None = None) -> JobInfo:
    """Explicit arguments win over the torchrun environment variables."""
    rank = rank if rank is not None else _env_int("RANK")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    if rank is None and world_size is None:
        rank, world_size = 0, 1  # a plain `python script.py` is a job of one
    if rank is None or world_size is None:
        raise ValueError(
            "mlfabric.init needs both rank and world size: pass rank= and world_size= or set "
            "RANK and WORLD_SIZE (torchrun does this)"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not valid in a world of {world_size}")
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = master_port if master_port is not None else _env_int("MASTER_PORT")
    if port is None:
        if world_size > 1:
            raise ValueError(
                "mlfabric.init needs a rendezvous port: pass master_port= or set MASTER_PORT"
            )
        port = 0
    return JobInfo(rank=rank, world_size=world_size, master_addr=master_addr, master_port=port)


def connect_store(job: JobInfo, timeout: float) -> dist.Store:
    """A store shared by the whole job, with a prefix unique to this communicator."""
    global _instances_created
    _instances_created += 1
    prefix = f"mlfabric/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{_instances_created}/"
    if job.world_size == 1:
        return dist.PrefixStore(prefix, dist.HashStore())
    if dist.is_available() and dist.is_initialized():
        base = dist.distributed_c10d._get_default_store()
    else:
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        base = dist.TCPStore(
            job.master_addr,
            job.master_port,
            job.world_size,
            is_master=(job.rank == 0 and not agent_store),
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            multi_tenant=True,
        )
    return dist.PrefixStore(prefix, base)


def store_barrier(store: dist.Store, name: str, world_size: int, timeout: float) -> None:
    """Wait until every rank has reached ``name``.

    Two phases: ranks first count in, then count out, and rank 0 (which may be serving the
    store) only leaves once everybody has counted out — otherwise it could shut the store
    down under a rank still polling it.
    """
    deadline = time.monotonic() + timeout

    def wait_for(key: str) -> None:
        while int(store.add(key, 0)) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rendezvous barrier {name!r}: not every rank arrived within {timeout}s"
                )
            time.sleep(0.002)

    store.add(f"barrier/{name}/in", 1)
    wait_for(f"barrier/{name}/in")
    store.add(f"barrier/{name}/out", 1)
    wait_for(f"barrier/{name}/out")
