"""BCube(n,k) as defined in the BML paper (``bcube:n=4,k=2``), with digit-correction routing.

BML (papers/bml.txt §3.1) numbers things this way, and so do we:

* ``N = n^k`` hosts, each with ``k`` NICs; host ``h`` has digits ``[v_{k-1}, ..., v_1, v_0]``
  with ``h = sum_i v_i * n^i``;
* ``k`` levels (0 .. k-1) of ``n^(k-1)`` switches with ``n`` ports each; the level-``l``
  switch that host ``h`` plugs into connects exactly the ``n`` hosts that differ from ``h``
  only in digit ``l``. Its index within the level is ``h`` with digit ``l`` removed,
  ``(h // n^(l+1)) * n^l + h % n^l``; its node id is ``N + l * n^(k-1) + index``;
* host ``h`` NIC ``l`` is its level-``l`` port: link ``h*k + l`` (host -> switch, egress) and
  ``N*k + h*k + l`` (switch -> host, ingress).

Switches are not connected to each other; hosts relay. A shortest path between hosts that
differ in ``q`` digits corrects one digit per hop pair (host -> level-l switch -> host), so it
has ``2q`` links and there are ``q!`` of them (one per order of correcting the digits). Hosts
differing in one digit ``l`` have exactly one shortest path: ``[h*k + l, N*k + h'*k + l]``,
through the NIC of level ``l``, which is the only kind of transfer BML's Algorithm 1 makes.
Path ``i`` of a pair corrects the digits in the ``i``-th permutation (lexicographic) of its
differing digit positions taken in increasing order, which is also the lexicographic order by
link ids.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_topo.py -q -k bcube
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from mlfabric.flow.incidence import Incidence
from mlfabric.topo.routing import Router
from mlfabric.topo.spec import TopologySpec
from mlfabric.topo.topology import Topology

__all__ = ["bcube", "BCubeRouter", "bcube_digits", "bcube_switch_node"]

LAYERS = ("host-switch", "switch-host")


def bcube_digits(host: int | np.ndarray, n: int, k: int) -> np.ndarray:
    """Digits ``[v_0, v_1, ..., v_{k-1}]`` (least significant first) of host ids; shape (..., k)."""
    host = np.asarray(host, dtype=np.int64)
    return (host[..., None] // (n ** np.arange(k, dtype=np.int64))) % n


def bcube_switch_node(host: int | np.ndarray, level: int, n: int, k: int) -> np.ndarray:
    """Node id of the level-``level`` switch that ``host`` connects to."""
    host = np.asarray(host, dtype=np.int64)
    index = (host // n ** (level + 1)) * n**level + host % n**level
    return n**k + level * n ** (k - 1) + index


class BCubeRouter(Router):
    """Digit-correction shortest paths of BCube(n,k), vectorized per (differing digits, order)."""

    def __init__(self, n: int, k: int) -> None:
        self.n = n
        self.k = k
        self.n_hosts = n**k
        self.n_links = 2 * self.n_hosts * k
        self._powers = n ** np.arange(k, dtype=np.int64)

    def egress(self, host: np.ndarray, level: int | np.ndarray) -> np.ndarray:
        return np.asarray(host) * self.k + level

    def ingress(self, host: np.ndarray, level: int | np.ndarray) -> np.ndarray:
        return self.n_hosts * self.k + np.asarray(host) * self.k + level

    def _differing_mask(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        differs = bcube_digits(src, self.n, self.k) != bcube_digits(dst, self.n, self.k)
        return (differs * (1 << np.arange(self.k))).sum(axis=-1)

    def path_counts(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        mask = self._differing_mask(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))
        q = np.array([bin(m).count("1") for m in range(1 << self.k)])[mask]
        return np.array([math.factorial(i) for i in range(self.k + 1)], dtype=np.int64)[q]

    def select(self, src: np.ndarray, dst: np.ndarray, index: np.ndarray) -> Incidence:
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        index = np.asarray(index, dtype=np.int64)
        mask = self._differing_mask(src, dst)
        paths = np.full((src.size, 2 * self.k), -1, dtype=np.int64)
        dst_digits = bcube_digits(dst, self.n, self.k)
        for m in np.unique(mask).tolist():
            levels = [level for level in range(self.k) if m >> level & 1]
            orders = list(itertools.permutations(levels))
            rows_m = np.flatnonzero(mask == m)
            chosen = index[rows_m]
            if ((chosen < 0) | (chosen >= len(orders))).any():
                raise ValueError(f"path index out of range: these BCube flows have {len(orders)} shortest paths")
            for order_index, order in enumerate(orders):
                rows = rows_m[chosen == order_index]
                if rows.size == 0:
                    continue
                current = src[rows].copy()
                for hop, level in enumerate(order):
                    # Set digit `level` of the current host to the destination's digit.
                    nxt = current + (dst_digits[rows, level] - (current // self._powers[level]) % self.n) * self._powers[level]
                    paths[rows, 2 * hop] = self.egress(current, level)
                    paths[rows, 2 * hop + 1] = self.ingress(nxt, level)
                    current = nxt
        return Incidence.from_padded(paths, self.n_links)


def bcube(n: int, k: int, link_rate_bps: float) -> Topology:
    """Build BCube(n,k): n^k hosts with k NICs, k levels of n^(k-1) n-port switches, all links at ``link_rate_bps``."""
    if n < 2 or k < 1:
        raise ValueError(f"bcube needs n >= 2 and k >= 1, got n={n}, k={k}")
    router = BCubeRouter(n, k)
    n_hosts = router.n_hosts
    per_level = n ** (k - 1)
    hosts = np.repeat(np.arange(n_hosts), k)  # egress link h*k + l
    switch = np.concatenate([bcube_switch_node(np.arange(n_hosts), level, n, k)[:, None] for level in range(k)], axis=1).ravel()
    link_src = np.concatenate([hosts, switch])
    link_dst = np.concatenate([switch, hosts])
    rate = float(link_rate_bps)
    names = [f"h{i}" for i in range(n_hosts)] + [f"sw{level}_{i}" for level in range(k) for i in range(per_level)]
    egress = np.arange(n_hosts * k)
    nic_links = np.stack([egress, n_hosts * k + egress], axis=1).reshape(n_hosts, k, 2)
    return Topology(
        spec=TopologySpec(kind="bcube", params={"n": n, "k": k}),
        link_rate_bps=rate,
        n_hosts=n_hosts,
        node_names=tuple(names),
        link_src=link_src,
        link_dst=link_dst,
        link_capacity=np.full(2 * n_hosts * k, rate),
        link_layer=np.repeat([0, 1], n_hosts * k),
        layer_names=LAYERS,
        nic_links=nic_links,
        cables=np.stack([egress, n_hosts * k + egress], axis=1),
        router=router,
    )
