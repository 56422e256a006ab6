"""Count the stops (function frames of mlfabric's own code) from ``PSWorker.push`` to the socket (issue 35, check 6).

    .venv/bin/python tools/push_stops.py            # a direct push, one server, over tcp

A worker and a server on two TcpTransports in this process; ``socket.socket.sendmsg`` (the call
that hands a frame to the kernel) is wrapped to capture the stack at the worker's first push:
the frames from ``PSWorker.push`` down to the frame that calls ``sendmsg`` are counted, each
named ``file:function``. Also counted: how many times the push's header is JSON-encoded
(``protocol.encode`` calls during the push) -- once per server component is the floor.
"""

from __future__ import annotations

import socket
import sys
import threading
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlfabric.ps import PSConfig, PSLayout, protocol  # noqa: E402
from mlfabric.ps.server import ParameterServer  # noqa: E402
from mlfabric.ps.worker import PSWorker  # noqa: E402
from mlfabric.transport.tcp import TcpTransport  # noqa: E402


def measure() -> tuple[list[str], int]:
    """The frames (``file:line function``) of our code from ``PSWorker.push`` to ``socket.sendmsg``
    at a direct push, and how many times a header was JSON-encoded during that push."""
    token = b"push-stops-16byte"[:16]
    transports = [TcpTransport(0, 2, token), TcpTransport(1, 2, token)]
    transports[0].connect({1: transports[1].endpoints})
    transports[1].connect({0: transports[0].endpoints})
    layout, config = PSLayout(servers=1, workers=1), PSConfig(consistency="async", timeout_s=20)
    server = ParameterServer(transports[0], layout, config)
    serving = server.start()
    worker = PSWorker(transports[1], layout, config)
    worker.init_model("m", torch.zeros(1024))
    captured: list[list[traceback.FrameSummary]] = []
    encodes = [0]
    real_sendmsg, real_encode = socket.socket.sendmsg, protocol.encode
    pushing = threading.local()

    def sendmsg(self: socket.socket, *args: object, **kwargs: object) -> int:
        if getattr(pushing, "on", False) and not captured:
            captured.append(traceback.extract_stack()[:-1])
        return real_sendmsg(self, *args, **kwargs)

    def encode(**fields: object) -> bytes:
        if getattr(pushing, "on", False):
            encodes[0] += 1
        return real_encode(**fields)

    socket.socket.sendmsg = sendmsg  # type: ignore[method-assign]
    protocol.encode = encode  # type: ignore[assignment]
    try:
        pushing.on = True
        worker.push("m", torch.ones(1024))
        pushing.on = False
    finally:
        protocol.encode = real_encode  # type: ignore[assignment]
        socket.socket.sendmsg = real_sendmsg  # type: ignore[method-assign]
        worker.leave()
        serving.join(10)
        for t in transports:
            t.close()
    if not captured:
        raise RuntimeError("no sendmsg on the pushing thread: the transport's sender thread sent the push")
    stack = captured[0]
    start = next(i for i, f in enumerate(stack) if f.name == "push" and f.filename.endswith("ps/worker.py"))
    ours = [f for f in stack[start:] if str(ROOT / "mlfabric") in f.filename]
    return [f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in ours], encodes[0]


def main() -> None:
    frames, encodes = measure()
    for frame in frames:
        print(f"  {frame}")
    files = {frame.split(":")[0] for frame in frames}
    print(f"{len(frames)} stops from PSWorker.push to socket.sendmsg, in {len(files)} files; "
          f"header JSON-encoded {encodes} time(s) for 1 server component")


if __name__ == "__main__":
    main()
