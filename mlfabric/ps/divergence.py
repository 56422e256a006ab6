"""How far a replica's model can be from its server's: MLfabric's divergence estimate, eq. (10)-(11).

    .venv/bin/python -m pytest tests/unit/test_ps_divergence.py -q

Both apply the same updates in the same order (§3.3, bounded consistency); the replica is
``L`` updates behind. With eq. (2) (SGD with momentum ``gamma``, history ``h``), the server's
``L`` steps past the replica's model ``w_0`` (history ``h_0``) are ``s_j = gamma s_{j-1} + u_j``
with ``s_0 = h_0``, so

    w_s - w_r = sum_j s_j = alpha_0 h_0 + sum_i alpha_i u_i,
    alpha_0 = gamma (1 - gamma^L) / (1 - gamma),   alpha_i = (1 - gamma^(L-i+1)) / (1 - gamma)

(at ``gamma = 0``: ``alpha_0 = 0`` and every ``alpha_i = 1``). Eq. (7) is the case ``L = 2``. The
paper's eq. (11) bounds its norm from the norms alone -- Cauchy-Schwarz on the expanded square,
``a_1..a_6`` being products of the alphas -- which is exactly the triangle inequality:

    ||w_s - w_r|| <= alpha_0 ||h_0|| + sum_i alpha_i ||u_i||   (= sqrt of eq. (11)'s sum)

so the scheduler needs only the update norms workers send with their requests (``norm``,
§4) and the norm of the history where the replica stands. An aggregated update's norm is
bounded by the sum of its members' (:func:`update_norm`). Div_max is either in norm units or,
as §7.3 states it, a number of updates (the replica at most ``K`` updates behind).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["DivergenceBound", "divergence_coefficients", "estimate_divergence", "update_norm"]


def divergence_coefficients(lead: int, momentum: float) -> tuple[float, list[float]]:
    """``(alpha_0, [alpha_1..alpha_L])`` for a server ``lead`` updates ahead (module docstring)."""
    if lead < 0:
        raise ValueError(f"the server's lead must be >= 0 updates, got {lead}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    g = momentum
    if g == 0:
        return 0.0, [1.0] * lead
    alpha_0 = g * (1 - g ** lead) / (1 - g)
    return alpha_0, [(1 - g ** (lead - i + 1)) / (1 - g) for i in range(1, lead + 1)]


def estimate_divergence(history_norm: float, update_norms: Sequence[float], momentum: float) -> float:
    """Eq. (11): an upper bound of ``||w_s - w_r||`` when the server has applied updates of
    norms ``update_norms`` (in order; each ``||u_i|| = lr * weight * ||gradient||``) past the
    replica, whose update history there had norm ``history_norm``."""
    if history_norm < 0 or any(n < 0 for n in update_norms):
        raise ValueError("norms are >= 0")
    alpha_0, alphas = divergence_coefficients(len(update_norms), momentum)
    return alpha_0 * history_norm + math.fsum(a * n for a, n in zip(alphas, update_norms))


def update_norm(lr: float, weight: float, gradient_norms: Sequence[float]) -> float:
    """A bound of ``||u||`` for an update summing gradients of these norms (eq. (1): ``u = -lr
    weight sum g``; the triangle inequality for an aggregate)."""
    return abs(lr * weight) * math.fsum(gradient_norms)


@dataclass(frozen=True, kw_only=True)
class DivergenceBound:
    """Div_max: in the model's norm units (``norm``), or as a number of updates the replica may
    lag (``updates``, §7.3's "divergence measured in number of updates"). Exactly one."""

    norm: float | None = None
    updates: int | None = None

    def __post_init__(self) -> None:
        if (self.norm is None) == (self.updates is None):
            raise ValueError("give Div_max either as a norm or as a number of updates, not both or neither")
        if self.norm is not None and not (math.isfinite(self.norm) and self.norm > 0):
            raise ValueError(f"Div_max must be a positive norm, got {self.norm}")
        if self.updates is not None and self.updates < 1:
            raise ValueError(f"Div_max must be at least 1 update, got {self.updates}")

    @classmethod
    def parse(cls, text: str) -> "DivergenceBound":
        """``"0.5"`` (a norm) or ``"30u"`` / ``"30 updates"`` (a number of updates)."""
        key = text.strip().lower()
        shape = f"Div_max {text!r}: expected a norm (0.5) or a number of updates (30u)"
        for suffix in ("updates", "update", "u"):
            if key.endswith(suffix):
                try:
                    updates = int(key.removesuffix(suffix).strip())
                except ValueError:
                    raise ValueError(shape) from None
                return cls(updates=updates)  # its own error for 0u, -2u
        try:
            norm = float(key)
        except ValueError:
            raise ValueError(shape) from None
        return cls(norm=norm)  # its own error for 0, -1, nan, inf

    def allows(self, history_norm: float, update_norms: Sequence[float], momentum: float) -> bool:
        """Whether a replica this far behind is within the bound."""
        if self.updates is not None:
            return len(update_norms) <= self.updates
        return estimate_divergence(history_norm, update_norms, momentum) <= self.norm  # type: ignore[operator]
