"""Fair-share pacing: the shares builders state, the rates they turn into, and the
communicator handing only changes to the transport.

Run: python -m pytest tests/unit/test_fair_share.py
"""

from __future__ import annotations

import pytest
import torch

from mlfabric.collectives import build
from mlfabric.collectives.bcube import bcube_allreduce, hierarchical_allreduce
from mlfabric.collectives.p2p_ps import p2p_ps_allreduce
from mlfabric.runtime.communicator import Communicator
from mlfabric.runtime.fair_share import NIC_RATE_ENV, PAYLOAD_FRACTION, connection_rates, nic_rates_from
from mlfabric.schedule import Cost
from mlfabric.transport.local import LocalFabric


def _neighbours(n: int, k: int, rank: int, level: int) -> set[int]:
    digits = [(rank // n**i) % n for i in range(k)]
    out = set()
    for d in range(n):
        if d != digits[level]:
            other = digits[:level] + [d] + digits[level + 1:]
            out.add(sum(v * n**i for i, v in enumerate(other)))
    return out


@pytest.mark.parametrize(("n", "k"), [(2, 2), (3, 2), (4, 2), (2, 3)])
def test_bml_gives_each_level_neighbour_an_equal_share_of_its_nic(n: int, k: int) -> None:
    world = n**k
    for rank in range(world):
        shares = bcube_allreduce(world, rank, 10 * world, n=n, k=k).cost.link_shares
        expected = {(peer, str(level)): 1 / (n - 1) for level in range(k) for peer in _neighbours(n, k, rank, level)}
        if n == 2:
            expected = {}  # one neighbour per level: the whole NIC, nothing to share
        assert shares == pytest.approx(expected)


def test_bml_on_one_nic_shares_it_between_all_threads() -> None:
    # k threads each send to n-1 neighbours at once, all through channel "0".
    shares = bcube_allreduce(9, 4, 900, n=3, k=2, channels=("0", "0")).cost.link_shares
    assert shares == pytest.approx({(3, "0"): 0.25, (5, "0"): 0.25, (1, "0"): 0.25, (7, "0"): 0.25})


def test_hierarchical_shares_follow_each_levels_group_size() -> None:
    # Radices (2, 4): one partner in the first group (whole NIC), three in the second.
    shares = hierarchical_allreduce(8, 0, 800, radices=(2, 4)).cost.link_shares
    assert shares == pytest.approx({(2, "0"): 1 / 3, (4, "0"): 1 / 3, (6, "0"): 1 / 3})


def test_p2p_ps_shares_the_nic_between_all_peers_and_ring_states_none() -> None:
    assert p2p_ps_allreduce(4, 2, 40).cost.link_shares == pytest.approx(
        {(3, "0"): 1 / 3, (0, "0"): 1 / 3, (1, "0"): 1 / 3})
    assert p2p_ps_allreduce(2, 0, 40).cost.link_shares == {}
    assert build("allreduce:ring", 4, 0, 400).cost.link_shares == {}


def test_cost_rejects_shares_outside_zero_one() -> None:
    with pytest.raises(ValueError, match=r"link share of connection \(1, '0'\)"):
        Cost(steps=1, elements_sent={"0": 1}, link_shares={(1, "0"): 1.5})
    with pytest.raises(ValueError, match="must be in"):
        Cost(steps=1, elements_sent={"0": 1}, link_shares={(1, "0"): 0.0})


def test_connection_rates_pace_shared_connections_and_release_the_others() -> None:
    schedule = bcube_allreduce(9, 4, 900, n=3, k=2)
    rates = connection_rates(schedule, {"0": 500e6, "1": 1e9})
    assert rates == pytest.approx({(3, "0"): PAYLOAD_FRACTION * 250e6, (5, "0"): PAYLOAD_FRACTION * 250e6,
                                   (1, "1"): PAYLOAD_FRACTION * 500e6, (7, "1"): PAYLOAD_FRACTION * 500e6})
    # A channel whose rate is unknown is not paced.
    assert connection_rates(schedule, {"0": 500e6})[(1, "1")] is None
    # The ring sends to one peer at a time: its connection gets the whole NIC (no cap).
    assert connection_rates(build("allreduce:ring", 4, 0, 400), {"0": 1e9}) == {(1, "0"): None}


def test_nic_rates_from_arguments_and_environment(monkeypatch) -> None:
    channels = ("0", "1")
    assert nic_rates_from(5e8, channels) == {"0": 5e8, "1": 5e8}
    assert nic_rates_from("500mbit", channels) == {"0": 5e8, "1": 5e8}
    assert nic_rates_from("0=1gbit,1=500mbit", channels) == {"0": 1e9, "1": 5e8}
    assert nic_rates_from({"1": 2e9}, channels) == {"1": 2e9}
    monkeypatch.delenv(NIC_RATE_ENV, raising=False)
    assert nic_rates_from(None, channels) == {}
    monkeypatch.setenv(NIC_RATE_ENV, "100mbit")
    assert nic_rates_from(None, channels) == {"0": 1e8, "1": 1e8}
    with pytest.raises(ValueError, match=NIC_RATE_ENV):
        nic_rates_from("2=1gbit", channels)
    with pytest.raises(ValueError, match="must be positive"):
        nic_rates_from({"0": 0.0}, channels)


def test_communicator_tells_the_transport_only_what_changes() -> None:
    transports = LocalFabric(9, ("0", "1")).transports()
    calls: list[list[tuple[int, str, float | None]]] = [[] for _ in transports]
    for rank, transport in enumerate(transports):
        transport.pace_connection = lambda peer, channel, rate, rank=rank: calls[rank].append((peer, channel, rate)) or True
    comms = [Communicator(t, topology="bcube:n=3,k=2", nic_rate="500mbit", timeout=20) for t in transports]
    try:
        def run(algorithm: str) -> None:
            futures = [c.allreduce_async(torch.ones(900), algorithm=algorithm) for c in comms]
            for future in futures:
                assert torch.equal(future.wait(), torch.full((900,), 9.0))

        run("bcube")
        share = PAYLOAD_FRACTION * 250e6
        assert sorted(calls[4]) == [(1, "1", share), (3, "0", share), (5, "0", share), (7, "1", share)]
        run("bcube")  # same caps: nothing to tell
        assert len(calls[4]) == 4
        run("ring")  # the ring's one connection (to rank 5 on channel 0) gets the whole NIC again
        assert calls[4][4:] == [(5, "0", None)]
    finally:
        for comm in comms:
            comm.close()


def test_a_transport_that_cannot_pace_is_told_once(caplog) -> None:
    transports = LocalFabric(3, ("0",)).transports()  # the in-process transport cannot pace
    asked = []
    for transport in transports:
        original = transport.pace_connection
        transport.pace_connection = lambda *a, original=original: asked.append(a) or original(*a)
    comms = [Communicator(t, nic_rate="1gbit", timeout=20) for t in transports]
    try:
        with caplog.at_level("INFO", logger="mlfabric.runtime"):
            for _ in range(2):
                futures = [c.allreduce_async(torch.ones(30), algorithm="ps") for c in comms]
                for future in futures:
                    assert torch.equal(future.wait(), torch.full((30,), 3.0))
        assert len(asked) == 3  # one refused request per rank, then never again
        assert all(c.nic_rates == {} for c in comms)
        assert sum("cannot pace connections" in r.getMessage() for r in caplog.records) == 3
    finally:
        for comm in comms:
            comm.close()
