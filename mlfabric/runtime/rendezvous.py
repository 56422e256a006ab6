"""Find the rest of the job: rank, world size and a shared key-value store.

Reads the ``torchrun`` environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless the
caller passes values, and returns a torch.distributed TCPStore. Under ``torchrun`` the
agent already serves a store on MASTER_PORT and workers join it as clients; otherwise rank 0
serves it (multi-tenant, so ``torch.distributed.init_process_group`` can share the port).
Each communicator gets its own key prefix so several can coexist in one job.

Failing clearly instead of a raw store timeout: every rank publishes its WORLD_SIZE and
compares it with rank 0's (sizes that disagree fail every rank at once, saying which ranks
said what); a rank that never joins is named when the timeout ends; a MASTER_PORT held by
another program fails rank 0 at once and the other ranks within the timeout (torch's store
client can block forever on a listener that does not speak its protocol, so it is connected
from a helper thread whose wait is bounded).

Exercise it with ``python -m pytest tests/local/test_socket_transports.py``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from mlfabric.errors import RendezvousError

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
        base = _tcp_store(job, timeout, serve=job.rank == 0 and not agent_store)
    store = dist.PrefixStore(prefix, base)
    check_world(store, job, timeout)
    return store


def _where(job: JobInfo) -> str:
    return f"MASTER_ADDR={job.master_addr} MASTER_PORT={job.master_port}"


def _tcp_store(job: JobInfo, timeout: float, *, serve: bool) -> dist.TCPStore:
    """The job's TCPStore, served here if ``serve``; a RendezvousError that says what to do
    when the port is taken or nothing answers within ``timeout``."""
    def make() -> dist.TCPStore:
        return dist.TCPStore(job.master_addr, job.master_port, job.world_size, is_master=serve,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True)

    if serve:
        try:
            return make()
        except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
            if "EADDRINUSE" in str(exc) or getattr(exc, "errno", None) == errno.EADDRINUSE:
                raise RendezvousError(
                    f"rank {job.rank}: cannot serve the rendezvous store on {_where(job)}: the port "
                    "is in use by another program. Choose a free MASTER_PORT (the same on every "
                    "rank) or stop the program holding it (`ss -ltnp | grep :PORT` shows it)."
                ) from exc
            raise RendezvousError(f"rank {job.rank}: cannot serve the rendezvous store on "
                                  f"{_where(job)}: {exc}") from exc
    # A client: torch's constructor waits without a bound on a listener that accepts but
    # never answers (another program on the port), so the wait happens on a helper thread.
    # If it is still stuck when we give up, it stays blocked on that foreign connection
    # (a daemon thread: it does not keep the process alive).
    box: dict[str, object] = {}

    def connect() -> None:
        try:
            box["store"] = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc

    helper = threading.Thread(target=connect, name="mlfabric-store-connect", daemon=True)
    helper.start()
    helper.join(timeout + 1.0)  # torch's own connect timeout first, when it applies
    hint = ("rank 0 serves the store on that port: check that rank 0 runs, that every rank has "
            "the same MASTER_ADDR and MASTER_PORT, and that no other program listens on the port")
    if "store" in box:
        return box["store"]  # type: ignore[return-value]
    if "error" in box:
        raise RendezvousError(f"rank {job.rank}: cannot reach the rendezvous store at {_where(job)} "
                              f"({box['error']}); {hint}") from box["error"]  # type: ignore[misc]
    raise RendezvousError(f"rank {job.rank}: nothing at {_where(job)} answered as a rendezvous store "
                          f"within {timeout:g} s (another program may hold the port); {hint}")


# Rendezvous keys of the world check (under the communicator's prefix).
_SIZE_KEY, _FAILURE_KEY, _SEEN_KEY = "world/size/", "world/failure", "world/seen"
_POLL_S = 0.01


def check_world(store: dist.Store, job: JobInfo, timeout: float) -> None:
    """Every rank of the job has joined ``store`` with the same world size, or a
    RendezvousError on every rank that says who is missing or who disagrees."""
    store.set(f"{_SIZE_KEY}{job.rank}", str(job.world_size))
    deadline = time.monotonic() + timeout
    keys = [f"{_SIZE_KEY}{rank}" for rank in range(job.world_size)]
    compared = False
    try:
        while True:
            if store.check([_FAILURE_KEY]):
                _fail_everyone(store, job, store.get(_FAILURE_KEY).decode(), deadline)
            if not compared and store.check([keys[0]]):
                compared = True
                theirs = int(store.get(keys[0]).decode())
                if theirs != job.world_size:
                    _fail_everyone(store, job, (
                        f"the ranks disagree on the world size: rank {job.rank} was started with "
                        f"WORLD_SIZE={job.world_size} but rank 0 with WORLD_SIZE={theirs}. Start every "
                        "rank with the same WORLD_SIZE (the number of ranks)"), deadline, publish=True)
            if store.check(keys):
                # Every key is in, but a rank whose WORLD_SIZE differs may not have compared
                # yet (it sets its key first): compare them all, or this rank would go on
                # into a rendezvous that the odd rank never joins.
                sizes = [int(store.get(key).decode()) for key in keys]
                odd = [rank for rank, size in enumerate(sizes) if size != sizes[0]]
                if odd:
                    _fail_everyone(store, job, (
                        f"the ranks disagree on the world size: rank {odd[0]} was started with "
                        f"WORLD_SIZE={sizes[odd[0]]} but rank 0 with WORLD_SIZE={sizes[0]}. Start every "
                        "rank with the same WORLD_SIZE (the number of ranks)"), deadline, publish=True)
                return
            if time.monotonic() > deadline:
                joined = [rank for rank, key in enumerate(keys) if store.check([key])]
                missing = sorted(set(range(job.world_size)) - set(joined))
                _fail_everyone(store, job, (
                    f"rank(s) {', '.join(map(str, missing))} of WORLD_SIZE={job.world_size} never joined "
                    f"the rendezvous at {_where(job)} within {timeout:g} s (joined: "
                    f"{', '.join(map(str, joined))}). Start every rank (RANK=0..WORLD_SIZE-1), check that "
                    "WORLD_SIZE is the number of ranks started, or look for a rank that failed before "
                    "mlfabric.init"), deadline + 2.0, publish=True, readers=len(joined))
            time.sleep(_POLL_S)
    except (RuntimeError, OSError) as exc:
        if isinstance(exc, RendezvousError):
            raise
        raise RendezvousError(f"rank {job.rank}: the rendezvous store at {_where(job)} went away "
                              f"({exc}); rank 0 serves it: see rank 0's error") from exc


def _fail_everyone(store: dist.Store, job: JobInfo, note: str, deadline: float, *,
                   publish: bool = False, readers: int | None = None) -> None:
    """Raise ``note`` here, after publishing it (``publish``) for the other ranks, which raise
    it too. Rank 0 serves the store: it keeps serving until ``readers`` ranks (default: the
    world) have read the note or ``deadline`` passes, so that late ranks fail with it rather
    than with a vanished store."""
    if publish:
        store.set(_FAILURE_KEY, note)
    store.add(_SEEN_KEY, 1)
    if job.rank == 0:
        readers = job.world_size if readers is None else readers
        while int(store.add(_SEEN_KEY, 0)) < readers and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    raise RendezvousError(f"rank {job.rank}: {note}.")


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
