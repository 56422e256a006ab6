"""The partial-allreduce floor (mlfabric/bench/partial_floor.py): the minimal runtime runs the
microbenchmark's protocol correctly on real processes, so its figures are a fair reference.

Run: python -m pytest tests/local/test_partial_floor.py
"""

from __future__ import annotations

import pytest

from mlfabric.bench.partial_floor import VARIANTS, run_floor

pytestmark = pytest.mark.local


@pytest.mark.parametrize("reader_threads", [False, True], ids=["event-loop", "reader-threads"])
def test_floor_rounds_are_consistent_and_partial_rounds_start_early(reader_threads: bool) -> None:
    result = run_floor(4, 3, warmup=1, slot_s=0.1, reader_threads=reader_threads)
    assert result.reader_threads is reader_threads
    assert result.correct  # every rank saw the same count each round; synchronous counted all 4
    assert result.mean_active["synchronous"] == 4
    # Solo starts with the first caller: the others' calls come later, so few ranks are fresh
    # and the mean latency is far below the synchronous one, which waits for the last rank.
    assert 1 <= result.mean_active["solo"] < 4
    assert 1 <= result.mean_active["majority"] <= 4
    assert result.mean_latency_s["solo"] < 0.5 * result.mean_latency_s["synchronous"]
    # The synchronous mean cannot be below the skew's mean wait (ranks 1..4 of 1..32 ms skew).
    assert result.mean_latency_s["synchronous"] > 0.010
    assert set(result.mean_latency_s) == set(VARIANTS)
    assert result.cpu_per_rank_round_s > 0


def test_floor_needs_two_processes() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        run_floor(1, 1)
