"""TicTac's ordering heuristics: op properties (Alg. 1), TAO (Alg. 2, eq. 5) and TIO (Alg. 3).

    .venv/bin/python -m pytest tests/unit/test_order.py -q -k "tao or tio or properties"

Input: a :class:`~mlfabric.order.dag.Dag` and (for TAO) a time oracle. Output:
:class:`Priorities`, one integer per recv, lower = earlier, normalised as §5 enforces them:
a recv's priority is the number of recvs that must be handed to the transport before it,
so TAO gives ``0..n-1`` and TIO gives tied recvs the same number (the number of recvs
in strictly earlier classes), e.g. ``0, 0, 2, 3``.

Where the paper is ambiguous or inconsistent (decisions, see docs/tictac.md):

* **Comparator direction.** Alg. 2 as printed returns ``min(P_A, M_B) < min(P_B, M_A)``,
  which contradicts its own derivation (eq. 5: A before B iff ``min(P_B, M_A) <
  min(P_A, M_B)``) and Fig. 2 (it would put the recv that unblocks nothing first). Eq. 5 is
  implemented; ties go to ``M+`` (smaller first), then to DAG order (determinism).
* **Minimum under the comparator.** Eq. 5 is Johnson's two-machine rule (channel = machine
  1, compute = machine 2). Its strict part is not transitive once ``M+`` breaks the many
  ties (the paper's "easy to prove" transitivity does not hold; the tests show a
  counterexample), so "the minimum" of Alg. 2 line 16 is taken as: the recvs that no other
  outstanding recv strictly precedes by eq. 5 alone (Johnson-minimal, a non-empty set since
  eq. 5's strict part is acyclic), then the smallest ``M+`` among them, then DAG order.
* **M+ of a recv that only single-dependency ops follow.** Alg. 1 updates ``M+`` only from
  ops with ``|D| > 1``; a recv none of whose users waits on a second outstanding recv keeps
  ``M+ = +inf`` and sorts last in TIO. ``mplus="paper"`` (default) keeps that;
  ``mplus="single"`` also lets ``|D| = 1`` ops set ``M+ = M(op) = Time(r)``, which gives a
  chain of one-parameter layers (Seq-32) a strict TIO order instead of tying its first two
  recvs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Sequence

from mlfabric.order.dag import Dag, Kind
from mlfabric.order.oracle import TimeOracle

__all__ = ["MPlusRule", "Priorities", "Properties", "before", "johnson_before", "priorities_from_order",
           "tao", "tio", "update_properties"]

MPlusRule = Literal["paper", "single"]
INF = math.inf


@dataclass(frozen=True)
class Properties:
    """Alg. 1's properties for one outstanding set R: ``M`` for every node, ``P`` and ``M+`` per recv in R."""

    M: Mapping[str, float]
    P: Mapping[str, float]
    M_plus: Mapping[str, float]


def update_properties(dag: Dag, time: TimeOracle | Mapping[str, float], outstanding: Iterable[str], *,
                      mplus: MPlusRule = "paper") -> Properties:
    """Alg. 1 (UpdateProperties) for outstanding recvs ``outstanding``; recvs not in it are complete."""
    t = time.times if isinstance(time, TimeOracle) else time
    R = frozenset(outstanding)
    bad = [r for r in R if dag.node(r).kind is not Kind.RECV]
    if bad:
        raise ValueError(f"update_properties: {bad[:3]} are not recv nodes")
    deps = dag.comm_deps()
    M: dict[str, float] = {}
    P: dict[str, float] = {r: 0.0 for r in R}
    Mp: dict[str, float] = {r: INF for r in R}
    Dsets: dict[str, frozenset[str]] = {}
    for n in dag.names:  # line 2-4: M for every op
        D = deps[n] & R
        Dsets[n] = D
        # sorted(): float sums in a fixed order, so equal sets give bit-equal M (ties stay ties).
        M[n] = sum(t[r] for r in sorted(D))
    min_d = 1 if mplus == "single" else 2
    for n in dag.names:  # line 9-17: every op of G - R
        if n in R:
            continue
        D = Dsets[n]
        if len(D) == 1:  # only this recv stands between the op and running: its compute is r's benefit
            (r,) = D
            P[r] += t[n]
        if len(D) >= min_d:
            for r in D:
                if M[n] < Mp[r]:
                    Mp[r] = M[n]
    return Properties(M=M, P=P, M_plus=Mp)


def johnson_before(a: str, b: str, props: Properties) -> bool | None:
    """Eq. 5 alone: True if a strictly precedes b, False if b strictly precedes a, None on a tie."""
    x = min(props.P[b], props.M[a])
    y = min(props.P[a], props.M[b])
    if x < y:
        return True
    if y < x:
        return False
    return None


def before(a: str, b: str, props: Properties) -> bool:
    """Alg. 2's Comparator with eq. 5's direction: True iff recv a goes before recv b."""
    j = johnson_before(a, b, props)
    if j is not None:
        return j
    return props.M_plus[a] < props.M_plus[b]


@dataclass(frozen=True)
class Priorities:
    """Priority per recv (lower = earlier; equal = may go in any order), plus how it was made."""

    priority: Mapping[str, int]
    method: str
    dag_order: tuple[str, ...]  # the recvs in DAG order: the deterministic tie-break

    def order(self) -> tuple[str, ...]:
        """One total order consistent with the priorities (ties in DAG order)."""
        idx = {r: i for i, r in enumerate(self.dag_order)}
        return tuple(sorted(self.priority, key=lambda r: (self.priority[r], idx[r])))

    def by_parameter(self, dag: Dag) -> dict[str, int]:
        """The priorities keyed by the parameter each recv pulls (what
        ``PSWorker.init_model(priorities=...)`` takes)."""
        out = {}
        for r, p in self.priority.items():
            param = dag.node(r).param
            if param is None:
                raise ValueError(f"recv {r!r} names no parameter (a hand-made DAG?): nothing to key it by")
            out[param] = p
        return out

    def classes(self) -> list[tuple[str, ...]]:
        """The recvs grouped by priority, earliest class first (each class in DAG order)."""
        out: dict[int, list[str]] = {}
        for r in self.order():
            out.setdefault(self.priority[r], []).append(r)
        return [tuple(v) for _, v in sorted(out.items())]


def _normalise(keys: Mapping[str, object], recvs: Sequence[str], method: str) -> Priorities:
    """Priority = number of recvs with a strictly smaller key (the §5 enforcement counter)."""
    ranked = sorted(recvs, key=lambda r: keys[r])  # type: ignore[arg-type,return-value]
    prio: dict[str, int] = {}
    for i, r in enumerate(ranked):
        prio[r] = prio[ranked[i - 1]] if i and keys[r] == keys[ranked[i - 1]] else i
    return Priorities(priority=prio, method=method, dag_order=tuple(recvs))


def priorities_from_order(dag: Dag, order: Sequence[str], method: str = "given") -> Priorities:
    """A total order of the recvs as priorities 0..n-1."""
    if sorted(order) != sorted(dag.recvs):
        raise ValueError("priorities_from_order: the order must list every recv exactly once")
    return Priorities(priority={r: i for i, r in enumerate(order)}, method=method, dag_order=dag.recvs)


def _pick(R: list[str], props: Properties) -> str:
    """Alg. 2 line 16: the minimum of R w.r.t. the comparator (see the module docstring)."""
    # Johnson-minimal candidates: no other outstanding recv strictly precedes them by eq. 5.
    cands = [a for a in R if not any(johnson_before(b, a, props) for b in R if b != a)]
    best = cands[0]
    for c in cands[1:]:  # R is in DAG order, so the first of equals stays
        if props.M_plus[c] < props.M_plus[best]:
            best = c
    return best


def tao(dag: Dag, time: TimeOracle, *, mplus: MPlusRule = "paper") -> Priorities:
    """Alg. 2: repeatedly pick the comparator-minimum outstanding recv; priorities 0..n-1."""
    time.covers(dag)
    R = list(dag.recvs)
    prio: dict[str, int] = {}
    count = 0
    while R:
        props = update_properties(dag, time, R, mplus=mplus)
        op = _pick(R, props)
        R.remove(op)
        prio[op] = count
        count += 1
    return Priorities(priority=prio, method=f"tao/{mplus}", dag_order=dag.recvs)


def tio(dag: Dag, *, mplus: MPlusRule = "paper") -> Priorities:
    """Alg. 3: M+ under the general oracle (eq. 6) with every recv outstanding; equal M+ share a priority."""
    props = update_properties(dag, TimeOracle.general(dag), dag.recvs, mplus=mplus)
    return _normalise(props.M_plus, dag.recvs, f"tio/{mplus}")
