"""The cluster -> rank environment mapping and the BML benchmark/job configs (no root needed).

    .venv/bin/python -m pytest tests/unit/test_bml_env.py -q
"""

from __future__ import annotations

import io
import sys

import pytest

from mlfabric.emu.cluster import plan_cluster
from mlfabric.emu.launcher import LaunchSpec, cluster_launch_config, launch


def test_rank_env_of_a_bcube_host():
    plan = plan_cluster("bcube:n=3,k=2", 500e6, prefix="mfabcd")
    assert plan.rank_env(4) == {
        "MLFABRIC_CHANNEL_ADDRS": "0=10.0.0.5,1=10.1.0.5",  # host 4: NIC l at 10.l.0.5
        "MLFABRIC_TOPOLOGY": "bcube:n=3,k=2",
        "MLFABRIC_EMU_PREFIX": "mfabcd",
        "MLFABRIC_EMU_NETNS": "mfabcd-h4",
        "GLOO_SOCKET_IFNAME": "eth0",
        "MLFABRIC_CHUNK_BYTES": str(1 << 20),  # ~16 ms at 500 Mbit/s (pipeline_chunk_bytes)
        "MLFABRIC_NIC_RATE": "500000000",  # fair-share pacing of BML's connections
    }
    assert plan.rank_env(0, cluster_json="/tmp/c.json")["MLFABRIC_EMU_CLUSTER"] == "/tmp/c.json"
    envs = plan.rank_envs()
    assert len(envs) == 9 and envs[4] == plan.rank_env(4)
    assert [env["MLFABRIC_EMU_NETNS"] for env in envs] == [f"mfabcd-h{h}" for h in range(9)]
    prefixes = plan.command_prefixes()
    # ip netns exec <host's namespace>, then the host's own hostname (unshare --uts, #39 item 2).
    assert prefixes[4][1:4] == ["netns", "exec", "mfabcd-h4"] and prefixes[4][0].endswith("ip")
    assert prefixes[4][4].endswith("unshare") and prefixes[4][5] == "--uts" and prefixes[4][-1] == "mfabcd-h4"
    with pytest.raises(ValueError, match="rank 9 has no host"):
        plan.rank_env(9)


def test_pipeline_chunk_follows_the_nic_rate():
    from mlfabric.emu.cluster import pipeline_chunk_bytes

    assert pipeline_chunk_bytes(1e9) == 2 << 20          # 125 MB/s x 16 ms = 2 MB -> 2 MiB
    assert pipeline_chunk_bytes(500e6) == 1 << 20
    assert pipeline_chunk_bytes(1e6) == 256 << 10        # bounded below: per-message cost
    assert pipeline_chunk_bytes(100e9) == 16 << 20       # bounded above: the builders' default
    with pytest.raises(ValueError, match="positive"):
        pipeline_chunk_bytes(0)


def test_rank_env_of_a_star_host():
    env = plan_cluster("star:n=9", 500e6, prefix="mf00ff").rank_env(8)
    assert env["MLFABRIC_CHANNEL_ADDRS"] == "0=10.0.0.9"
    assert env["MLFABRIC_TOPOLOGY"] == "star:n=9"


def test_cluster_launch_config_places_rank_r_on_host_r():
    plan = plan_cluster("bcube:n=3,k=2", 500e6, prefix="mfabcd")
    config = cluster_launch_config(plan, timeout_s=7.0, capture_output=True)
    assert config.world_size == 9 and config.timeout_s == 7.0 and config.capture_output
    assert config.master_addr == "10.0.0.1" and config.master_port == 29500
    assert list(config.rank_env) == plan.rank_envs()
    assert [list(p) for p in config.command_prefix] == plan.command_prefixes()


def test_cluster_launch_config_places_ranks_on_given_hosts():
    """``mlfabric train --workers-per-host 2 --emulate``: the server alone, workers two to a host."""
    from mlfabric.train.harness import EagerTrainConfig

    placed = EagerTrainConfig(workers=4, workers_per_host=2, modes=("mlfabric-a:8",)).host_placement(5, ps=True)
    assert placed == [0, 1, 1, 2, 2]
    plan = plan_cluster("star:n=3", 1e9, prefix="mfabce")
    config = cluster_launch_config(plan, hosts=placed)
    prefixes, envs = plan.command_prefixes(), plan.rank_envs()
    assert config.world_size == 5 and [list(p) for p in config.command_prefix] == [prefixes[h] for h in placed]
    assert all("MLFABRIC_TOPOLOGY" not in env for env in config.rank_env)  # the ranks learn their hosts
    with pytest.raises(ValueError, match=r"outside the topology's hosts 0\.\.2"):
        cluster_launch_config(plan, hosts=[0, 3])
    with pytest.raises(ValueError, match="multiple of --workers-per-host"):
        EagerTrainConfig(workers=3, workers_per_host=2)


def test_launcher_fallback_still_sets_the_topology():
    out = io.StringIO()
    script = "import os; print(os.environ['RANK'], os.environ['MLFABRIC_TOPOLOGY'])"
    code = launch(LaunchSpec(command=(sys.executable, "-c", script), topology="star:n=2", emulate="never"),
                  out=out, err=io.StringIO())
    assert code == 0
    assert sorted(out.getvalue().splitlines()) == ["[rank 0] 0 star:n=2", "[rank 1] 1 star:n=2"]


def test_bench_config_needs_a_bcube_for_bml_and_compare_star():
    from mlfabric.bench.allreduce import AllreduceBenchConfig, compare_star_config

    with pytest.raises(ValueError, match="bcube"):
        AllreduceBenchConfig(world_size=4, algorithms=("bcube",))
    with pytest.raises(ValueError, match="bcube"):
        AllreduceBenchConfig(world_size=9, algorithms=("bcube",), emulate_topology="star:n=9", emulate_rate_bps=1e8)
    config = AllreduceBenchConfig(world_size=9, algorithms=("bcube", "ring", "gloo"), sizes=(1000,),
                                  emulate_topology="bcube:n=3,k=2", emulate_rate_bps=5e8)
    star = compare_star_config(config)
    assert star.emulate_topology == "star:n=9" and star.algorithms == ("ring", "ps")
    assert star.emulate_rate_bps == 5e8 and star.sizes == (1000,) and star.world_size == 9
    with pytest.raises(ValueError, match="include bcube"):
        compare_star_config(AllreduceBenchConfig(world_size=9, algorithms=("ring",), emulate_topology="bcube:n=3,k=2",
                                                 emulate_rate_bps=5e8))
    with pytest.raises(ValueError, match="compare-star"):
        compare_star_config(AllreduceBenchConfig(world_size=9, algorithms=("ring",), emulate_topology="star:n=9",
                                                 emulate_rate_bps=5e8))


def test_simulated_prediction_of_the_emulated_rows():
    from mlfabric.bench.allreduce import simulated_allreduce_s

    size = 64_000_000
    t_f = size * 8 / 500e6
    assert simulated_allreduce_s("gloo", "bcube:n=3,k=2", 500e6, size) is None
    # BML §3.2: GST 2(N-1)/(kN) T_F on BCube(n,k); ring and P2P PS 2(N-1)/N T_F on a star.
    assert simulated_allreduce_s("bcube", "bcube:n=3,k=2", 500e6, size) == pytest.approx(16 / 18 * t_f, rel=1e-3)
    assert simulated_allreduce_s("auto", "bcube:n=3,k=2", 500e6, size) == pytest.approx(16 / 18 * t_f, rel=1e-3)
    assert simulated_allreduce_s("ring", "star:n=9", 500e6, size) == pytest.approx(16 / 9 * t_f, rel=1e-3)
    assert simulated_allreduce_s("ps", "star:n=9", 500e6, size) == pytest.approx(16 / 9 * t_f, rel=1e-3)


def test_bml_job_config():
    from mlfabric.train.bml_job import BmlJobConfig
    from mlfabric.train.models import LeNet5, count_parameters

    config = BmlJobConfig(iterations=5, batches=(32, 128))
    assert config.hosts == 9
    bml, ps = config.networks
    assert (bml.name, bml.topology, bml.algorithm) == ("BML", "bcube:n=3,k=2", "bcube")
    assert (ps.name, ps.topology, ps.algorithm) == ("PS", "star:n=9", "ps")
    train = config.train_config(128, bml)
    assert train.model == "lenet5" and train.topology == "bcube:n=3,k=2" and train.batch_size == 128
    assert train.data.kind == "images" and train.steps == 5
    assert count_parameters(LeNet5()) == 3_274_634  # BML §4.2: 3.27 million, 12.5 MiB of float32
    with pytest.raises(ValueError, match="raise train_samples"):
        BmlJobConfig(train_samples=900).train_config(128, bml)
    with pytest.raises(ValueError, match="BCube"):
        BmlJobConfig(bcube="star:n=9")


def test_bench_config_checks_its_start_mode():
    from mlfabric.bench.allreduce import AllreduceBenchConfig

    assert AllreduceBenchConfig(world_size=2).start == "aligned"
    assert AllreduceBenchConfig(world_size=2, start="barrier").start == "barrier"
    with pytest.raises(ValueError, match="aligned or barrier"):
        AllreduceBenchConfig(world_size=2, start="now")
    with pytest.raises(ValueError, match="align_margin_s"):
        AllreduceBenchConfig(world_size=2, align_margin_s=-1)


def test_aligned_start_is_a_margin_after_the_latest_rank():
    import time

    from mlfabric.bench.procs import aligned_start, sleep_until

    seen = []

    def latest(t: float) -> float:  # as if another rank got there 0.2 s after this one
        seen.append(t)
        return t + 0.2

    before = time.monotonic()
    start = aligned_start(latest, 0.05)
    assert len(seen) == 1 and before <= seen[0] <= time.monotonic()
    assert start == pytest.approx(seen[0] + 0.25)
    assert sleep_until(time.monotonic() + 0.02) is True
    assert sleep_until(time.monotonic() - 0.01) is False
    assert time.monotonic() >= before + 0.02
