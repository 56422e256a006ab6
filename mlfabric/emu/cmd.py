"""Running ``ip``/``tc``/``sysctl`` for the emulator, with errors that name the command.

Every kernel-facing step of :mod:`mlfabric.emu` goes through :func:`run` (one command) or
:func:`batch` (many ``ip``/``tc`` commands in one process, ``ip -n NS -batch -``), so a failure
always raises :class:`EmuCommandError` carrying the exact command line and its stderr.

Exercise it with::

    .venv/bin/python -m pytest tests/emu/test_cluster.py -q
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["EmuCommandError", "EmuUnavailableError", "run", "batch", "have_root", "ns_exec_prefix"]


class EmuCommandError(RuntimeError):
    """An ``ip``/``tc``/``sysctl`` command failed; ``command`` and ``stderr`` say which and why."""

    def __init__(self, command: Sequence[str], returncode: int, stderr: str, *, stdin: str | None = None) -> None:
        self.command = tuple(command)
        self.returncode = returncode
        self.stderr = stderr.strip()
        text = f"command failed (exit {returncode}): {shlex.join(self.command)}\n  stderr: {self.stderr or '(empty)'}"
        if stdin:
            lines = stdin.strip().splitlines()
            shown = "\n    ".join(lines[:20]) + ("\n    ..." if len(lines) > 20 else "")
            text += f"\n  batch input:\n    {shown}"
        super().__init__(text)


class EmuUnavailableError(RuntimeError):
    """The emulator cannot run here (no root, no iproute2, ...); the message says what is missing."""


def have_root() -> bool:
    """True when this process may create namespaces and change qdiscs (root or CAP_NET_ADMIN + CAP_SYS_ADMIN)."""
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return bool(caps & (1 << 12)) and bool(caps & (1 << 21))  # NET_ADMIN, SYS_ADMIN
    except OSError:
        pass
    return False


#: The Debian package of each system tool the emulator runs (``ip``/``tc`` otherwise).
_PACKAGES = {"unshare": "util-linux"}


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        package = _PACKAGES.get(name, "iproute2")
        raise EmuUnavailableError(f"{name!r} not found: install {package} (Debian: apt-get install {package})")
    return path


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one command (the first word is looked up on PATH and in /usr/sbin); raise on failure."""
    command = [_tool(argv[0]), *argv[1:]]
    try:
        proc = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise EmuCommandError(argv, -1, f"timed out after {timeout:g}s", stdin=stdin) from exc
    if check and proc.returncode != 0:
        raise EmuCommandError(argv, proc.returncode, proc.stderr, stdin=stdin)
    return proc


def batch(tool: str, netns: str | None, commands: Sequence[str], *, force: bool = False) -> None:
    """Run ``commands`` (lines without the tool name) in one ``ip``/``tc`` ``-batch`` process.

    ``netns`` runs them inside that named namespace (``-n``). ``force`` keeps going after an
    error (``-force``, for teardown); otherwise the first failing line raises.
    """
    if not commands:
        return
    argv = [tool]
    if netns is not None:
        argv += ["-n", netns]
    if force:
        argv.append("-force")
    argv += ["-batch", "-"]
    run(argv, stdin="\n".join(commands) + "\n", check=not force)


#: Sets the new UTS namespace's hostname to ``$0`` and runs the rest: ``unshare --uts`` gives
#: the program its own hostname without a ``hostname`` binary or any state to clean up.
_SET_HOSTNAME = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'


def ns_exec_prefix(netns: str, hostname: str | None = None) -> list[str]:
    """The command prefix that runs a program inside ``netns``, as ``hostname`` when given.

    ``ip netns exec`` also bind-mounts ``/etc/netns/<netns>/hosts`` (if present) over
    ``/etc/hosts`` for the program; with ``hostname`` the program gets a UTS namespace of its
    own (``unshare --uts``) whose hostname is set before the command starts, so
    ``socket.gethostname()`` names the emulated host instead of the machine.
    """
    prefix = [_tool("ip"), "netns", "exec", netns]
    if hostname is None:
        return prefix
    return [*prefix, _tool("unshare"), "--uts", "--", "sh", "-c", _SET_HOSTNAME, hostname]
