"""The train harness's straggler injections: MLfabric's C1-C3 presets scale each step's own compute.

    python -m pytest tests/unit/test_train_inject.py -q
"""

from __future__ import annotations

import pytest



def test_step_delay_scales_mlfabric_presets_by_the_steps_compute() -> None:
    from mlfabric.train.harness import StepDelay

    c2 = StepDelay("C2", 0, 4, seed=3)  # 10% of steps take 4x their compute
    delays = [c2(0.01) for _ in range(400)]
    slow = [d for d in delays if d > 0]
    assert all(d == pytest.approx(0.03) for d in slow)  # (4 - 1) x 10 ms
    assert 0.04 < len(slow) / len(delays) < 0.2
    absolute = StepDelay("one-random:50ms", 0, 1, seed=0)  # one of one worker: every step
    assert absolute(123.0) == pytest.approx(0.05)
    assert StepDelay("none", 0, 4, seed=0)(1.0) == 0.0
