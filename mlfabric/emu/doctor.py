"""``mlfabric emu doctor``: what this machine offers the emulator, and what is missing.

    mlfabric emu doctor            # or: .venv/bin/python -m mlfabric.emu doctor

Checks root, iproute2 (``ip``, ``tc``), ``unshare --uts`` (util-linux: each rank gets its emulated
host's hostname), and then actually tries, in a throw-away namespace
named like any run (``mf<hex>-sw``, removed at once): creating a namespace, a veth pair, a
bridge, and the ``htb``, ``tbf`` and ``bfifo`` qdiscs (``netem``, ``fq_codel`` and ``ifb`` are
reported as optional: the emulator does not need them).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from mlfabric.emu.cmd import EmuCommandError, EmuUnavailableError, have_root, run

__all__ = ["Check", "doctor", "DEBIAN_PACKAGES"]

#: What the emulator needs from the system, as Debian/Ubuntu packages.
DEBIAN_PACKAGES = ("iproute2", "util-linux")


@dataclass(frozen=True, kw_only=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _try(argv: list[str]) -> tuple[bool, str]:
    try:
        run(argv)
        return True, "ok"
    except (EmuCommandError, EmuUnavailableError) as exc:
        return False, str(exc).splitlines()[-1].strip()


def doctor() -> list[Check]:
    """Run every check; required ones must all pass for ``mlfabric launch`` to emulate."""
    checks = [Check(name="root", ok=have_root(),
                    detail="euid 0 or CAP_NET_ADMIN+CAP_SYS_ADMIN" if have_root() else
                    "not root: `mlfabric launch` will fall back to local processes on loopback (rates not enforced)")]
    for tool in ("ip", "tc"):
        path = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
        version = ""
        if path:
            proc = run([tool, "-V"], check=False)
            version = (proc.stdout or proc.stderr).strip()
        checks.append(Check(name=f"iproute2: {tool}", ok=path is not None,
                            detail=f"{path} ({version})" if path else "missing: apt-get install iproute2"))
    # Every rank runs under `unshare --uts` so that it has its emulated host's name.
    ok, detail = _try(["unshare", "--uts", "--", "true"])
    checks.append(Check(name="hostnames (unshare --uts)", ok=ok, detail=detail))
    if not all(c.ok for c in checks):
        return checks
    from mlfabric.emu.cluster import new_prefix

    ns = f"{new_prefix()}-sw"
    ok, detail = _try(["ip", "netns", "add", ns])
    checks.append(Check(name="network namespaces", ok=ok, detail=detail))
    if not ok:
        return checks
    try:
        ok, detail = _try(["ip", "-n", ns, "link", "add", "va", "type", "veth", "peer", "name", "vb"])
        checks.append(Check(name="veth pairs", ok=ok, detail=detail))
        ok_br, detail = _try(["ip", "-n", ns, "link", "add", "name", "mfbr", "type", "bridge"])
        checks.append(Check(name="linux bridge", ok=ok_br, detail=detail))
        if ok:
            for qdisc, args, required in (("htb", ["htb", "default", "1"], True), ("tbf", ["tbf", "rate", "1mbit", "burst", "32kb", "latency", "50ms"], False),
                                          ("bfifo", ["bfifo", "limit", "100000"], True),
                                          ("netem", ["netem", "delay", "1ms"], False),
                                          ("fq_codel", ["fq_codel"], False)):
                ok_q, detail = _try(["tc", "-n", ns, "qdisc", "replace", "dev", "va", "root", *args])
                checks.append(Check(name=f"tc qdisc {qdisc}", ok=ok_q, detail=detail, required=required))
            ok_f, detail = _try(["tc", "-n", ns, "filter", "add", "dev", "va", "parent", "1:", "protocol", "ip",
                                 "prio", "1", "u32", "match", "ip", "src", "10.0.0.1/32", "flowid", "1:1"]) \
                if _try(["tc", "-n", ns, "qdisc", "replace", "dev", "va", "root", "handle", "1:", "htb"])[0] else (False, "no htb")
            checks.append(Check(name="tc filter u32", ok=ok_f, detail=detail))
        ok_ifb, detail = _try(["ip", "-n", ns, "link", "add", "ifbx", "type", "ifb"])
        checks.append(Check(name="ifb", ok=ok_ifb, detail=detail + " (not needed: ingress is shaped on the bridge side)",
                            required=False))
    finally:
        run(["ip", "netns", "del", ns], check=False)
    return checks
