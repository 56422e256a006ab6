"""Hierarchical collectives (collectives/hierarchical.py): numbers on the reference
interpreter for many host layouts, structure (what stays on a host, what crosses the
network), the validator's host-internal hop and ``auto``'s choice.

    python -m pytest tests/unit/test_hierarchical.py -q
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlfabric.collectives import build, choose_allreduce
from mlfabric.collectives.hierarchical import (
    PHASE_TAGS,
    HostLayout,
    host_hierarchical_allgather,
    host_hierarchical_allreduce,
    host_hierarchical_broadcast,
)
from mlfabric.collectives.partition import pieces
from mlfabric.collectives.ring import ring_allreduce, ring_reduce_scatter
from mlfabric.schedule import Recv, ScheduleBuilder, ScheduleError, Send, validate
from mlfabric.schedule.interpret import interpret

LAYOUTS = [
    (0, 0, 1, 1),
    (0, 0, 0, 1, 1, 1),
    (0, 1, 0, 1),              # interleaved ranks
    (0, 0, 1, 1, 2, 2, 3, 3),  # the emulated 4 hosts x 2 ranks
    (0, 0, 0, 1, 1),           # uneven: leaders
    (7, 7, 3),                 # arbitrary labels, uneven
    (0, 0, 0, 0),              # one host
    (0, 1, 2),                 # one rank per host
]
COUNTS = (0, 1, 7, 1001)


def _inputs(n: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size=count, dtype=np.int64) for _ in range(n)]


@pytest.mark.parametrize("inter", ["ring", "halving_doubling", "tree"])
@pytest.mark.parametrize("hosts", LAYOUTS, ids=str)
def test_allreduce_matches_reference(hosts: tuple[int, ...], inter: str) -> None:
    n = len(hosts)
    for seed, count in enumerate(COUNTS):
        for op, reduce in (("sum", np.sum), ("max", np.max)):
            schedules = [host_hierarchical_allreduce(n, r, count, hosts=hosts, inter=inter, op=op) for r in range(n)]
            validate(schedules, hosts=hosts)
            data = _inputs(n, count, seed)
            expected = reduce(np.stack(data), axis=0)
            for rank, out in enumerate(interpret(schedules, data)):
                np.testing.assert_array_equal(out, expected, err_msg=f"rank {rank}, count {count}, {op}")


def test_allreduce_with_bcube_between_hosts() -> None:
    hosts = tuple(r // 2 for r in range(18))  # 9 hosts = BCube(3,2), 2 ranks each
    schedules = [host_hierarchical_allreduce(18, r, 999, hosts=hosts, inter="bcube",
                                             inter_shape=(("n", 3), ("k", 2))) for r in range(18)]
    validate(schedules, hosts=hosts)
    data = _inputs(18, 999, 5)
    for out in interpret(schedules, data):
        np.testing.assert_array_equal(out, np.sum(np.stack(data), axis=0))


@pytest.mark.parametrize("hosts", LAYOUTS, ids=str)
def test_broadcast_from_every_root(hosts: tuple[int, ...]) -> None:
    n = len(hosts)
    for root in range(n):
        schedules = [host_hierarchical_broadcast(n, r, 1001, hosts=hosts, root=root) for r in range(n)]
        report = validate(schedules, hosts=hosts)
        # Each host other than the root's receives the buffer once over the network.
        assert report.elements_across_hosts == 1001 * (len(set(hosts)) - 1)
        data = _inputs(n, 1001, root)
        for out in interpret(schedules, data):
            np.testing.assert_array_equal(out, data[root])


@pytest.mark.parametrize("hosts", LAYOUTS, ids=str)
def test_allgather_gathers_every_piece(hosts: tuple[int, ...]) -> None:
    n = len(hosts)
    for per_rank in (0, 1, 13):
        count = n * per_rank
        schedules = [host_hierarchical_allgather(n, r, count, hosts=hosts) for r in range(n)]
        report = validate(schedules, hosts=hosts)
        layout = HostLayout(hosts, n)
        # Every host's block crosses the network once to every other host.
        assert report.elements_across_hosts == per_rank * sum(
            len(ranks) * (layout.n_hosts - 1) for ranks in layout.members)
        data = _inputs(n, count, per_rank)
        parts = pieces(count, n)
        expected = np.concatenate([data[r][p.offset:p.end] for r, p in enumerate(parts)])
        for out in interpret(schedules, data):
            np.testing.assert_array_equal(out, expected)


def test_network_carries_only_the_inter_host_part() -> None:
    """4 hosts x 2 ranks: each host's NIC sends 2(H-1)/H x count, as a 4-host ring does, and a
    flat 8-rank ring with neighbours on other hosts sends twice... its ranks' 2(N-1)/N each."""
    hosts, count = (0, 0, 1, 1, 2, 2, 3, 3), 8000
    schedules = [host_hierarchical_allreduce(8, r, count, hosts=hosts) for r in range(8)]
    per_host = [0] * 4
    for rank, sched in enumerate(schedules):
        within, across = sched.elements_sent_by_hop(hosts)
        assert sched.cost.elements_across_hosts == across
        assert within == 2 * (2 - 1) * count // 2  # ring reduce-scatter + allgather of 2 ranks
        per_host[hosts[rank]] += across
    assert per_host == [2 * 3 * count // 4] * 4
    four_host_ring = ring_allreduce(4, 0, count).cost.total_elements_sent
    assert per_host[0] == four_host_ring
    interleaved = tuple(r % 4 for r in range(8))  # every ring neighbour on another host
    flat = [ring_allreduce(8, r, count) for r in range(8)]
    flat_per_host = [0] * 4
    for rank, sched in enumerate(flat):
        flat_per_host[interleaved[rank]] += sched.elements_sent_by_hop(interleaved)[1]
    assert flat_per_host == [2 * 2 * 7 * count // 8] * 4  # 2.33x the hierarchical's


def test_structure_reduce_scatter_inside_then_segment_between_hosts() -> None:
    hosts, count = (0, 0, 1, 1), 400
    sched = host_hierarchical_allreduce(4, 1, count, hosts=hosts)  # rank 1: host 0, local index 1
    sends = [op for op in sched.ops if isinstance(op, Send)]
    phases = [op.tag // PHASE_TAGS for op in sends]
    assert phases == sorted(phases) and set(phases) == {0, 1, 2}
    assert {op.peer for op in sends if op.tag // PHASE_TAGS in (0, 2)} == {0}  # its host-mate
    assert {op.peer for op in sends if op.tag // PHASE_TAGS == 1} == {3}       # local index 1 of host 1
    # Between hosts it works on its own segment (the second half) only.
    recvs = [op for op in sched.ops if isinstance(op, Recv) and op.tag // PHASE_TAGS == 1]
    assert all(200 <= op.dst.offset and op.dst.end <= 400 for op in recvs)


def test_validator_checks_the_stated_inter_host_elements() -> None:
    hosts = (0, 0, 1, 1)
    schedules = [host_hierarchical_allreduce(4, r, 100, hosts=hosts) for r in range(4)]
    lying = dataclasses.replace(schedules[2], cost=dataclasses.replace(schedules[2].cost, elements_across_hosts=0))
    with pytest.raises(ScheduleError, match="rank 2 .*states 0 elements sent to other hosts"):
        validate([*schedules[:2], lying, schedules[3]], hosts=hosts)
    with pytest.raises(ScheduleError, match="3 ranks' hosts for 4"):
        validate(schedules, hosts=(0, 0, 1))


def test_append_embeds_a_subgroup_schedule() -> None:
    """ScheduleBuilder.append(ranks=, offset=): a 2-rank ring on ranks 1 and 3 over elements 10..30."""
    b = ScheduleBuilder("embed", 3, 4)
    b.buffer("data", 40)
    added = b.append(ring_reduce_scatter(2, 1, 20), ranks=[1, 3], offset=10, tag_offset=5)
    ops = [b.ops[i] for i in added]
    assert {op.peer for op in ops if isinstance(op, (Send, Recv))} == {1}
    assert all(op.tag >= 5 for op in ops if isinstance(op, (Send, Recv)))
    assert all(10 <= op.src.offset and op.src.end <= 30 for op in ops if isinstance(op, Send))
    with pytest.raises(ValueError, match="does not fit"):
        b.append(ring_reduce_scatter(2, 1, 40), ranks=[1, 3], offset=10)
    with pytest.raises(ValueError, match="cannot append"):
        b.append(ring_reduce_scatter(2, 0, 20), ranks=[1, 3])


def test_auto_picks_hierarchical_on_several_multi_rank_hosts() -> None:
    big = 64 << 20
    assert choose_allreduce("auto", big, 8, hosts=(0, 0, 1, 1, 2, 2, 3, 3)) == "host_hierarchical"
    assert choose_allreduce("auto", 4096, 4, hosts=(0, 0, 1, 1)) == "host_hierarchical"
    assert choose_allreduce("auto", big, 4, hosts=(0, 0, 0, 0)) == "ring"           # one host
    assert choose_allreduce("auto", big, 4, hosts=(0, 1, 2, 3)) == "ring"           # one rank per host
    assert choose_allreduce("auto", big, 3, hosts=(0, 0, 1)) == "ring"              # one multi-rank host
    assert choose_allreduce("auto", big, 4) == "ring"                               # layout unknown


def test_build_registers_the_hierarchical_collectives() -> None:
    hosts = (0, 0, 1, 1)
    assert build("allreduce:host_hierarchical", 4, 0, 10, hosts=hosts).name == "host_hierarchical_allreduce"
    assert build("broadcast:host_hierarchical", 4, 0, 10, hosts=hosts, root=2).name == "host_hierarchical_broadcast"
    assert build("allgather:host_hierarchical", 4, 0, 8, hosts=hosts).name == "host_hierarchical_allgather"
    with pytest.raises(ValueError, match="unknown inter-host algorithm 'mesh'"):
        host_hierarchical_allreduce(4, 0, 10, hosts=hosts, inter="mesh")
    with pytest.raises(ValueError, match="host of 3 ranks"):
        host_hierarchical_allreduce(4, 0, 10, hosts=(0, 0, 1))


# --- through the runtime, on threads (the in-process transport) ------------------------------


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1), (0, 0, 0, 1, 1)], ids=str)
def test_communicator_runs_hierarchical_collectives(hosts: tuple[int, ...]) -> None:
    import torch

    n = len(hosts)

    def body(comm) -> list[str]:
        names = []
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            for count in (0, 5, 100_003):
                t = torch.full((count,), comm.rank + 1, dtype=dtype)
                comm.allreduce(t, algorithm="auto")
                assert torch.equal(t, torch.full((count,), n * (n + 1) // 2, dtype=dtype)), (dtype, count)
                b = torch.full((count,), comm.rank, dtype=dtype)
                comm.broadcast(b, root=n - 1)
                assert torch.equal(b, torch.full((count,), n - 1, dtype=dtype))
                g = comm.allgather(torch.full((count,), comm.rank, dtype=dtype))
                assert torch.equal(g, torch.arange(n, dtype=dtype)[:, None].expand(n, count))
        t = torch.ones(10)
        comm.allreduce(t, algorithm="host_hierarchical", op="avg")
        assert torch.equal(t, torch.ones(10))
        names.append(comm.host_options("host_hierarchical", torch.zeros(1 << 20))["inter"])
        names.append(comm.host_options("host_hierarchical", torch.zeros(16))["inter"])
        return names

    import mlfabric

    for names in mlfabric.run_threads(n, body, timeout=30, hosts=hosts):
        assert names == ["ring", "halving_doubling"]  # auto's rule on each rank's slice


def test_hierarchical_without_hosts_names_the_fix() -> None:
    import torch

    import mlfabric

    def body(comm) -> None:
        comm.allreduce(torch.ones(4), algorithm="auto")  # unknown layout: flat, no error
        with pytest.raises(ValueError, match="needs to know which ranks share a host"):
            comm.allreduce(torch.ones(4), algorithm="host_hierarchical")
        with pytest.raises(ValueError, match="unknown broadcast algorithm 'ring'"):
            comm.broadcast(torch.ones(4), algorithm="ring")

    mlfabric.run_threads(2, body)


def test_emulated_rank_placements() -> None:
    from mlfabric.emu.launcher import rank_hosts

    assert rank_hosts(4, 2) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rank_hosts(4, 2, "interleaved") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rank_hosts(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="unknown rank placement 'random'"):
        rank_hosts(4, 2, "random")


def test_compare_flat_runs_the_hosts_ring_and_an_interleaved_flat_ring() -> None:
    from mlfabric.bench.allreduce import AllreduceBenchConfig, flat_comparison_configs

    config = AllreduceBenchConfig(world_size=8, algorithms=("host_hierarchical", "ring"), sizes=(64_000_000,),
                                  emulate_topology="star:n=4", emulate_rate_bps=1e9, ranks_per_host=2)
    assert config.hosts == (0, 0, 1, 1, 2, 2, 3, 3)
    hosts, flat = flat_comparison_configs(config)
    assert (hosts.world_size, hosts.ranks_per_host, hosts.algorithms) == (4, 1, ("ring",))
    assert (flat.world_size, flat.placement, flat.hosts) == (8, "interleaved", (0, 1, 2, 3, 0, 1, 2, 3))
    with pytest.raises(ValueError, match="add --emulate"):
        AllreduceBenchConfig(world_size=8, algorithms=("ring",), ranks_per_host=2)


def test_simulator_times_the_host_internal_hop() -> None:
    """Same-host transfers take no time without host links, and share their host's link
    (at its rate) with them: the simulated hierarchical allreduce sits between the 4-host
    ring and that plus the intra-host phases, and a flat interleaved ring is 7/3 x slower."""
    from mlfabric.sim.workloads import simulate_collective
    from mlfabric.topo import parse_topology

    star = parse_topology("star:n=4", "1Gbps")
    hosts = (0, 0, 1, 1, 2, 2, 3, 3)
    ring_hosts = simulate_collective("allreduce:ring", star, size_bytes=64e6).time_s
    assert ring_hosts == pytest.approx(2 * 3 / 4 * 64e6 * 8 / 1e9)
    free = simulate_collective("allreduce:host_hierarchical", star, size_bytes=64e6, ranks=8,
                               placement=list(hosts), hosts=hosts).time_s
    with_links = star.with_host_links(8e9)
    hier = simulate_collective("allreduce:host_hierarchical", with_links, size_bytes=64e6, ranks=8,
                               placement=list(hosts), hosts=hosts)
    assert free == pytest.approx(ring_hosts)  # intra-host phases in zero time
    # RS and AG inside a host: 2 ranks x 32 MB each over one 8 Gbit/s link, at most not overlapped.
    assert ring_hosts < hier.time_s <= ring_hosts + 2 * 2 * 32e6 * 8 / 8e9 + 1e-9
    assert hier.link_summary()["layers"]["host"]["total_bytes"] == pytest.approx(4 * 2 * 2 * 32e6)
    flat = simulate_collective("allreduce:ring", with_links, size_bytes=64e6, ranks=8,
                               placement=[r % 4 for r in range(8)]).time_s
    assert flat / ring_hosts == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="already has host-internal links"):
        with_links.with_host_links(1e9)
