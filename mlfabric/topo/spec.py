"""Topology spec strings, shared by the simulator, the emulator and the CLI.

One string names a topology everywhere (``--topology fat-tree:k=16,oversub=4``):

=====================================  ======================================================
``star:n=16``                          n hosts on one switch
``fat-tree:k=16,oversub=4``            three-tier k-ary fat-tree (k^3/4 hosts), ToR uplinks
                                       oversubscribed ``oversub``:1 (default 1)
``racks:r=4,h=8,oversub=4``            r ToRs with h hosts each under one core switch
                                       (default oversub 1)
``bcube:n=4,k=2``                      BCube(n,k) as in BML: n^k hosts with k NICs each,
                                       k levels of n^(k-1) n-port switches
``edges:FILE``                         any graph from a networkx-style edge list file
=====================================  ======================================================

``TopologySpec.parse(text)`` validates the string; ``str(spec)`` gives it back in canonical
form (parameters in a fixed order, defaults left out), so ``parse(str(spec)) == spec``.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q -k spec
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["TopologySpec", "TOPOLOGY_KINDS"]

ParamValue = int | float | str


@dataclass(frozen=True, kw_only=True)
class _ParamSpec:
    name: str
    kind: type  # int, float or str
    default: ParamValue | None = None  # None = required
    minimum: float | None = None
    #: True when the value must be strictly greater than ``minimum``.
    exclusive: bool = False
    help: str = ""


@dataclass(frozen=True, kw_only=True)
class _KindSpec:
    kind: str
    params: tuple[_ParamSpec, ...]
    example: str
    #: ``edges:FILE`` takes its only parameter positionally (a path may contain ',' and '=').
    positional: bool = False


TOPOLOGY_KINDS: Mapping[str, _KindSpec] = MappingProxyType(
    {
        "star": _KindSpec(
            kind="star",
            params=(_ParamSpec(name="n", kind=int, minimum=1, help="hosts"),),
            example="star:n=16",
        ),
        "fat-tree": _KindSpec(
            kind="fat-tree",
            params=(
                _ParamSpec(name="k", kind=int, minimum=2, help="switch ports (even)"),
                _ParamSpec(name="oversub", kind=float, default=1, minimum=0, exclusive=True, help="ToR oversubscription"),
            ),
            example="fat-tree:k=16,oversub=4",
        ),
        "racks": _KindSpec(
            kind="racks",
            params=(
                _ParamSpec(name="r", kind=int, minimum=1, help="racks"),
                _ParamSpec(name="h", kind=int, minimum=1, help="hosts per rack"),
                _ParamSpec(name="oversub", kind=float, default=1, minimum=0, exclusive=True, help="ToR oversubscription"),
            ),
            example="racks:r=4,h=8,oversub=4",
        ),
        "bcube": _KindSpec(
            kind="bcube",
            params=(
                _ParamSpec(name="n", kind=int, minimum=2, help="switch ports"),
                _ParamSpec(name="k", kind=int, minimum=1, help="levels = NICs per host"),
            ),
            example="bcube:n=4,k=2",
        ),
        "edges": _KindSpec(
            kind="edges",
            params=(_ParamSpec(name="path", kind=str, help="edge list file"),),
            example="edges:cluster.edgelist",
            positional=True,
        ),
    }
)


def _format_value(value: ParamValue) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _convert(kind: _KindSpec, param: _ParamSpec, raw: ParamValue, text: str) -> ParamValue:
    where = f"topology spec {text!r}"
    if param.kind is str:
        if not isinstance(raw, str) or not raw:
            raise ValueError(f"{where}: {param.name} must be a non-empty string")
        return raw
    try:
        if param.kind is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            value: ParamValue = int(raw) if not isinstance(raw, str) else int(raw, 10)
        else:
            value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: {param.name}={raw!r} is not {'an integer' if param.kind is int else 'a number'} "
            f"(example: {kind.example})"
        ) from None
    if param.minimum is not None:
        too_small = value <= param.minimum if param.exclusive else value < param.minimum
        if too_small or value != value or value == float("inf"):
            bound = f"> {param.minimum:g}" if param.exclusive else f">= {param.minimum:g}"
            bound += " and finite"
            raise ValueError(f"{where}: {param.name}={raw!r} must be {bound}")
    return value


@dataclass(frozen=True, kw_only=True)
class TopologySpec:
    """A validated topology spec: ``kind`` plus all parameters (defaults filled in)."""

    kind: str
    params: Mapping[str, ParamValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in TOPOLOGY_KINDS:
            raise ValueError(f"unknown topology kind {self.kind!r}; known kinds: {', '.join(TOPOLOGY_KINDS)}")
        kind = TOPOLOGY_KINDS[self.kind]
        known = {param.name for param in kind.params}
        unknown = set(self.params) - known
        text = self._raw_text()
        if unknown:
            raise ValueError(
                f"topology spec {text!r}: unknown parameter(s) {', '.join(sorted(unknown))} for {self.kind} "
                f"(takes {', '.join(sorted(known))}; example: {kind.example})"
            )
        values: dict[str, ParamValue] = {}
        for param in kind.params:
            if param.name in self.params:
                values[param.name] = _convert(kind, param, self.params[param.name], text)
            elif param.default is not None:
                values[param.name] = param.kind(param.default)
            else:
                raise ValueError(
                    f"topology spec {text!r}: missing parameter {param.name} ({param.help}); example: {kind.example}"
                )
        if self.kind == "fat-tree" and int(values["k"]) % 2:
            raise ValueError(f"topology spec {text!r}: fat-tree k must be even, got k={values['k']}")
        object.__setattr__(self, "params", MappingProxyType(values))

    def _raw_text(self) -> str:
        return f"{self.kind}:" + ",".join(f"{key}={value}" for key, value in dict(self.params).items())

    @classmethod
    def parse(cls, text: str) -> TopologySpec:
        """Parse ``'fat-tree:k=16,oversub=4'`` and friends; raises ValueError naming the bad part."""
        if not isinstance(text, str):
            raise ValueError(f"topology spec must be a string, got {type(text).__name__}")
        kind_name, sep, rest = text.strip().partition(":")
        kind_name = kind_name.strip().lower()
        if kind_name not in TOPOLOGY_KINDS:
            examples = ", ".join(spec.example for spec in TOPOLOGY_KINDS.values())
            raise ValueError(f"unknown topology kind in {text!r}; expected one of: {examples}")
        kind = TOPOLOGY_KINDS[kind_name]
        if kind.positional:
            if not sep or not rest:
                raise ValueError(f"topology spec {text!r} needs a value after ':' (example: {kind.example})")
            return cls(kind=kind_name, params={kind.params[0].name: rest})
        params: dict[str, ParamValue] = {}
        if rest.strip():
            for item in rest.split(","):
                key, eq, value = item.partition("=")
                key = key.strip()
                if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or not value.strip():
                    raise ValueError(f"topology spec {text!r}: cannot parse {item!r}; expected key=value (example: {kind.example})")
                if key in params:
                    raise ValueError(f"topology spec {text!r}: parameter {key} given twice")
                params[key] = value.strip()
        return cls(kind=kind_name, params=params)

    def __str__(self) -> str:
        kind = TOPOLOGY_KINDS[self.kind]
        if kind.positional:
            return f"{self.kind}:{self.params[kind.params[0].name]}"
        parts = []
        for param in kind.params:
            value = self.params[param.name]
            if param.default is not None and value == param.kind(param.default):
                continue
            parts.append(f"{param.name}={_format_value(value)}")
        return f"{self.kind}:" + ",".join(parts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopologySpec):
            return NotImplemented
        return self.kind == other.kind and dict(self.params) == dict(other.params)

    def __hash__(self) -> int:
        return hash(str(self))

    def __reduce__(self) -> tuple[object, tuple[str]]:
        # The read-only params mapping does not pickle; the canonical string does.
        return (TopologySpec.parse, (str(self),))

    def int_param(self, name: str) -> int:
        return int(self.params[name])

    def float_param(self, name: str) -> float:
        return float(self.params[name])
