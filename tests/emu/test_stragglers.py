"""Straggler and delay-injection models (pure logic).

    .venv/bin/python -m pytest tests/emu/test_stragglers.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from mlfabric.emu.stragglers import (
    STRAGGLER_PRESETS, ImbalanceInjector, LinearSkew, RandomDelay, StragglerModel, imbalance_model,
)


def test_presets_are_mlfabric_c1_c3():
    assert {k: (m.probability, m.slowdown) for k, m in STRAGGLER_PRESETS.items()} == {
        "C1": (0.10, 2.0), "C2": (0.10, 4.0), "C3": (0.04, 2.0)}


def test_straggler_factors_seeded_frequency_and_prefix_stable():
    model = STRAGGLER_PRESETS["C2"]
    a = model.factors(2000, 16, seed=7)
    assert set(np.unique(a)) <= {1.0, 4.0}
    assert np.mean(a == 4.0) == pytest.approx(0.10, abs=0.01)
    assert np.array_equal(a, model.factors(2000, 16, seed=7))
    assert np.array_equal(a[:10], model.factors(10, 16, seed=7))
    assert not np.array_equal(a, model.factors(2000, 16, seed=8))
    rows = model.rows(16, seed=7, compute_s=0.5)
    assert np.allclose([next(rows) for _ in range(50)], (a[:50] - 1) * 0.5)


def test_simulator_draws_the_same_stragglers_as_the_emulator():
    """For a seed, a simulated run slows exactly the workers the emulator would slow."""
    sim = pytest.importorskip("mlfabric.sim.compute")
    model = StragglerModel(probability=0.1, slowdown=2.0)
    times = sim.ComputeModel(compute_s=0.5, straggler=model).compute_times(100, 8, seed=3)
    emulator_delays = model.delays(100, 8, seed=3, compute_s=0.5)
    assert set(np.unique(times)) == {0.5, 1.0}
    assert np.array_equal(times == 1.0, emulator_delays == 0.5)
    assert 0.05 < (times == 1.0).mean() < 0.15


def test_random_delay_one_worker_per_step():
    d = RandomDelay(delay_s=0.2).delays(500, 8, seed=1)
    assert d.shape == (500, 8)
    assert np.all((d > 0).sum(axis=1) == 1) and np.all(d[d > 0] == 0.2)
    assert np.all(np.bincount(np.argmax(d, axis=1), minlength=8) > 30)  # every worker gets picked
    assert np.array_equal(d, RandomDelay(delay_s=0.2).delays(500, 8, seed=1))
    four = RandomDelay(delay_s=0.3, count=4).delays(20, 64, seed=0)
    assert np.all((four > 0).sum(axis=1) == 4)
    with pytest.raises(ValueError):
        RandomDelay(delay_s=0.1, count=9).delays(1, 8, seed=0)


def test_linear_skew_1_to_p_ms_and_rotation():
    d = LinearSkew().delays(3, 32, seed=0)
    assert np.allclose(d[0], np.arange(1, 33) / 1000) and np.allclose(d[2], d[0])
    r = LinearSkew(first_s=0.05, step_s=0.05, rotate=True).delays(3, 8, seed=0)
    assert np.allclose(r[0], np.arange(1, 9) * 0.05)
    assert np.allclose(r[1], np.roll(r[0], -1)) and np.allclose(sorted(r[2]), sorted(r[0]))


def test_parse_and_injector():
    assert imbalance_model("c3") is STRAGGLER_PRESETS["C3"]
    assert imbalance_model("none") is None
    assert imbalance_model("0.2,3") == StragglerModel(probability=0.2, slowdown=3.0)
    assert imbalance_model("random:200ms,4") == RandomDelay(delay_s=0.2, count=4)
    assert imbalance_model("skew:50ms,50ms,rotate") == LinearSkew(first_s=0.05, step_s=0.05, rotate=True)
    assert imbalance_model("skew:1ms") == LinearSkew()
    with pytest.raises(ValueError, match="unknown imbalance model"):
        imbalance_model("C9")
    with pytest.raises(ValueError):
        StragglerModel(probability=1.5, slowdown=2)
    model = RandomDelay(delay_s=0.01)
    table = model.delays(30, 4, seed=5)
    injectors = [ImbalanceInjector(model=model, rank=r, world_size=4, seed=5) for r in range(4)]
    got = np.array([[inj.delay() for inj in injectors] for _ in range(30)])
    assert np.array_equal(got, table)
