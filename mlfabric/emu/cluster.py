"""Emulated clusters on one machine: hosts in network namespaces, switches as Linux bridges.

    sudo .venv/bin/python -m pytest tests/emu -q          # builds, measures and tears down clusters

A cluster is planned from a topology spec shared with the simulator (``star:n=8``,
``racks:r=2,h=4,oversub=4``, ``bcube:n=3,k=2``) by :func:`plan_cluster` (pure, no root
needed) and built by :class:`Cluster` (root / CAP_NET_ADMIN):

* every run has a prefix ``mf<4 hex>``; every namespace, bridge and link carries it, so two
  runs never collide and :func:`cleanup` finds leftovers after a ``kill -9``;
* host ``h`` is the namespace ``<prefix>-h<h>`` with NICs ``eth0 .. eth{k-1}``; all switches
  live in one more namespace, ``<prefix>-sw`` (the *fabric*), so nothing at all is created in
  the machine's own namespace and deleting the namespaces removes every link and bridge;
* NIC ``l`` of host ``h`` has the address ``10.l.x.y/16`` with ``x.y = h + 1`` (subnet ``l`` is
  BCube level ``l``; star and racks use subnet 0 only); its bridge-side peer is
  ``<prefix>h<h>n<l>`` in the fabric namespace;
* host ``h`` is named ``<prefix>-h<h>`` (alias ``h<h>``): its ranks run in a UTS namespace
  of their own with that hostname, and every host sees an ``/etc/hosts``
  (``/etc/netns/<prefix>-h<h>/hosts``, bind-mounted by ``ip netns exec``) naming every
  host's addresses, so hostnames resolve both ways without DNS (:meth:`ClusterPlan.hosts_file`);
* every host NIC is shaped with HTB in both directions: egress on ``eth<l>`` (inside the
  host), ingress on the bridge-side veth's egress (inside the fabric). :meth:`Cluster.set_rate`
  changes a rate at run time (``tc class change``: effective at once);
* ``racks``: one bridge per rack (``<prefix>tor<r>``) and a core bridge (``<prefix>core``),
  joined by a veth pair per rack (``<prefix>u<r>`` on the ToR, ``<prefix>d<r>`` on the core)
  shaped to ``h * rate / oversub`` in each direction, shared fairly between the rack's hosts
  (one HTB child class per host, classified by source/destination address: the kernel here
  has no fq_codel/sfq, so per-host classes are what makes the sharing fair);
* ``bcube``: one bridge per BCube switch (``<prefix>l<l>s<i>``); NIC ``l`` plugs into its
  level-``l`` switch. Hosts relay (IP forwarding on) and carry ``/32`` routes along BCube's
  digit-correction paths (lowest differing digit first), so every address is reachable.

The cluster description (:meth:`Cluster.describe`, also written as JSON by the launcher) lists
each host's namespace and per-NIC addresses: ``MLFABRIC_CHANNEL_ADDRS`` for the zmq transport
comes from it (channel ``l`` = NIC ``l`` = BCube level ``l``). :meth:`ClusterPlan.rank_env` is
the one place that maps the cluster to a rank's environment (channels, ``MLFABRIC_TOPOLOGY``,
``GLOO_SOCKET_IFNAME``, ...) and :meth:`ClusterPlan.command_prefixes` to its command prefix.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlfabric.emu.cmd import EmuCommandError, EmuUnavailableError, batch, have_root, ns_exec_prefix, run
from mlfabric.topo.spec import TopologySpec
from mlfabric.units import parse_rate

__all__ = [
    "ClusterPlan", "HostPlan", "NicPlan", "UplinkPlan", "Cluster", "plan_cluster", "new_prefix",
    "cleanup", "list_runs", "pipeline_chunk_bytes", "PREFIX_RE", "STATE_DIR", "DIRECTIONS", "ETC_NETNS",
]

#: Per-run prefixes look like ``mf1a2b``.
PREFIX_RE = re.compile(r"^mf[0-9a-f]{4}$")
_OWNED_NS_RE = re.compile(r"^(mf[0-9a-f]{4})-(sw|h\d+)$")
_OWNED_LINK_RE = re.compile(r"^mf[0-9a-f]{4}")
#: Where a live cluster records its owner pid (so ``cleanup`` leaves running clusters alone).
STATE_DIR = Path(os.environ.get("MLFABRIC_EMU_STATE_DIR", "/run/mlfabric-emu"))
#: ``ip netns exec NS`` bind-mounts every file of ``/etc/netns/NS/`` over its namesake in
#: ``/etc`` for the program it runs: a host's ``hosts`` file goes there (fixed by iproute2).
ETC_NETNS = Path("/etc/netns")
DIRECTIONS = ("egress", "ingress")
IFNAMSIZ = 15
_QUEUE_S = 0.05  # bytes of buffer per shaped queue, in seconds at the base rate
_MIN_QUEUE_BYTES = 256 * 1024  # at least four 64 KiB GSO packets
# The ring's pipelining chunk on a shaped NIC: about this much NIC time per chunk, a power of
# two between the bounds. Measured on 8 emulated hosts at 1 Gbit/s (docs/results.md): 2 MiB
# chunks (16 ms) gave 0.97-0.99 of the two-host goodput, one 8 MB chunk per segment 0.88-0.90
# (each step's reduction and hand-off idle the NIC), 1 MiB chunks 0.86 (per-message cost).
_CHUNK_S = 0.016
_CHUNK_BOUNDS = (256 * 1024, 16 * 1024 * 1024)


def pipeline_chunk_bytes(rate_bps: float) -> int:
    """The ring pipelining chunk for NICs of ``rate_bps``: ~16 ms of transfer, a power of two
    from 256 KiB to 16 MiB (2 MiB at 1 Gbit/s, 1 MiB at 500 Mbit/s)."""
    if not rate_bps > 0:
        raise ValueError(f"rate must be positive, got {rate_bps}")
    target = rate_bps / 8 * _CHUNK_S
    power = 1 << max(0, round(math.log2(target)))
    return min(max(power, _CHUNK_BOUNDS[0]), _CHUNK_BOUNDS[1])


# --------------------------------------------------------------------------- plan (pure)


@dataclass(frozen=True, kw_only=True)
class NicPlan:
    """NIC ``nic`` of ``host``: its device inside the host, its bridge-side peer and address."""

    host: int
    nic: int
    address: str
    prefix_len: int
    host_dev: str  # inside the host namespace
    switch_dev: str  # inside the fabric namespace
    bridge: str  # the switch it plugs into


@dataclass(frozen=True, kw_only=True)
class HostPlan:
    """One emulated host: a namespace with one NIC per channel / BCube level."""

    rank: int
    netns: str
    nics: tuple[NicPlan, ...]

    @property
    def address(self) -> str:
        """The host's NIC-0 address (MASTER_ADDR when it is rank 0)."""
        return self.nics[0].address

    @property
    def hostname(self) -> str:
        """The host's name, what ``socket.gethostname()`` returns in its ranks: its namespace's
        name (``mf1a2b-h3``), unique across runs; ``h3`` is an alias (:meth:`ClusterPlan.hosts_file`)."""
        return self.netns

    @property
    def alias(self) -> str:
        """The short name every host of the cluster resolves to this host's NIC-0 address:
        ``h<rank>`` (``--rdzv-endpoint h0:29400`` needs no prefix)."""
        return f"h{self.rank}"

    def channel_addrs(self) -> str:
        """``MLFABRIC_CHANNEL_ADDRS`` for this host: ``"0=10.0.0.1,1=10.1.0.1"``."""
        return ",".join(f"{nic.nic}={nic.address}" for nic in self.nics)


@dataclass(frozen=True, kw_only=True)
class UplinkPlan:
    """A shaped switch-to-switch link (racks: ToR ``a_bridge`` <-> core ``b_bridge``)."""

    a_dev: str
    b_dev: str
    a_bridge: str
    b_bridge: str
    rate_bps: int
    #: Addresses behind ``a`` (the rack's hosts): one fair-share class each, both directions.
    hosts_behind_a: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    """Everything :class:`Cluster` creates, named and addressed (no kernel state involved)."""

    prefix: str
    spec: TopologySpec
    rate_bps: int
    fabric_ns: str
    hosts: tuple[HostPlan, ...]
    bridges: tuple[str, ...]
    uplinks: tuple[UplinkPlan, ...] = ()
    #: ``routes[h]``: ``(destination address, via address, host dev)`` for BCube relaying.
    routes: tuple[tuple[tuple[str, str, str], ...], ...] = ()
    forwarding: bool = False
    queue_bytes: int = _MIN_QUEUE_BYTES

    @property
    def n_hosts(self) -> int:
        return len(self.hosts)

    @property
    def master_addr(self) -> str:
        return self.hosts[0].address

    def namespaces(self) -> list[str]:
        return [self.fabric_ns, *(host.netns for host in self.hosts)]

    def nic(self, host: int, nic: int = 0) -> NicPlan:
        try:
            return self.hosts[host].nics[nic]
        except IndexError:
            raise ValueError(f"no NIC {nic} on host {host}: the cluster {self.spec} has {self.n_hosts} hosts "
                             f"with {len(self.hosts[0].nics)} NIC(s) each") from None

    def rank_env(self, rank: int, *, cluster_json: str | None = None) -> dict[str, str]:
        """The environment rank ``rank`` (on host ``rank``) needs besides the torchrun variables.

        ``MLFABRIC_CHANNEL_ADDRS`` (one channel per NIC / BCube level, what the zmq transport
        binds), ``MLFABRIC_TOPOLOGY`` (the spec: ``mlfabric.init`` reads it, BML needs it),
        ``MLFABRIC_EMU_PREFIX``, ``MLFABRIC_EMU_NETNS``, ``GLOO_SOCKET_IFNAME`` (gloo picks
        its interface from the hostname, which a namespace cannot resolve) and, when given,
        ``MLFABRIC_EMU_CLUSTER`` (the path of the :meth:`describe` JSON), and
        ``MLFABRIC_CHUNK_BYTES`` (the ring's pipelining chunk for this NIC rate,
        :func:`pipeline_chunk_bytes`) and ``MLFABRIC_NIC_RATE`` (so that BML and the P2P
        parameter server pace each connection at its share of the NIC; a launcher that
        changes rates at run time removes it). Every launcher of
        ranks on a cluster (``mlfabric launch``, the emulated benchmarks) uses this.
        """
        from mlfabric import CHUNK_ENV, TOPOLOGY_ENV
        from mlfabric.runtime.fair_share import NIC_RATE_ENV

        if not 0 <= rank < self.n_hosts:
            raise ValueError(f"rank {rank} has no host: the cluster {self.spec} has {self.n_hosts} hosts")
        host = self.hosts[rank]
        env = {"MLFABRIC_CHANNEL_ADDRS": host.channel_addrs(), TOPOLOGY_ENV: str(self.spec),
               "MLFABRIC_EMU_PREFIX": self.prefix, "MLFABRIC_EMU_NETNS": host.netns,
               "GLOO_SOCKET_IFNAME": host.nics[0].host_dev, CHUNK_ENV: str(pipeline_chunk_bytes(self.rate_bps)),
               NIC_RATE_ENV: str(self.rate_bps)}
        if cluster_json is not None:
            env["MLFABRIC_EMU_CLUSTER"] = cluster_json
        return env

    def rank_envs(self, *, cluster_json: str | None = None) -> list[dict[str, str]]:
        """:meth:`rank_env` of every rank, in rank order."""
        return [self.rank_env(rank, cluster_json=cluster_json) for rank in range(self.n_hosts)]

    def command_prefixes(self) -> list[list[str]]:
        """Per rank, the prefix that runs its command inside its host (``ip netns exec ...``)
        under the host's name (:attr:`HostPlan.hostname`, a UTS namespace of its own)."""
        return [ns_exec_prefix(host.netns, host.hostname) for host in self.hosts]

    def hosts_file(self) -> str:
        """The ``/etc/hosts`` every host of the cluster sees (:data:`ETC_NETNS`): localhost,
        then per host its NIC-0 address with its :attr:`~HostPlan.hostname` and
        :attr:`~HostPlan.alias`, and its other NICs' addresses as ``<hostname>-eth<l>``.

        Every address a rank meets resolves to a name and back without DNS (unreachable
        from a namespace): torch's TCPStore names each client by a reverse lookup (without
        this file every rank printed ``[c10d] The hostname of the client socket cannot be
        retrieved``) and torchrun's c10d rendezvous decides which agent serves the store by
        resolving ``--rdzv-endpoint`` and its own hostname.
        """
        lines = ["127.0.0.1\tlocalhost"]
        for host in self.hosts:
            lines.append(f"{host.address}\t{host.hostname} {host.alias}")
            lines += [f"{nic.address}\t{host.hostname}-{nic.host_dev}" for nic in host.nics[1:]]
        # TCPStore listens on a dual-stack IPv6 socket: it sees its IPv4 clients as
        # ::ffff:a.b.c.d, which glibc looks up as IPv6 (not in the lines above).
        lines.append("::ffff:127.0.0.1\tlocalhost")
        for host in self.hosts:
            lines += [f"::ffff:{nic.address}\t{host.hostname}" + (f"-{nic.host_dev}" if nic.nic else "")
                      for nic in host.nics]
        return "\n".join(lines) + "\n"

    def describe(self) -> dict[str, object]:
        """JSON-friendly description: spec, rate, and per host its namespace, names and NIC addresses."""
        return {
            "prefix": self.prefix, "topology": str(self.spec), "rate_bps": self.rate_bps,
            "fabric_netns": self.fabric_ns, "master_addr": self.master_addr,
            "hosts": [{"rank": h.rank, "netns": h.netns, "hostname": h.hostname, "alias": h.alias,
                       "channel_addrs": h.channel_addrs(),
                       "nics": [{"nic": n.nic, "level": n.nic, "dev": n.host_dev, "address": n.address,
                                 "prefix_len": n.prefix_len, "switch": n.bridge} for n in h.nics]}
                      for h in self.hosts],
        }


def host_address(subnet: int, host: int) -> str:
    """``10.<subnet>.x.y`` with ``x.y = host + 1`` (a /16 per subnet: up to 65,533 hosts)."""
    value = host + 1
    if not 0 <= subnet <= 255 or not 1 <= value <= 0xFFFE:
        raise ValueError(f"no address for host {host} in subnet {subnet}: at most 65,533 hosts and 256 subnets")
    return f"10.{subnet}.{value >> 8}.{value & 0xFF}"


def new_prefix() -> str:
    """A fresh ``mf<4 hex>`` prefix not used by any existing namespace."""
    taken = {m.group(1) for m in (_OWNED_NS_RE.match(ns) for ns in _netns_list()) if m}
    for _ in range(100):
        prefix = f"mf{secrets.token_hex(2)}"
        if prefix not in taken:
            return prefix
    raise RuntimeError("could not find a free mf<hex> prefix; run `mlfabric emu cleanup`")


def _check_name(name: str) -> str:
    if len(name) > IFNAMSIZ:
        raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ} characters; use a smaller cluster")
    return name


def _nic(prefix: str, host: int, nic: int, bridge: str) -> NicPlan:
    return NicPlan(host=host, nic=nic, address=host_address(nic, host), prefix_len=16, host_dev=f"eth{nic}",
                   switch_dev=_check_name(f"{prefix}h{host}n{nic}"), bridge=bridge)


def plan_cluster(spec: TopologySpec | str, rate_bps: float, *, prefix: str = "mf0000") -> ClusterPlan:
    """Name and address every namespace, bridge and link of ``spec`` with host NICs at ``rate_bps``."""
    if isinstance(spec, str):
        spec = TopologySpec.parse(spec)
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r} must look like mf1a2b (mf + 4 hex digits)")
    rate = int(round(rate_bps))
    if rate < 8000:
        raise ValueError(f"rate {rate_bps!r} bit/s is too small to shape (at least 8 kbit/s)")
    fabric = f"{prefix}-sw"
    queue = max(_MIN_QUEUE_BYTES, int(rate / 8 * _QUEUE_S))
    if spec.kind == "star":
        n = spec.int_param("n")
        bridge = _check_name(f"{prefix}sw")
        hosts = tuple(HostPlan(rank=h, netns=f"{prefix}-h{h}", nics=(_nic(prefix, h, 0, bridge),)) for h in range(n))
        return ClusterPlan(prefix=prefix, spec=spec, rate_bps=rate, fabric_ns=fabric, hosts=hosts,
                           bridges=(bridge,), queue_bytes=queue)
    if spec.kind == "racks":
        r, per = spec.int_param("r"), spec.int_param("h")
        oversub = spec.float_param("oversub")
        core = _check_name(f"{prefix}core")
        tors = tuple(_check_name(f"{prefix}tor{t}") for t in range(r))
        hosts = tuple(HostPlan(rank=h, netns=f"{prefix}-h{h}", nics=(_nic(prefix, h, 0, tors[h // per]),))
                      for h in range(r * per))
        uplink_rate = int(round(per * rate / oversub))
        uplinks = tuple(UplinkPlan(a_dev=_check_name(f"{prefix}u{t}"), b_dev=_check_name(f"{prefix}d{t}"),
                                   a_bridge=tors[t], b_bridge=core, rate_bps=uplink_rate,
                                   hosts_behind_a=tuple(hosts[t * per + i].address for i in range(per)))
                        for t in range(r))
        return ClusterPlan(prefix=prefix, spec=spec, rate_bps=rate, fabric_ns=fabric, hosts=hosts,
                           bridges=(core, *tors), uplinks=uplinks, queue_bytes=queue)
    if spec.kind == "bcube":
        n, k = spec.int_param("n"), spec.int_param("k")
        n_hosts = n**k
        if k > 256:
            raise ValueError(f"bcube k={k}: at most 256 levels (one /16 subnet each)")

        def switch_index(h: int, level: int) -> int:
            return (h // n ** (level + 1)) * n**level + h % n**level

        bridges = tuple(_check_name(f"{prefix}l{level}s{i}") for level in range(k) for i in range(n ** (k - 1)))
        hosts = tuple(HostPlan(rank=h, netns=f"{prefix}-h{h}", nics=tuple(
            _nic(prefix, h, level, f"{prefix}l{level}s{switch_index(h, level)}") for level in range(k)))
            for h in range(n_hosts))
        routes = tuple(tuple(_bcube_routes(h, n, k)) for h in range(n_hosts))
        return ClusterPlan(prefix=prefix, spec=spec, rate_bps=rate, fabric_ns=fabric, hosts=hosts, bridges=bridges,
                           routes=routes, forwarding=k > 1, queue_bytes=queue)
    raise ValueError(f"the emulator builds star, racks and bcube topologies, not {spec.kind!r} ({spec})")


def _digits(h: int, n: int, k: int) -> list[int]:
    return [(h // n**i) % n for i in range(k)]


def _bcube_routes(src: int, n: int, k: int) -> Iterator[tuple[str, str, str]]:
    """``/32`` routes of ``src`` towards every address it does not share a switch with."""
    src_digits = _digits(src, n, k)
    for dst in range(n**k):
        if dst == src:
            continue
        dst_digits = _digits(dst, n, k)
        differing = [i for i in range(k) if src_digits[i] != dst_digits[i]]
        first = differing[0]  # digit-correction order: lowest differing digit first
        hop = src + (dst_digits[first] - src_digits[first]) * n**first
        for level in range(k):
            # dst's level-`level` address is on-link only if src and dst share that switch,
            # i.e. they differ in digit `level` alone.
            if differing == [level]:
                continue
            yield host_address(level, dst), host_address(first, hop), f"eth{first}"


# --------------------------------------------------------------------------- kernel state


def _netns_list() -> list[str]:
    try:
        proc = run(["ip", "netns", "list"], check=False)
    except EmuUnavailableError:
        return []
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


#: Traffic priorities of the emulated NICs (MLNET §3): 0 (unmarked traffic, the default) to
#: :data:`mlfabric.transport.sockets.MAX_PRIORITY` (7, the highest). A packet whose IP
#: precedence (the TOS byte's top three bits, :func:`mlfabric.transport.sockets.priority_tos`)
#: is ``p`` lands in HTB class ``1:10p`` of every shaped NIC and uplink: the switches'
#: priority queues.
PRIORITY_CLASS_BASE = 0x100
PRIORITIES = range(8)
#: What a priority class is guaranteed; the rest of the NIC's rate it borrows, the highest
#: priority first (HTB's ``prio``), so the sharing is strict priority above this floor.
PRIORITY_FLOOR_BPS = 8000


def _priority_class(priority: int) -> str:
    return f"1:{PRIORITY_CLASS_BASE + priority:x}"


def _priority_commands(dev: str, rate_bps: int, queue_bytes: int, priorities: Sequence[int]) -> list[str]:
    """One HTB leaf (and byte FIFO) per priority under class 1:1, each guaranteed only the
    floor and borrowing the rest of ``rate_bps`` in priority order (7 first); a queue each,
    so a high-priority packet never waits behind a full low-priority queue."""
    burst = _burst_bytes(rate_bps)
    cmds = []
    for p in priorities:
        classid = _priority_class(p)
        cmds += [
            f"class add dev {dev} parent 1:1 classid {classid} htb rate {PRIORITY_FLOOR_BPS}bit ceil {rate_bps}bit "
            f"burst {burst} cburst {burst} prio {max(PRIORITIES) - p} quantum 1514",
            f"qdisc add dev {dev} parent {classid} handle {PRIORITY_CLASS_BASE + p:x}: bfifo limit {queue_bytes}",
        ]
        if p:  # before any other filter (prio 1): a marked packet goes by its mark alone
            cmds.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip tos {p << 5:#x} 0xe0 "
                        f"flowid {classid}")
    return cmds


def _htb_commands(dev: str, rate_bps: int, queue_bytes: int) -> list[str]:
    """Root HTB with one class at ``rate_bps`` and a priority class (and byte FIFO) per
    priority under it; unmarked traffic goes to priority 0's."""
    return [
        f"qdisc replace dev {dev} root handle 1: htb default {PRIORITY_CLASS_BASE:x}",
        f"class add dev {dev} parent 1: classid 1:1 htb {_htb_rate(rate_bps)}",
        *_priority_commands(dev, rate_bps, queue_bytes, PRIORITIES),
    ]


def _burst_bytes(rate_bps: int) -> int:
    # At least one 64 KiB GSO packet plus 1 ms at the rate, so that big segments do not make
    # HTB undershoot; small enough that a rate change shows within milliseconds.
    return max(64 * 1024 + 1514, rate_bps // 8 // 1000)


def _htb_rate(rate_bps: int) -> str:
    burst = _burst_bytes(rate_bps)
    return f"rate {rate_bps}bit ceil {rate_bps}bit burst {burst} cburst {burst}"


def _fair_uplink_commands(dev: str, rate_bps: int, addresses: Sequence[str], match: str, queue_bytes: int) -> list[str]:
    """HTB at ``rate_bps`` split fairly between ``addresses`` (``match`` is ``src`` or ``dst``)
    for unmarked traffic; marked traffic (priority >= 1) goes to its priority class instead,
    above every host's share (its filter comes first)."""
    shares = len(addresses) + 1  # one class per host plus one for everything else (ARP, ...)
    if shares + 2 > PRIORITY_CLASS_BASE:
        raise ValueError(f"a rack of {len(addresses)} hosts: the emulator shapes at most "
                         f"{PRIORITY_CLASS_BASE - 3} per rack (one HTB class each, below the priority classes)")
    child_rate = max(8000, rate_bps // shares)
    child = f"rate {child_rate}bit ceil {rate_bps}bit burst {_burst_bytes(rate_bps)} prio {max(PRIORITIES)}"
    cmds = [
        f"qdisc replace dev {dev} root handle 1: htb default 2",
        f"class add dev {dev} parent 1: classid 1:1 htb {_htb_rate(rate_bps)}",
        f"class add dev {dev} parent 1:1 classid 1:2 htb {child}",
        f"qdisc add dev {dev} parent 1:2 handle 2: bfifo limit {queue_bytes}",
    ]
    for i, address in enumerate(addresses):
        classid = f"1:{i + 3:x}"
        cmds += [
            f"class add dev {dev} parent 1:1 classid {classid} htb {child}",
            f"qdisc add dev {dev} parent {classid} handle {i + 3:x}: bfifo limit {queue_bytes}",
            f"filter add dev {dev} parent 1: protocol ip prio 2 u32 match ip {match} {address}/32 flowid {classid}",
        ]
    return cmds + _priority_commands(dev, rate_bps, queue_bytes, PRIORITIES[1:])


def _sysctl_script(*, forwarding: bool) -> str:
    values = {
        "net/ipv6/conf/all/disable_ipv6": 1, "net/ipv6/conf/default/disable_ipv6": 1,
        "net/ipv4/conf/all/rp_filter": 0, "net/ipv4/conf/default/rp_filter": 0,
        "net/ipv4/ip_forward": 1 if forwarding else 0,
        # Hosts start from the same TCP as a training cluster's: no slow start after an idle
        # gap (collectives are bursty: the VM's default re-probed every call) and Reno instead
        # of the VM's BBR, which shared a NIC poorly between a parameter server's flows
        # (measured: BML vs star 1.29x with the defaults, 1.74x with these; docs/results.md).
        "net/ipv4/tcp_slow_start_after_idle": 0,
        "net/ipv4/tcp_congestion_control": "reno",
    }
    return "; ".join(f"echo {v} > /proc/sys/{k} 2>/dev/null || true" for k, v in values.items())


@dataclass
class Cluster:
    """A built (or being built) emulated cluster; use as a context manager or call :meth:`teardown`.

    ``Cluster.create(plan)`` builds it; ``set_rate`` / ``read_rate`` change and read a host
    NIC's rate in one direction; ``teardown`` removes everything (idempotent).
    """

    plan: ClusterPlan
    owner_pid: int = field(default_factory=os.getpid)
    #: A directory of the run for :func:`cleanup` to remove once the owner has died (the
    #: launcher's temporary run directory; the owner removes it itself on every other path).
    temporary_dir: str | None = None
    _created: list[str] = field(default_factory=list)
    _rates: dict[tuple[int, int, str], int] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: ClusterPlan, *, temporary_dir: str | None = None) -> Cluster:
        """Build ``plan``; on any failure everything created so far is removed before raising.

        ``temporary_dir`` is recorded with the owner's pid, so that ``mlfabric emu cleanup``
        removes it too after the owner was killed (``kill -9``)."""
        if not have_root():
            raise EmuUnavailableError("building an emulated cluster needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN); "
                                      "run under sudo, or use the loopback fallback of `mlfabric launch`")
        cluster = cls(plan=plan, temporary_dir=temporary_dir)
        try:
            cluster._build()
        except BaseException:
            cluster.teardown()
            raise
        return cluster

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # ---------------------------------------------------------------- build

    def _build(self) -> None:
        plan = self.plan
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps({"pid": self.owner_pid, "created": time.time(),
                                                  "netns": plan.namespaces(), "temporary_dir": self.temporary_dir}))
        for ns in plan.namespaces():
            run(["ip", "netns", "add", ns])
            self._created.append(ns)
        hosts = plan.hosts_file()
        for host in plan.hosts:
            _write_etc_netns(host.netns, "hosts", hosts)
        for ns in plan.namespaces():
            forwarding = plan.forwarding and ns != plan.fabric_ns
            run(["ip", "netns", "exec", ns, "sh", "-c", _sysctl_script(forwarding=forwarding)])
        fabric: list[str] = ["link set lo up"]
        for bridge in plan.bridges:
            fabric += [f"link add {bridge} type bridge stp_state 0 forward_delay 0 mcast_snooping 0",
                       f"link set {bridge} up"]
        for host in plan.hosts:
            for nic in host.nics:
                fabric += [f"link add {nic.switch_dev} type veth peer name {nic.host_dev} netns {host.netns}",
                           f"link set {nic.switch_dev} master {nic.bridge} up"]
        for up in plan.uplinks:
            fabric += [f"link add {up.a_dev} type veth peer name {up.b_dev}",
                       f"link set {up.a_dev} master {up.a_bridge} up", f"link set {up.b_dev} master {up.b_bridge} up"]
        batch("ip", plan.fabric_ns, fabric)
        for index, host in enumerate(plan.hosts):
            cmds = ["link set lo up"]
            for nic in host.nics:
                cmds += [f"addr add {nic.address}/{nic.prefix_len} dev {nic.host_dev}", f"link set {nic.host_dev} up"]
            if plan.routes:
                cmds += [f"route add {dst}/32 via {via} dev {dev}" for dst, via, dev in plan.routes[index]]
            batch("ip", host.netns, cmds)
            tc: list[str] = []
            for nic in host.nics:
                tc += _htb_commands(nic.host_dev, plan.rate_bps, plan.queue_bytes)
                self._rates[(host.rank, nic.nic, "egress")] = plan.rate_bps
            batch("tc", host.netns, tc)
        tc = []
        for host in plan.hosts:
            for nic in host.nics:
                tc += _htb_commands(nic.switch_dev, plan.rate_bps, plan.queue_bytes)
                self._rates[(host.rank, nic.nic, "ingress")] = plan.rate_bps
        for up in plan.uplinks:
            tc += _fair_uplink_commands(up.a_dev, up.rate_bps, up.hosts_behind_a, "src", plan.queue_bytes)
            tc += _fair_uplink_commands(up.b_dev, up.rate_bps, up.hosts_behind_a, "dst", plan.queue_bytes)
        batch("tc", plan.fabric_ns, tc)

    def _state_file(self) -> Path:
        return STATE_DIR / f"{self.plan.prefix}.json"

    # ---------------------------------------------------------------- rates

    def _where(self, host: int, nic: int, direction: str) -> tuple[str, str]:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        nic_plan = self.plan.nic(host, nic)
        if direction == "egress":
            return self.plan.hosts[host].netns, nic_plan.host_dev
        return self.plan.fabric_ns, nic_plan.switch_dev

    def set_rate(self, host: int, nic: int, direction: str, rate_bps: float) -> None:
        """Change one host NIC direction to ``rate_bps`` now (``tc class change``)."""
        self.set_rates([(host, nic, direction, rate_bps)])

    def set_rates(self, changes: Sequence[tuple[int, int, str, float]]) -> None:
        """Apply several ``(host, nic, direction, rate_bps)`` changes, one ``tc`` process per namespace."""
        per_ns: dict[str, list[str]] = {}
        for host, nic, direction, rate in changes:
            rate_int = int(round(rate))
            if rate_int < 8000:
                raise ValueError(f"rate {rate!r} bit/s for host {host} NIC {nic} {direction} is below 8 kbit/s")
            ns, dev = self._where(host, nic, direction)
            per_ns.setdefault(ns, []).append(f"class change dev {dev} parent 1: classid 1:1 htb {_htb_rate(rate_int)}")
        for ns, cmds in per_ns.items():
            batch("tc", ns, cmds)
        for host, nic, direction, rate in changes:
            self._rates[(host, nic, direction)] = int(round(rate))

    def rate(self, host: int, nic: int, direction: str) -> int:
        """The rate last set (bit/s), from this object's bookkeeping."""
        self._where(host, nic, direction)
        return self._rates[(host, nic, direction)]

    def read_rate(self, host: int, nic: int, direction: str) -> int:
        """The rate the kernel enforces now (bit/s), read back from ``tc class show``.

        ``tc`` prints rates rounded to about four significant digits (``33333Kbit``), so
        compare with a relative tolerance of 1e-3.
        """
        ns, dev = self._where(host, nic, direction)
        argv = ["tc", "-n", ns, "class", "show", "dev", dev, "classid", "1:1"]
        proc = run(argv)
        match = re.search(r"\brate (\S+)", proc.stdout)
        if match is None:
            raise EmuCommandError(argv, 0, f"no rate in the output {proc.stdout!r}")
        return int(round(parse_rate(match.group(1))))

    # ---------------------------------------------------------------- teardown

    def teardown(self) -> None:
        """Kill processes left in the namespaces and delete them (idempotent, never raises for leftovers)."""
        errors = _delete_namespaces(list(reversed(self._created)))
        self._created.clear()
        try:
            self._state_file().unlink(missing_ok=True)
        except OSError:
            pass
        if errors:
            raise RuntimeError("teardown left things behind; run `mlfabric emu cleanup`:\n" + "\n".join(errors))


def _write_etc_netns(netns: str, name: str, text: str) -> None:
    """Write ``/etc/netns/<netns>/<name>`` (what ``ip netns exec`` shows as ``/etc/<name>``)."""
    for attempt in range(3):
        # Another run's cleanup may remove an empty /etc/netns between the mkdir and the write.
        try:
            (ETC_NETNS / netns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / netns / name).write_text(text)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _remove_etc_netns(netns: str) -> bool:
    """Remove ``/etc/netns/<netns>`` (and ``/etc/netns`` once empty); True if there was one."""
    path = ETC_NETNS / netns
    existed = path.exists()
    shutil.rmtree(path, ignore_errors=True)
    try:
        ETC_NETNS.rmdir()  # only when no other run has files there
    except OSError:
        pass
    return existed


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    errors = []
    for ns in names:
        proc = run(["ip", "netns", "pids", ns], check=False)
        for pid in proc.stdout.split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        proc = run(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0 and ns in _netns_list():
            errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
        _remove_etc_netns(ns)
    return errors


# --------------------------------------------------------------------------- leftovers


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _new_entry() -> dict[str, object]:
    return {"netns": [], "pid": None, "alive": False, "etc_netns": [], "temporary_dir": None}


def _run_temporary_dir(prefix: str, recorded: object) -> str | None:
    """The temporary run directory a state file records, if it is one of this run's
    (``.../mlfabric-emu-<prefix>-*``, as the launcher names them): a damaged or foreign state
    file must not make ``cleanup`` remove anything else."""
    if not isinstance(recorded, str) or not os.path.basename(recorded).startswith(f"mlfabric-emu-{prefix}-"):
        return None
    return recorded


def list_runs() -> dict[str, dict[str, object]]:
    """Emulator runs present on this machine: prefix -> {netns, pid, alive, etc_netns,
    temporary_dir} (``etc_netns``: the run's ``/etc/netns`` directories, its hosts files;
    ``temporary_dir``: the launcher's temporary run directory, while it exists)."""
    runs: dict[str, dict[str, object]] = {}
    for ns in _netns_list():
        match = _OWNED_NS_RE.match(ns)
        if match:
            runs.setdefault(match.group(1), _new_entry())["netns"].append(ns)  # type: ignore[attr-defined]
    if ETC_NETNS.is_dir():
        for path in sorted(ETC_NETNS.iterdir()):
            match = _OWNED_NS_RE.match(path.name)
            if match:
                runs.setdefault(match.group(1), _new_entry())["etc_netns"].append(path.name)  # type: ignore[attr-defined]
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob("mf*.json"):
            prefix = path.stem
            try:
                state = json.loads(path.read_text())
                pid = int(state["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                state, pid = {}, 0
            entry = runs.setdefault(prefix, _new_entry())
            entry["pid"] = pid or None
            entry["alive"] = bool(pid) and _pid_alive(pid)
            temporary_dir = _run_temporary_dir(prefix, state.get("temporary_dir") if isinstance(state, dict) else None)
            if temporary_dir is not None and os.path.isdir(temporary_dir):
                entry["temporary_dir"] = temporary_dir
    return runs


def cleanup(*, force: bool = False, prefix: str | None = None) -> list[str]:
    """Remove what runs whose owner died left behind; return what went.

    That is their namespaces (and so their links and bridges), their hosts files
    (``/etc/netns/<prefix>-*``) and the launcher's temporary run directory
    (``$TMPDIR/mlfabric-emu-<prefix>-*``: ``cluster.json``, the churn trace; a kept or named
    run directory is never recorded, so never removed). Runs whose owner process is still
    alive are left alone unless ``force``. Also deletes any link named ``mf<hex>...`` in the
    machine's own namespace (the emulator creates none, but an interrupted older run might have).
    """
    removed: list[str] = []
    errors: list[str] = []
    for run_prefix, entry in sorted(list_runs().items()):
        if prefix is not None and run_prefix != prefix:
            continue
        if entry["alive"] and not force:
            continue
        names = sorted(entry["netns"], key=lambda ns: ns.endswith("-sw"))  # type: ignore[arg-type]
        errors += _delete_namespaces(names)
        removed += names
        for ns in entry["etc_netns"]:  # type: ignore[attr-defined]
            if _remove_etc_netns(ns):
                removed.append(str(ETC_NETNS / ns))
        temporary_dir = entry["temporary_dir"]
        if isinstance(temporary_dir, str):
            shutil.rmtree(temporary_dir, ignore_errors=True)
            if os.path.exists(temporary_dir):
                errors.append(f"could not remove the run directory {temporary_dir}")
            else:
                removed.append(temporary_dir)
        (STATE_DIR / f"{run_prefix}.json").unlink(missing_ok=True)
    proc = run(["ip", "-o", "link", "show"], check=False)
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if _OWNED_LINK_RE.match(name) and (prefix is None or name.startswith(prefix)):
            if run(["ip", "link", "del", name], check=False).returncode == 0:
                removed.append(name)
    if errors:
        raise RuntimeError("cleanup could not remove everything:\n" + "\n".join(errors))
    return removed
