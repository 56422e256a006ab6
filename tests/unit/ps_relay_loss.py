"""Shared by the tests of a relay lost while it passes the model on (a §10.3 distributor, a
#36 multicast relay): four workers run two BSP rounds on threads while the test's patch kills
one relay; returns what every rank ended with, after checking that no rank hung.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduled.py tests/unit/test_ps_trees_runtime.py -q -k lost
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from mlfabric.ps import PSConfig, PSLayout, local_jobs

WORKERS = 4


def two_rounds_losing_a_relay(config: PSConfig, size: int) -> dict[Any, Any]:
    """Each worker pulls, pushes and clocks twice, then leaves; ``finals[index]`` is its last
    pulled model or the RuntimeError it ended with, ``finals["server"]`` the server's stats."""
    jobs = local_jobs(PSLayout(servers=1, workers=WORKERS), config)
    finals: dict[Any, Any] = {}

    def work(job: Any) -> None:
        if job.role == "server":
            finals["server"] = job.serve()
            return
        w = job.worker
        w.init_model("m", torch.zeros(size), lr=1.0)
        try:
            for _ in range(2):
                params = w.pull_flat("m")
                w.push("m", params - 1)
                w.clock()
            w.leave()
            finals[w.index] = params
        except RuntimeError as exc:
            finals[w.index] = exc

    threads = [threading.Thread(target=work, args=(j,), daemon=True) for j in jobs]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert time.monotonic() - started < 10
    for j in jobs:
        j.comm.close()
    return finals


def lost_and_survivors(finals: dict[Any, Any]) -> tuple[list[int], list[torch.Tensor]]:
    """The workers that ended with an error, and the others' models (to compare)."""
    gone = [w for w in range(WORKERS) if isinstance(finals[w], RuntimeError)]
    return gone, [finals[w] for w in range(WORKERS) if w not in gone]
