"""mlfabric: a network-aware communication layer for distributed ML training on PyTorch.

    import mlfabric
    comm = mlfabric.init()                  # under torchrun, or rank=/world_size=/master_*=
    comm.allreduce(tensor, algorithm="ring", op="sum")
    comm.close()

See README.md for the quickstart and docs/ for the algorithms and measured results.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from ._lazy import lazy_exports

if TYPE_CHECKING:  # resolved lazily at run time (__getattr__ below): they import torch
    from .errors import (
        CollectiveError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        MlfabricError,
        PeerLeftError,
        PeerLostError,
        RendezvousError,
        TransportError,
    )
    from .runtime.communicator import Communicator

__version__ = "0.1.0"

#: Seconds any wait of a communicator may take by default (mlfabric.runtime.communicator uses it).
DEFAULT_TIMEOUT_S = 60.0

# `import mlfabric` imports neither torch nor the runtime, so that the `mlfabric` command starts
# in a fraction of a second (`mlfabric --help` needs neither; issue #39). The public names that
# need them are resolved on first use; so is every submodule (`mlfabric.torch.allreduce_hook`
# after a bare `import mlfabric`, as when the runtime was imported eagerly).
_LAZY = {
    "Communicator": "runtime.communicator",
    **{name: "errors" for name in ("CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError",
                                   "MlfabricError", "PeerLeftError", "PeerLostError", "RendezvousError",
                                   "TransportError")},
}
__getattr__ = lazy_exports(__name__, _LAZY, submodules=True)

log = logging.getLogger("mlfabric")

TRANSPORTS = ("tcp", "zmq", "torch")
LOG_LEVEL_ENV = "MLFABRIC_LOG_LEVEL"


def _configure_logging() -> None:
    """``MLFABRIC_LOG_LEVEL=DEBUG|INFO|WARNING|ERROR``: the level of mlfabric's loggers, with a
    stderr handler (process id and logger name in each line) unless the application set up
    logging itself. Unset: Python's defaults (warnings and errors reach stderr)."""
    raw = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if not raw:
        return
    level = logging.getLevelName(raw.upper())
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={raw!r}: choose DEBUG, INFO, WARNING or ERROR")
    log.setLevel(level)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)


_configure_logging()
TOPOLOGY_ENV = "MLFABRIC_TOPOLOGY"
CHUNK_ENV = "MLFABRIC_CHUNK_BYTES"


def init(transport: str = "tcp", *, rank: int | None = None, world_size: int | None = None,
         master_addr: str | None = None, master_port: int | None = None,
         timeout: float = DEFAULT_TIMEOUT_S, channels: Sequence[str] | None = None,
         channel_addrs: dict[str, str] | None = None, backend: str = "gloo",
         topology: str | None = None, pace: str | None = None,
         chunk_bytes: int | str | None = None, nic_rate: str | float | None = None,
         watchdog: float | None = None) -> Communicator:
    """Join the job and return a :class:`Communicator`.

    ``transport``: ``"tcp"`` (the default: plain TCP sockets that receive payloads straight
    into the tensor, see ``mlfabric/transport/tcp.py``), ``"zmq"`` (TCP via ZeroMQ; needs the
    ``zmq`` extra: ``pip install 'mlfabric[zmq]'``) or ``"torch"`` (torch.distributed
    point-to-point on ``backend``, "gloo" or "nccl"). Rank, world size and the rendezvous
    address come from the arguments or from the torchrun variables RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT. ``timeout`` (seconds) bounds every wait.
    ``channels`` names the NICs (one listening address each, from ``channel_addrs`` or the
    ``MLFABRIC_CHANNEL_ADDRS`` variable); by default a single channel ``"0"``.
    ``topology`` (or ``MLFABRIC_TOPOLOGY``) is the cluster's topology spec, rank r on host r,
    e.g. ``"bcube:n=3,k=2"``: BML (``algorithm="bcube"``, and ``"auto"`` on a BCube) needs it.
    ``pace`` (or ``MLFABRIC_PACE``), zmq and tcp: shape sends in user space, ``"100mbit"`` for
    every channel or ``"0=1gbit,1=500mbit"`` — what ``mlfabric launch`` does without root.
    ``chunk_bytes`` (or ``MLFABRIC_CHUNK_BYTES``, e.g. ``"2MiB"``; the same on every rank):
    the ring collectives' pipelining chunk. By default chunks are large (16 MB: on hosts whose
    CPU is the bottleneck each message's fixed cost dominates); on a bandwidth-limited network
    a chunk of ~16 ms of NIC time overlaps each step's reduction with the transfer (the
    emulator sets it from its NIC rate: :func:`mlfabric.emu.cluster.pipeline_chunk_bytes`).
    ``nic_rate`` (or ``MLFABRIC_NIC_RATE``, e.g. ``"500mbit"`` or ``"0=1gbit,1=500mbit"``): the
    line rate of each channel's NIC. When given, BML and the P2P parameter server pace each
    connection at its share of the NIC (zmq and tcp on Linux), so that their concurrent flows end
    together (``mlfabric/runtime/fair_share.py``); the emulator sets it.
    ``watchdog`` (or ``MLFABRIC_WATCHDOG_S``; default 10 s, 0: off): log a collective that made
    no progress for that long, with what it waits for and from whom (docs/faults.md).
    """
    from .runtime.rendezvous import connect_store, job_info

    _check_join_options(transport, timeout, pace)
    job = job_info(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port)
    store = connect_store(job, timeout)
    return connect(store, job.rank, job.world_size, transport=transport, master_addr=job.master_addr,
                   timeout=timeout, channels=channels, channel_addrs=channel_addrs, backend=backend,
                   topology=topology, pace=pace, chunk_bytes=chunk_bytes, nic_rate=nic_rate,
                   watchdog=watchdog)


def _check_join_options(transport: str, timeout: float, pace: str | None) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if pace and transport == "torch":
        raise ValueError("user-space pacing needs the zmq or tcp transport")


def connect(store: object, rank: int, world_size: int, *, transport: str = "tcp",
            master_addr: str = "127.0.0.1", timeout: float = DEFAULT_TIMEOUT_S,
            channels: Sequence[str] | None = None, channel_addrs: dict[str, str] | None = None,
            backend: str = "gloo", topology: str | None = None, pace: str | None = None,
            chunk_bytes: int | str | None = None, nic_rate: str | float | None = None,
            watchdog: float | None = None) -> Communicator:
    """Like :func:`init`, on a ``torch.distributed.Store`` every rank already shares (the
    torch.distributed backend gets one from ``init_process_group``). ``master_addr``: a host
    the ranks reach each other towards; the socket transports listen on the local address
    that leads there unless ``channel_addrs`` / ``MLFABRIC_CHANNEL_ADDRS`` say otherwise."""
    from .runtime.communicator import Communicator
    from .runtime.rendezvous import store_barrier

    _check_join_options(transport, timeout, pace)
    topology = topology if topology is not None else (os.environ.get(TOPOLOGY_ENV) or None)
    chunk = chunk_bytes if chunk_bytes is not None else (os.environ.get(CHUNK_ENV) or None)
    if chunk is not None:
        from .units import parse_size

        try:
            chunk = parse_size(chunk)
        except ValueError as exc:
            raise ValueError(f"chunk_bytes / {CHUNK_ENV}: {exc}") from None
    if transport in ("zmq", "tcp"):
        from .transport.pacing import PACE_ENV, parse_pace
        from .transport.sockets import channel_addrs_from_env, local_address_towards
        from .units import format_rate

        if transport == "zmq":
            from .transport.zmq import ZmqTransport as socket_transport
        else:
            from .transport.tcp import TcpTransport as socket_transport

        addrs = channel_addrs if channel_addrs is not None else channel_addrs_from_env()
        names = tuple(channels) if channels else (tuple(addrs) or ("0",))
        default_addr = local_address_towards(master_addr)
        bind = {name: addrs.get(name, default_addr) for name in names}
        pace_bps = parse_pace(pace if pace is not None else os.environ.get(PACE_ENV, ""), names)
        if pace_bps:
            log.warning("rank %d: user-space shaping (no kernel shaper): pacing channels %s",
                        rank, ", ".join(f"{n} at {format_rate(r)}" for n, r in pace_bps.items()))
        tr = socket_transport.create(store, rank, world_size, channels=names,
                                     bind_addrs=bind, timeout=timeout, pace_bps=pace_bps)
    else:
        from .transport.pacing import PACE_ENV
        from .transport.torchdist import TorchDistTransport

        if os.environ.get(PACE_ENV):
            log.warning("rank %d: %s is set but the torch transport does not pace; rates are not "
                        "enforced", rank, PACE_ENV)

        tr = TorchDistTransport.create(store, rank, world_size, backend=backend,
                                       channels=tuple(channels or ("0",)), timeout=timeout)
    # Rank 0 serves the store: keep it until everyone has finished reading from it.
    store_barrier(store, "init", world_size, timeout)
    try:
        comm = Communicator(tr, timeout=timeout, topology=topology, chunk_bytes=chunk, nic_rate=nic_rate,
                            watchdog=watchdog)
    except ValueError:
        tr.close()
        raise
    comm.store = store  # rank 0 serves the store: it must live as long as the communicator
    return comm


T = TypeVar("T")


def local_world(world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S,
                channels: Sequence[str] = ("0",), topology: str | None = None,
                hosts: Sequence[int] | None = None) -> list[Communicator]:
    """``world_size`` communicators joined by the in-process transport (ranks = threads);
    ``hosts`` says which ranks stand for one host (hierarchical collectives)."""
    from .runtime.communicator import Communicator
    from .transport.local import LocalFabric

    fabric = LocalFabric(world_size, tuple(channels))
    return [Communicator(t, timeout=timeout, topology=topology, hosts=hosts) for t in fabric.transports()]


def run_threads(world_size: int, fn: Callable[[Communicator], T], *,
                timeout: float = DEFAULT_TIMEOUT_S, channels: Sequence[str] = ("0",),
                topology: str | None = None, hosts: Sequence[int] | None = None) -> list[T]:
    """Run ``fn(comm)`` on ``world_size`` threads, one rank each; returns per-rank results
    and re-raises the first exception."""
    comms = local_world(world_size, timeout=timeout, channels=channels, topology=topology, hosts=hosts)
    results: list[object] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank])
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for comm in comms:
        comm.close()
    for exc in errors:
        if exc is not None:
            raise exc
    return results  # type: ignore[return-value]


# `init_process_group("mlfabric")` works once mlfabric is imported (mlfabric/torch/backend.py):
# at once when torch is loaded already, else as soon as it is (without importing it here).
from ._plugin import register_backend_when_torch_loads as _register_torch_backend  # noqa: E402

_register_torch_backend()

__all__ = [
    "CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError", "Communicator",
    "MlfabricError", "PeerLeftError", "PeerLostError", "RendezvousError", "TransportError", "connect", "init", "local_world", "run_threads",
    "__version__",
]
