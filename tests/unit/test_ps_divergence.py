"""MLfabric's divergence estimate (eq. (10)-(11)) bounds the true server-replica divergence.

    .venv/bin/python -m pytest tests/unit/test_ps_divergence.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.ps.divergence import DivergenceBound, divergence_coefficients, estimate_divergence, update_norm
from mlfabric.ps.rules import SGDMomentum, UpdateInfo


def _info(version: int) -> UpdateInfo:
    return UpdateInfo(model="m", server=0, version=version, workers=(0,), computed_from=(version,), weight=1.0)


def test_two_updates_reproduce_eq_7() -> None:
    alpha_0, alphas = divergence_coefficients(2, 0.9)
    assert alpha_0 == pytest.approx(0.9 + 0.81) and alphas == pytest.approx([1.9, 1.0])  # (g + g^2) h, (1 + g) u1, u2
    assert divergence_coefficients(3, 0.0) == (0.0, [1.0, 1.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), lag=st.integers(0, 12), momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
       lr=st.floats(1e-3, 1.0))
def test_the_estimate_bounds_the_true_divergence(seed: int, lag: int, momentum: float, lr: float) -> None:
    """A server that applied ``lag`` more updates than its replica (same rule, same order):
    ||w_s - w_r|| <= eq. (11) from the gradients' norms and the history's, and the closed form
    (alpha coefficients) is the true difference."""
    gen = torch.Generator().manual_seed(seed)
    server_rule = SGDMomentum(lr, momentum)
    w = torch.zeros(64, dtype=torch.float64)
    for v in range(3):  # some history first
        server_rule(w, torch.randn(64, generator=gen, dtype=torch.float64), _info(v))
    replica = w.clone()
    h0 = server_rule.history.clone() if server_rule.history is not None else torch.zeros(64, dtype=torch.float64)
    norms = []
    updates = []
    for v in range(lag):
        g = torch.randn(64, generator=gen, dtype=torch.float64) * (1 + v)
        server_rule(w, g, _info(3 + v))
        norms.append(update_norm(lr, 1.0, [float(g.norm())]))
        updates.append(-lr * g)
    true = float((w - replica).norm())
    estimate = estimate_divergence(float(h0.norm()), norms, momentum)
    assert true <= estimate * (1 + 1e-9) + 1e-12
    alpha_0, alphas = divergence_coefficients(lag, momentum)
    closed = alpha_0 * h0 + sum((a * u for a, u in zip(alphas, updates)), torch.zeros(64, dtype=torch.float64))
    torch.testing.assert_close(w - replica, closed)


def test_div_max_in_norm_units_or_updates() -> None:
    assert DivergenceBound.parse("0.5") == DivergenceBound(norm=0.5)
    assert DivergenceBound.parse("30u") == DivergenceBound(updates=30) == DivergenceBound.parse("30 updates")
    by_count = DivergenceBound(updates=2)
    assert by_count.allows(10.0, [5.0, 5.0], 0.9) and not by_count.allows(0.0, [0.1, 0.1, 0.1], 0.9)
    by_norm = DivergenceBound(norm=3.0)
    assert by_norm.allows(0.0, [1.0, 1.0], 0.0) and not by_norm.allows(0.0, [2.0, 2.0], 0.0)
    assert update_norm(0.1, 0.25, [2.0, 6.0]) == pytest.approx(0.2)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: DivergenceBound(norm=0.0), "positive norm"),
    (lambda: DivergenceBound(norm=-1.0), "positive norm"),
    (lambda: DivergenceBound(updates=0), "at least 1 update"),
    (lambda: DivergenceBound(), "either as a norm"),
    (lambda: DivergenceBound.parse("soon"), "expected a norm"),
    (lambda: divergence_coefficients(-1, 0.5), "lead must be >= 0"),
    (lambda: divergence_coefficients(1, 1.0), "momentum must be in"),
    (lambda: estimate_divergence(-1.0, [], 0.5), "norms are >= 0"),
])
def test_bad_input_is_named(make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        make()


def test_a_server_checkpoints_every_n_versions(tmp_path) -> None:  # noqa: ANN001
    """The checkpoint baseline: every 3 versions the shard (values, version, momentum history)
    is on disk, equal to the server's at that version."""
    import threading

    from mlfabric.ps import PSConfig, PSLayout, local_jobs
    from mlfabric.ps.checkpoint import checkpoint_path, read_checkpoint

    config = PSConfig(consistency="async", timeout_s=10, checkpoint_every=3, checkpoint_dir=str(tmp_path))
    jobs = local_jobs(PSLayout(servers=1, workers=1), config)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("stats", jobs[0].serve()), daemon=True)
    thread.start()
    try:
        w = jobs[1].worker
        w.init_model("m", torch.zeros(8), lr=0.5, momentum=0.5)
        seen = {}
        for step in range(7):
            w.push("m", torch.full((8,), float(step + 1)))
            seen[step + 1] = w.pull_flat("m").clone()
        w.leave()
    finally:
        thread.join(5)
        for j in jobs:
            j.comm.close()
    stats = out["stats"]
    assert stats.checkpoints == 2 and stats.checkpoint_bytes > 0 and stats.checkpoint_s > 0  # versions 3 and 6
    saved = read_checkpoint(checkpoint_path(tmp_path, "m", 0))
    assert saved["version"] == 6 and saved["lr"] == 0.5 and saved["momentum"] == 0.5
    torch.testing.assert_close(saved["values"], seen[6])
    assert saved["history"] is not None and not list(tmp_path.glob("*.partial"))
    with pytest.raises(ValueError, match="needs a checkpoint_dir"):
        PSConfig(checkpoint_every=5)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        read_checkpoint(checkpoint_path(tmp_path, "other", 0))
