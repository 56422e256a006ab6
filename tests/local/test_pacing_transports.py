"""User-space pacing of the zmq and tcp transports between two processes: goodput within
10% of the configured rate (the emulator's check for its no-root fallback).

Run: python -m pytest tests/local/test_pacing_transports.py
"""

from __future__ import annotations

import time

import pytest
import torch

import mlfabric
from mlfabric.bench.procs import run_ranks

pytestmark = pytest.mark.local

MESSAGES, MESSAGE_BYTES = 12, 250_000


def _stream(transport: str, pace: str) -> float:
    comm = mlfabric.init(transport, timeout=30, pace=pace)
    payload = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    try:
        comm.barrier()
        start = time.monotonic()
        if comm.rank == 0:
            handles = [comm.transport.send(1, 1000 + i, memoryview(payload.numpy())) for i in range(MESSAGES)]
            while not all(h.done() for h in handles):
                time.sleep(0.001)
            comm.barrier()
            return 0.0
        for i in range(MESSAGES):
            comm.transport.recv(1000 + i, src=0, timeout=20)
        elapsed = time.monotonic() - start
        comm.barrier()
        return MESSAGES * MESSAGE_BYTES * 8 / elapsed
    finally:
        comm.close()


@pytest.mark.parametrize("transport", ["zmq", "tcp"])
@pytest.mark.parametrize("rate", [20e6, 100e6])
def test_paced_goodput_is_within_ten_percent(transport: str, rate: float) -> None:
    goodput = run_ranks(_stream, 2, args=(transport, f"{rate / 1e6:g}mbit"), timeout=60)[1]
    assert 0.9 * rate <= goodput <= 1.1 * rate, f"{goodput / 1e6:.1f} Mbit/s at {rate / 1e6:g} Mbit/s"


def test_pacing_is_refused_on_the_torch_transport() -> None:
    with pytest.raises(ValueError, match="zmq or tcp"):
        mlfabric.init("torch", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, pace="1gbit")
