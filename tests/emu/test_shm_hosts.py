"""Shared memory beside the network (root): emulated hosts with 2 ranks each, every
collective correct with each rank's host-mate over shared memory and the other host's ranks
over TCP through the shaped NIC (issue #27's check 2).

    sudo .venv/bin/python -m pytest tests/emu/test_shm_hosts.py -q
"""

from __future__ import annotations

import pytest

from tests.emu.conftest import needs_root
from tests.local.test_shm import DTYPES, SIZES, check_every_collective


def _mixed_rank() -> dict:
    import mlfabric

    comm = mlfabric.init("tcp", timeout=120)
    try:
        transport = comm.transport
        return {"checked": check_every_collective(comm), "hosts": comm.hosts,
                "shm_peers": sorted(transport._shm_peers),
                "tcp_peers": sorted({peer for peer, _ in transport._outgoing})}
    finally:
        comm.close()


@needs_root
@pytest.mark.usefixtures("no_leaks")
def test_every_collective_with_local_and_remote_peers() -> None:
    from mlfabric.bench.procs import run_ranks
    from mlfabric.emu.launcher import emulated_launch

    with emulated_launch("star:n=2", 1e9, ranks_per_host=2, timeout_s=240) as launch:
        results = run_ranks(_mixed_rank, config=launch)
    for rank, result in enumerate(results):
        mate = rank ^ 1
        assert result["hosts"] == (0, 0, 1, 1)
        assert result["shm_peers"] == [mate]                                    # same namespace: memory
        assert result["tcp_peers"] == [p for p in range(4) if p // 2 != rank // 2]  # the other host: its NIC
        # every collective incl. host_hierarchical (auto picks it: 2 hosts of 2 ranks), all dtypes, sizes
        assert result["checked"] == len(DTYPES) * len(SIZES) * 10
