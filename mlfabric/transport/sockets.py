"""Socket helpers shared by the TCP-based transports (``zmq.py`` and ``tcp.py``).

Addresses (which local address to bind, what ``getpeername`` will report for an endpoint),
kernel socket buffer sizes, Linux's ``SO_MAX_PACING_RATE`` cap, and the rendezvous through a
torch.distributed store that both transports use to swap job token and endpoints.

Exercise it with ``python -m pytest tests/local/test_fair_share_zmq.py tests/local/test_tcp.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import sys
from typing import Callable, Mapping, Protocol, TypeVar

from mlfabric.errors import TransportError

from .base import CONTROL_CHANNEL, TOKEN_BYTES

# Kernel socket buffers: large enough that a multi-megabyte chunk moves in few syscalls.
SOCKET_BUFFER_BYTES = 4 << 20
# A paced connection's send buffer: this much time at its cap (at least the minimum). Paced,
# a larger buffer sends nothing sooner; it only makes the sender copy more into the kernel at
# once, and when all ranks start a collective together those copies compete for the CPU
# (BML on emulated BCube(3,2): 982-983 ms with 512 KiB buffers vs 990-991 ms with 4 MiB).
PACED_BUFFER_S = 0.02
MIN_PACED_BUFFER_BYTES = 256 << 10
# After a connection drops, wait this long for the peer's goodbye before declaring it lost
# (the goodbye and the disconnect may travel on different connections, in any order).
GOODBYE_GRACE_S = 0.5

# Linux's SO_MAX_PACING_RATE (bytes per second; ~0 lifts the cap). Python's socket module
# does not export it.
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
UNLIMITED_PACING = 0xFFFF_FFFF


#: A job's traffic priority (MLNET §3): ``MLFABRIC_PRIORITY=p`` marks every TCP connection of
#: the job's ranks; 0 (the default) leaves them unmarked, 7 is the highest.
PRIORITY_ENV = "MLFABRIC_PRIORITY"
MAX_PRIORITY = 7


def parse_priority(value: object, source: str = "priority") -> int:
    """A job priority, 0..:data:`MAX_PRIORITY` (7 highest); anything else is named."""
    text = str(value).strip()
    if not (text.isdigit() and 0 <= int(text) <= MAX_PRIORITY):
        raise ValueError(f"{source} must be an integer from 0 (unmarked, the default) to {MAX_PRIORITY} "
                         f"(the highest), got {value!r}")
    return int(text)


def priority_from_env() -> int:
    """The job's priority from ``MLFABRIC_PRIORITY`` (0 when unset)."""
    value = os.environ.get(PRIORITY_ENV, "")
    return parse_priority(value, PRIORITY_ENV) if value.strip() else 0


def priority_tos(priority: int) -> int:
    """The IP TOS byte of a job with ``priority``: the priority in the three precedence bits
    (what switches' priority queues read; the emulator's NICs match them,
    ``mlfabric.emu.cluster``). The mark is in the packet, so it crosses every hop, unlike a
    socket's ``SO_PRIORITY``, which Linux clears when a packet changes network namespace."""
    return parse_priority(priority) << 5


def set_priority(sock: socket.socket, priority: int) -> None:
    """Mark every packet of ``sock`` with the job's ``priority`` (nothing for 0)."""
    if priority:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, priority_tos(priority))


#: Whether the kernel can cap a socket's rate (SO_MAX_PACING_RATE is Linux's).
KERNEL_PACING = sys.platform.startswith("linux")


def pacing_cap_for(rate_bps: float | None) -> int | None:
    """The kernel cap (bytes/s) for a pacing rate in bit/s of payload; None lifts the cap."""
    if rate_bps is None:
        return None
    if rate_bps <= 0:
        raise ValueError(f"pacing rate must be positive or None, got {rate_bps}")
    return max(1, int(rate_bps / 8))


def paced_buffer_bytes(cap: int | None) -> int:
    """The send buffer of a connection capped at ``cap`` bytes/s (None: uncapped)."""
    if cap is None:
        return SOCKET_BUFFER_BYTES
    return min(SOCKET_BUFFER_BYTES, max(MIN_PACED_BUFFER_BYTES, int(cap * PACED_BUFFER_S)))


def set_pacing(sock: socket.socket, cap: int | None) -> None:
    """Cap ``sock``'s sending rate at ``cap`` bytes/s in the kernel (None lifts it) and size
    its send buffer to match. Raises OSError if the kernel refuses."""
    value = UNLIMITED_PACING if cap is None else cap
    option = struct.pack("=I", value) if value <= UNLIMITED_PACING else struct.pack("=Q", value)
    sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, option)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, paced_buffer_bytes(cap))


def pacing_cap(sock: socket.socket) -> int | None:
    """The kernel's pacing cap of ``sock`` in bytes/s; None when uncapped."""
    raw = sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8)
    value = struct.unpack("=Q", raw.ljust(8, b"\0"))[0]
    return None if value >= UNLIMITED_PACING else value


def send_buffer(sock: socket.socket) -> int:
    """The kernel's send buffer of ``sock`` (as the kernel reports it: twice what was set)."""
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)


def peer_address(endpoint: str) -> tuple[str, int]:
    """``("10.0.0.2", 5555)`` for ``"tcp://10.0.0.2:5555"`` (a host name resolved, IPv6
    brackets removed): what ``getpeername`` of a connection to the endpoint reports."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if ":" not in host:
        try:
            host = socket.gethostbyname(host)
        except OSError:
            pass  # unresolvable: the connection will fail and say so
    return host, int(port)


def channel_addrs_from_env() -> dict[str, str]:
    """Parse ``MLFABRIC_CHANNEL_ADDRS="0=10.0.0.2,1=10.1.0.2"`` (channel=bind address)."""
    raw = os.environ.get("MLFABRIC_CHANNEL_ADDRS", "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        name, sep, addr = item.partition("=")
        if not sep or not name or not addr:
            raise ValueError(f"MLFABRIC_CHANNEL_ADDRS item {item!r} is not CHANNEL=ADDRESS")
        out[name] = addr
    return out


def local_address_towards(host: str) -> str:
    """The local IP the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"
    if ip.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((ip, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def channel_indices(channels: tuple[str, ...]) -> tuple[dict[str, int], dict[int, str]]:
    """The wire index of each channel (the control channel last) and the way back."""
    index = {name: i for i, name in enumerate(channels)}
    index[CONTROL_CHANNEL] = len(channels)
    return index, {i: name for name, i in index.items()}


def check_endpoints(rank: int, peer: int, endpoints: Mapping[str, str], channels: tuple[str, ...]) -> None:
    """Raise if ``peer`` published no endpoint for one of our channels."""
    missing = set(channels) - set(endpoints)
    if missing:
        raise TransportError(
            f"rank {rank}: peer {peer} has no endpoint for channels {sorted(missing)}; "
            "all ranks must use the same channels")


class _Store(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...


class _Endpointed(Protocol):
    endpoints: dict[str, str]

    def connect(self, peers: Mapping[int, Mapping[str, str]]) -> None: ...
    def _shutdown(self) -> None: ...


T = TypeVar("T", bound=_Endpointed)


def rendezvous(store: _Store, rank: int, world_size: int, build: Callable[[bytes], T]) -> T:
    """Share a job token (rank 0 draws it), build this rank's transport with it, publish its
    endpoints in ``store``, learn everyone else's and connect to all peers."""
    if rank == 0:
        store.set("token", secrets.token_hex(TOKEN_BYTES))
    token = bytes.fromhex(store.get("token").decode())
    transport = build(token)
    try:
        store.set(f"endpoints/{rank}", json.dumps(transport.endpoints))
        peers = {peer: json.loads(store.get(f"endpoints/{peer}").decode())
                 for peer in range(world_size) if peer != rank}
        transport.connect(peers)
    except BaseException:
        transport._shutdown()
        raise
    return transport
