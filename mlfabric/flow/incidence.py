"""Flow-to-link incidence: which links each flow crosses, and with what weight.

An :class:`Incidence` is a compressed-sparse-row matrix with one row per flow: row ``f``
lists the links flow ``f`` uses and, optionally, the fraction of the flow carried on each
(``weights``). Single-path routing (ECMP) has all weights 1 and stores ``weights=None``;
packet spraying splits a flow evenly over its shortest paths, so a link carries the
fraction of those paths through it. The capacity constraint of link ``l`` is
``sum_f w_fl * x_f <= c_l``.

It is the one format shared by routing (``mlfabric.topo``), the max-min solver
(``mlfabric.flow.maxmin``), the certificate checker and the incremental
:class:`~mlfabric.flow.network.FlowNetwork`, so none of them depends on the others.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_flow.py -q -k incidence
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Incidence"]


def _as_index_array(values: np.ndarray | Sequence[int], what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False, kw_only=True)
class Incidence:
    """Flow x link incidence in CSR form.

    ``indptr`` has ``n_flows + 1`` entries; flow ``f`` uses ``links[indptr[f]:indptr[f+1]]``
    with ``weights[indptr[f]:indptr[f+1]]`` (all 1 when ``weights`` is None). A flow may list
    a link more than once (the weights add up); a flow with no links is unconstrained by the
    network (its rate is its own cap, or infinite).
    """

    indptr: np.ndarray
    links: np.ndarray
    weights: np.ndarray | None
    n_links: int

    def __post_init__(self) -> None:
        indptr = np.asarray(self.indptr, dtype=np.int64)
        links = _as_index_array(self.links, "link ids")
        if indptr.ndim != 1 or indptr.size == 0 or indptr[0] != 0:
            raise ValueError("indptr must be a 1-D array starting at 0 (length n_flows + 1)")
        if np.any(np.diff(indptr) < 0):
            raise ValueError("indptr must be non-decreasing")
        if indptr[-1] != links.size:
            raise ValueError(f"indptr ends at {indptr[-1]} but there are {links.size} link entries")
        if self.n_links < 0:
            raise ValueError(f"n_links must be >= 0, got {self.n_links}")
        if links.size and (links.min() < 0 or links.max() >= self.n_links):
            bad = links[(links < 0) | (links >= self.n_links)][0]
            raise ValueError(f"link id {bad} out of range [0, {self.n_links})")
        weights = self.weights
        if weights is not None:
            weights = np.asarray(weights, dtype=np.float64)
            if weights.shape != links.shape:
                raise ValueError(f"weights has shape {weights.shape}, links has shape {links.shape}")
            if not np.all(np.isfinite(weights)) or np.any(weights < 0):
                raise ValueError("weights must be finite and non-negative")
        # Normalised copies are stored back; the dataclass is frozen for users, not for us.
        object.__setattr__(self, "indptr", indptr)
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "n_links", int(self.n_links))

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_paths(
        cls,
        paths: Iterable[Sequence[int]],
        n_links: int,
        weights: Iterable[Sequence[float]] | None = None,
    ) -> Incidence:
        """Build from one sequence of link ids per flow (and optionally matching weights)."""
        path_list = [list(path) for path in paths]
        lengths = np.fromiter((len(path) for path in path_list), dtype=np.int64, count=len(path_list))
        indptr = np.zeros(len(path_list) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        flat = [link for path in path_list for link in path]
        links = np.asarray(flat, dtype=np.int64) if flat else np.zeros(0, dtype=np.int64)
        weight_array = None
        if weights is not None:
            weight_list = [list(row) for row in weights]
            if [len(row) for row in weight_list] != lengths.tolist():
                raise ValueError("weights must have one entry per link of each path")
            flat_weights = [w for row in weight_list for w in row]
            weight_array = np.asarray(flat_weights, dtype=np.float64) if flat_weights else np.zeros(0)
        return cls(indptr=indptr, links=links, weights=weight_array, n_links=n_links)

    @classmethod
    def from_padded(cls, paths: np.ndarray, n_links: int, weights: np.ndarray | None = None) -> Incidence:
        """Build from an ``(n_flows, max_len)`` array of link ids padded with -1 (row-major order kept)."""
        paths = np.asarray(paths)
        if paths.ndim != 2:
            raise ValueError(f"padded paths must be 2-D, got shape {paths.shape}")
        valid = paths >= 0
        indptr = np.zeros(paths.shape[0] + 1, dtype=np.int64)
        np.cumsum(valid.sum(axis=1), out=indptr[1:])
        links = paths[valid].astype(np.int64, copy=False)
        weight_array = None if weights is None else np.asarray(weights, dtype=np.float64)[valid]
        return cls(indptr=indptr, links=links, weights=weight_array, n_links=n_links)

    @classmethod
    def trusted(cls, indptr: np.ndarray, links: np.ndarray, weights: np.ndarray | None, n_links: int) -> Incidence:
        """Wrap arrays that are already valid (int64 ``indptr``/``links`` in range, float64
        finite non-negative ``weights`` or None) without the O(entries) checks of the normal
        constructor: for internal callers that build them from validated storage on every
        event (``FlowNetwork.update``)."""
        incidence = object.__new__(cls)
        object.__setattr__(incidence, "indptr", indptr)
        object.__setattr__(incidence, "links", links)
        object.__setattr__(incidence, "weights", weights)
        object.__setattr__(incidence, "n_links", int(n_links))
        return incidence

    @classmethod
    def empty(cls, n_links: int) -> Incidence:
        return cls(indptr=np.zeros(1, dtype=np.int64), links=np.zeros(0, dtype=np.int64), weights=None, n_links=n_links)

    @classmethod
    def concat(cls, parts: Sequence[Incidence]) -> Incidence:
        """Stack the flows of several incidences (same link set) one after another."""
        if not parts:
            raise ValueError("concat needs at least one Incidence")
        n_links = parts[0].n_links
        if any(part.n_links != n_links for part in parts):
            raise ValueError("cannot concat incidences over different link sets")
        offsets = np.cumsum([0] + [part.nnz for part in parts])
        indptr = np.concatenate([parts[0].indptr[:1]] + [part.indptr[1:] + off for part, off in zip(parts, offsets)])
        links = np.concatenate([part.links for part in parts])
        weights = None
        if any(part.weights is not None for part in parts):
            weights = np.concatenate([part.weight_array() for part in parts])
        return cls(indptr=indptr, links=links, weights=weights, n_links=n_links)

    # ------------------------------------------------------------------ accessors

    @property
    def n_flows(self) -> int:
        return int(self.indptr.size - 1)

    @property
    def nnz(self) -> int:
        return int(self.links.size)

    def lengths(self) -> np.ndarray:
        """Number of link entries of each flow."""
        return np.diff(self.indptr)

    def weight_array(self) -> np.ndarray:
        """Weights as an array (ones when stored as None)."""
        return np.ones(self.nnz, dtype=np.float64) if self.weights is None else self.weights

    def entry_flows(self) -> np.ndarray:
        """Flow index of every link entry (the CSR row of each entry)."""
        return np.repeat(np.arange(self.n_flows, dtype=np.int64), self.lengths())

    def flow(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(link ids, weights) of one flow."""
        if not 0 <= index < self.n_flows:
            raise IndexError(f"flow {index} out of range [0, {self.n_flows})")
        start, stop = self.indptr[index], self.indptr[index + 1]
        weights = np.ones(stop - start) if self.weights is None else self.weights[start:stop]
        return self.links[start:stop], weights

    def subset(self, flows: np.ndarray | Sequence[int]) -> Incidence:
        """The incidence of the given flows, in the given order."""
        rows = _as_index_array(flows, "flow ids")
        if rows.size and (rows.min() < 0 or rows.max() >= self.n_flows):
            raise IndexError(f"flow ids out of range [0, {self.n_flows})")
        starts = self.indptr[rows]
        lengths = self.indptr[rows + 1] - starts
        indptr = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        # Entry positions of the chosen rows without a Python loop: each row's start,
        # repeated over its length, plus the offset inside the row.
        positions = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1], dtype=np.int64)
        weights = None if self.weights is None else self.weights[positions]
        return Incidence(indptr=indptr, links=self.links[positions], weights=weights, n_links=self.n_links)

    def link_load(self, rates: np.ndarray) -> np.ndarray:
        """``sum_f w_fl * rates[f]`` for every link (bit/s when rates are bit/s)."""
        rates = np.asarray(rates, dtype=np.float64)
        if rates.shape != (self.n_flows,):
            raise ValueError(f"rates has shape {rates.shape}, expected ({self.n_flows},)")
        contribution = rates[self.entry_flows()] * self.weight_array()
        return np.bincount(self.links, weights=contribution, minlength=self.n_links)

    def link_weight_sum(self) -> np.ndarray:
        """``sum_f w_fl`` for every link: how many (fractional) flows cross it."""
        if self.weights is None:
            return np.bincount(self.links, minlength=self.n_links).astype(np.float64)
        return np.bincount(self.links, weights=self.weights, minlength=self.n_links)

    def merge_duplicates(self) -> Incidence:
        """Combine repeated (flow, link) entries by adding their weights; rows come out sorted by link."""
        if self.nnz == 0:
            return self
        flows = self.entry_flows()
        keys = flows * np.int64(self.n_links) + self.links
        unique_keys, inverse = np.unique(keys, return_inverse=True)
        weights = np.bincount(inverse, weights=self.weight_array(), minlength=unique_keys.size)
        new_flows = unique_keys // self.n_links
        indptr = np.zeros(self.n_flows + 1, dtype=np.int64)
        np.cumsum(np.bincount(new_flows, minlength=self.n_flows), out=indptr[1:])
        return Incidence(indptr=indptr, links=unique_keys % self.n_links, weights=weights, n_links=self.n_links)

    def to_lists(self) -> list[list[tuple[int, float]]]:
        """Plain Python ``[[(link, weight), ...], ...]`` (for the naive solver and debugging)."""
        weights = self.weight_array().tolist()
        links = self.links.tolist()
        bounds = self.indptr.tolist()
        return [list(zip(links[a:b], weights[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]
