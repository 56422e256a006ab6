"""Certificate checker: proves (or refutes) that given rates are the max-min fair allocation.

An allocation ``x`` is max-min fair exactly when it is feasible and every flow has a
*bottleneck*: a saturated link it crosses on which no other flow gets a larger rate (or the
flow sits at its own cap). This module checks both conditions, vectorized, with a relative
tolerance ``rtol`` (default 1e-9):

* feasibility: ``load_l <= c_l * (1 + rtol)`` on every link, ``x_f <= cap_f * (1 + rtol)``, no
  negative or NaN rates;
* bottleneck: for every flow ``f`` there is a link ``l`` with ``w_fl > 0``,
  ``load_l >= c_l * (1 - rtol)`` and ``x_f >= max_{g on l} x_g * (1 - rtol)``, or
  ``x_f >= cap_f * (1 - rtol)``. A flow that nothing finite constrains must have rate ``inf``.

It does not call the solver, so it checks the solver (and anything else, e.g. a scheduler's
allocation) independently.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_flow.py -q -k certificate
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mlfabric.flow.incidence import Incidence
from mlfabric.flow.maxmin import validate_capacity, validate_caps

__all__ = ["CertificateError", "CertificateReport", "check_certificate"]

DEFAULT_CERTIFICATE_RTOL = 1e-9


class CertificateError(AssertionError):
    """The rates are not a max-min fair allocation; the message says which flows/links fail."""


@dataclass(frozen=True, kw_only=True)
class CertificateReport:
    """Outcome of :func:`check_certificate`; truthy when the certificate holds."""

    ok: bool
    n_flows: int
    n_links: int
    rtol: float
    #: Largest ``(load - capacity) / capacity`` over overloaded links (0 when none; inf for load on a zero-capacity link).
    max_relative_overload: float
    overloaded_links: np.ndarray = field(repr=False)
    #: Flows with a negative or NaN rate, or above their cap.
    invalid_rate_flows: np.ndarray = field(repr=False)
    #: Flows with no saturated link on which they have the largest rate (and not at their cap).
    flows_without_bottleneck: np.ndarray = field(repr=False)
    #: For each flow with a bottleneck, one such link (-1 for none, or when the cap binds).
    bottleneck_link: np.ndarray = field(repr=False)

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        if self.ok:
            return f"max-min certificate holds for {self.n_flows} flows on {self.n_links} links (rtol={self.rtol:g})"
        parts = []
        if self.overloaded_links.size:
            parts.append(
                f"{self.overloaded_links.size} overloaded link(s), e.g. link {int(self.overloaded_links[0])} "
                f"(max relative overload {self.max_relative_overload:.3g})"
            )
        if self.invalid_rate_flows.size:
            parts.append(
                f"{self.invalid_rate_flows.size} flow(s) with a negative/NaN rate or above their cap, "
                f"e.g. flow {int(self.invalid_rate_flows[0])}"
            )
        if self.flows_without_bottleneck.size:
            parts.append(
                f"{self.flows_without_bottleneck.size} flow(s) without a saturated bottleneck link on which "
                f"they have the largest rate, e.g. flow {int(self.flows_without_bottleneck[0])}"
            )
        return f"max-min certificate fails (rtol={self.rtol:g}): " + "; ".join(parts)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise CertificateError(self.summary())


def check_certificate(
    incidence: Incidence,
    capacity: np.ndarray | list[float],
    rates: np.ndarray | list[float],
    caps: np.ndarray | list[float] | None = None,
    *,
    rtol: float = DEFAULT_CERTIFICATE_RTOL,
) -> CertificateReport:
    """Check that ``rates`` is the max-min fair allocation; returns a report (call ``raise_if_failed()``)."""
    n_links = incidence.n_links
    n_flows = incidence.n_flows
    capacity = validate_capacity(capacity, n_links)
    cap_array = validate_caps(caps, n_flows)
    if cap_array is None:
        cap_array = np.full(n_flows, np.inf)
    rates = np.asarray(rates, dtype=np.float64)
    if rates.shape != (n_flows,):
        raise ValueError(f"rates has shape {rates.shape}, expected ({n_flows},)")

    weights = incidence.weight_array()
    loads_link = weights > 0
    entry_flow = incidence.entry_flows()
    entry_link = incidence.links

    with np.errstate(invalid="ignore"):
        invalid = np.isnan(rates) | (rates < 0) | (rates > cap_array * (1.0 + rtol))
    safe_rates = np.where(np.isnan(rates), np.inf, rates)

    # Feasibility. inf * 0 would be NaN; a zero weight contributes nothing.
    with np.errstate(invalid="ignore"):
        contribution = np.where(loads_link, safe_rates[entry_flow] * weights, 0.0)
    load = np.bincount(entry_link, weights=contribution, minlength=n_links)
    finite_capacity = np.isfinite(capacity)
    with np.errstate(invalid="ignore"):
        overloaded = finite_capacity & (load > capacity * (1.0 + rtol))
    # Relative overload for the report: load on a zero-capacity link counts as infinite.
    over = np.flatnonzero(overloaded)
    if over.size:
        positive = capacity[over] > 0
        relative = np.full(over.size, np.inf)
        relative[positive] = load[over][positive] / capacity[over][positive] - 1.0
        max_overload = float(relative.max())
    else:
        max_overload = 0.0

    # Bottleneck: saturated link on which the flow's rate is the largest.
    link_max_rate = np.zeros(n_links)
    np.maximum.at(link_max_rate, entry_link[loads_link], safe_rates[entry_flow[loads_link]])
    with np.errstate(invalid="ignore"):
        saturated = (load >= capacity * (1.0 - rtol)) & np.isfinite(capacity)
        entry_is_bottleneck = (
            loads_link
            & saturated[entry_link]
            & (safe_rates[entry_flow] >= link_max_rate[entry_link] * (1.0 - rtol))
            & np.isfinite(safe_rates[entry_flow])
        )
    has_bottleneck = np.bincount(entry_flow[entry_is_bottleneck], minlength=n_flows) > 0
    at_cap = np.isfinite(cap_array) & (safe_rates >= cap_array * (1.0 - rtol))
    # A flow that no finite capacity or cap constrains is max-min only at rate inf.
    finite_constraint = np.bincount(
        entry_flow[loads_link & np.isfinite(capacity[entry_link])], minlength=n_flows
    ) > 0
    unconstrained_ok = ~finite_constraint & np.isinf(cap_array) & np.isinf(safe_rates) & ~np.isnan(rates)
    certified = has_bottleneck | at_cap | unconstrained_ok

    bottleneck_link = np.full(n_flows, -1, dtype=np.int64)
    # Any bottleneck entry per flow will do; later entries overwrite earlier ones.
    bottleneck_link[entry_flow[entry_is_bottleneck]] = entry_link[entry_is_bottleneck]

    overloaded_links = np.flatnonzero(overloaded)
    invalid_flows = np.flatnonzero(invalid)
    no_bottleneck = np.flatnonzero(~certified)
    ok = overloaded_links.size == 0 and invalid_flows.size == 0 and no_bottleneck.size == 0
    return CertificateReport(
        ok=ok,
        n_flows=n_flows,
        n_links=n_links,
        rtol=rtol,
        max_relative_overload=max_overload,
        overloaded_links=overloaded_links,
        invalid_rate_flows=invalid_flows,
        flows_without_bottleneck=no_bottleneck,
        bottleneck_link=bottleneck_link,
    )
