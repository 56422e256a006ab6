"""Shared by the tests that answer a batch of pulls on a server by hand (§10.3 distributors,
#36 multicast, the typed model header): every worker of a local job waits for its model on
a thread, as a pulling worker does, and the test collects what each one got.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py tests/unit/test_ps_protocol_typed.py -q -k "pulls or batch"
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from mlfabric.ps import PSLayout
from mlfabric.ps.shard import PendingPull


def waiting_pulls(layout: PSLayout, jobs: list[Any]) -> tuple[list[PendingPull], Callable[[], dict[int, Any]]]:
    """One pending pull per worker of ``jobs`` (request id 100 + rank), each worker already
    waiting for its answer on a thread; ``collect()`` joins them (10 s each) and returns
    ``{rank: (version, values)}`` of the models that arrived."""
    got: dict[int, Any] = {}

    def receive(job: Any, request_id: int) -> None:
        header, msg = job.worker._await_model(0, request_id, "m", None, "test pull")
        got[job.rank] = (header["version"], torch.frombuffer(bytearray(msg.payload), dtype=torch.float32))

    workers = [j for j in jobs if j.role == "worker"]
    pulls = [PendingPull(rank=j.rank, worker=layout.worker_index(j.rank), request_id=100 + j.rank, clock=0,
                         staleness=float("inf"), arrived=0.0) for j in workers]
    threads = [threading.Thread(target=receive, args=(j, 100 + j.rank), daemon=True) for j in workers]
    for t in threads:
        t.start()

    def collect() -> dict[int, Any]:
        for t in threads:
            t.join(10)
        return got

    return pulls, collect
