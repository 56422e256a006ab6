"""A tiny TCP goodput meter (sender / receiver) to run inside emulated hosts.

    ip netns exec mf1a2b-h1 python -m mlfabric.emu.goodput recv --bind 10.0.0.2 --port 5201
    ip netns exec mf1a2b-h0 python -m mlfabric.emu.goodput send --to 10.0.0.2 --port 5201 --seconds 3

The receiver prints ``READY`` once it listens, then one JSON line when the sender closes:
``{"bytes": ..., "samples": [[unix_time, cumulative_bytes], ...]}`` with a sample every
``--interval`` seconds (and at the first and last byte). :func:`goodput_bps` turns samples
into a rate over a time window, so warm-up (queue filling, HTB burst) can be left out.

:func:`run_flows` starts such pairs inside the namespaces of a built cluster, all at once;
:func:`two_host_goodput_bps` is the reference of the emulated benchmarks (what one TCP flow
gets between two hosts of the same cluster, measured in the same run). The tests in
``tests/emu`` use both to check the shapers.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mlfabric.bench.procs import stop_processes

if TYPE_CHECKING:
    from mlfabric.emu.cluster import ClusterPlan

__all__ = ["WARMUP_S", "goodput_bps", "receive", "run_flows", "send", "steady_goodput_bps", "two_host_goodput_bps"]

#: Seconds left out at the start of a flow (queue filling, the shaper's burst).
WARMUP_S = 0.5

_CHUNK = 256 * 1024


def receive(bind: str, port: int, *, interval_s: float = 0.1, timeout_s: float = 60.0) -> dict[str, object]:
    """Accept one connection on ``bind:port``, read it to EOF, return byte count and samples."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((bind, port))
        server.listen(1)
        server.settimeout(timeout_s)
        print("READY", flush=True)
        conn, peer = server.accept()
    total = 0
    samples: list[list[float]] = []
    buffer = bytearray(_CHUNK)
    with conn:
        conn.settimeout(timeout_s)
        next_sample = 0.0
        while True:
            n = conn.recv_into(buffer)
            now = time.time()
            if n == 0:
                break
            if not samples:
                samples.append([now, 0])
                next_sample = now + interval_s
            total += n
            if now >= next_sample:
                samples.append([now, total])
                next_sample = now + interval_s
    if samples and samples[-1][1] != total:
        samples.append([time.time(), total])
    return {"bytes": total, "peer": peer[0], "samples": samples}


def send(to: str, port: int, *, seconds: float, connect_timeout_s: float = 10.0, tos: int = 0) -> int:
    """Send as fast as TCP allows for ``seconds``; return the bytes sent. ``tos``: the
    connection's IP TOS byte (:func:`mlfabric.transport.sockets.priority_tos`)."""
    payload = b"\0" * _CHUNK
    deadline = time.monotonic() + connect_timeout_s
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if tos:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        sock.settimeout(connect_timeout_s)
        try:
            sock.connect((to, port))
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sent = 0
    with sock:
        sock.settimeout(seconds + 30.0)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sent += sock.send(payload)
        sock.shutdown(socket.SHUT_WR)
    return sent


def goodput_bps(samples: Sequence[Sequence[float]], start: float | None = None, end: float | None = None) -> float:
    """Bit/s between the samples nearest to ``start`` and ``end`` (unix times; default: all)."""
    if len(samples) < 2:
        raise ValueError("need at least two samples to measure a rate")
    chosen = [s for s in samples if (start is None or s[0] >= start) and (end is None or s[0] <= end)]
    if len(chosen) < 2:
        raise ValueError(f"fewer than two samples in the window [{start}, {end}]")
    (t0, b0), (t1, b1) = chosen[0], chosen[-1]
    if t1 <= t0:
        raise ValueError("samples span no time")
    return (b1 - b0) * 8 / (t1 - t0)


def run_flows(plan: ClusterPlan, pairs: Sequence[tuple[int, int]], *, seconds: float = 2.5,
              port: int = 5201, during: Callable[[], None] | None = None,
              tos: Sequence[int] | None = None) -> list[dict]:
    """One TCP flow per ``(src, dst)`` host pair of a built cluster, all at once; the
    receivers' JSON (see :func:`receive`), in order. ``during`` (optional) is called once all
    senders have started. Flow ``i`` uses port ``port + i`` on its receiver and, with
    ``tos``, the IP TOS byte ``tos[i]``."""
    # Run this file as a script: ``-m mlfabric...`` would import the package (and torch) per flow.
    command = [sys.executable, __file__]
    receivers: list[subprocess.Popen[str]] = []
    senders: list[subprocess.Popen[bytes]] = []
    try:
        for i, (_, dst) in enumerate(pairs):
            host = plan.hosts[dst]
            proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *command, "recv", "--bind", host.address,
                                     "--port", str(port + i), "--timeout", str(seconds + 30)],
                                    stdout=subprocess.PIPE, text=True)
            receivers.append(proc)
            assert proc.stdout is not None
            ready = proc.stdout.readline().strip()
            if ready != "READY":
                raise RuntimeError(f"goodput receiver on host {dst} did not start (said {ready!r})")
        for i, (src, dst) in enumerate(pairs):
            senders.append(subprocess.Popen(["ip", "netns", "exec", plan.hosts[src].netns, *command, "send",
                                             "--to", plan.hosts[dst].address, "--port", str(port + i),
                                             "--seconds", str(seconds), "--tos",
                                             str(tos[i] if tos else 0)],
                                            stdout=subprocess.DEVNULL))
        if during is not None:
            during()
        for (src, dst), sender in zip(pairs, senders):
            if sender.wait(timeout=seconds + 30) != 0:
                raise RuntimeError(f"goodput sender {src} -> {dst} failed (exit {sender.returncode})")
        results = []
        for proc in receivers:
            out, _ = proc.communicate(timeout=30)
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        stop_processes([*receivers, *senders])


def two_host_goodput_bps(plan: ClusterPlan, *, src: int = 0, dst: int = 1, seconds: float = 2.5,
                         port: int = 5201) -> float:
    """Goodput (bit/s) of one TCP flow from host ``src`` to host ``dst``, warm-up left out."""
    [result] = run_flows(plan, [(src, dst)], seconds=seconds, port=port)
    return steady_goodput_bps(result)


def steady_goodput_bps(result: dict) -> float:
    """Goodput (bit/s) of one flow's receiver JSON (:func:`run_flows`), warm-up left out."""
    samples = result["samples"]
    return goodput_bps(samples, start=samples[0][0] + WARMUP_S)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlfabric.emu.goodput", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    recv = sub.add_parser("recv", help="receive one connection and print samples as JSON")
    recv.add_argument("--bind", required=True)
    recv.add_argument("--port", type=int, required=True)
    recv.add_argument("--interval", type=float, default=0.1)
    recv.add_argument("--timeout", type=float, default=60.0)
    snd = sub.add_parser("send", help="send for --seconds")
    snd.add_argument("--to", required=True)
    snd.add_argument("--port", type=int, required=True)
    snd.add_argument("--seconds", type=float, default=3.0)
    snd.add_argument("--tos", type=int, default=0)
    args = parser.parse_args(argv)
    if args.mode == "recv":
        print(json.dumps(receive(args.bind, args.port, interval_s=args.interval, timeout_s=args.timeout)), flush=True)
    else:
        print(json.dumps({"sent": send(args.to, args.port, seconds=args.seconds, tos=args.tos)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
