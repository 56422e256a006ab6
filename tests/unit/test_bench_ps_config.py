"""The PS incast benchmark's pure parts: its configuration and the simulated phases.

    .venv/bin/python -m pytest tests/unit/test_bench_ps_config.py -q

(The benchmark itself runs on an emulated cluster: tests/emu/test_bench_ps.py, root.)
"""

from __future__ import annotations

import pytest

from mlfabric.bench.ps import PSBenchConfig, simulated_ps_phases


def test_config_places_servers_first_and_shards_evenly():
    config = PSBenchConfig(workers=8, servers=3, model_bytes=64_000_000 + 3)  # 3 bytes: not a whole element
    assert config.hosts == 11 and config.topology == "star:n=11"
    assert config.numel == 16_000_000
    shards = config.shard_bytes()
    assert sum(shards) == 64_000_000 and max(shards) - min(shards) <= 4


@pytest.mark.parametrize("fields", [dict(workers=0), dict(servers=0), dict(iterations=2, warmup=2),
                                    dict(warmup=-1), dict(transport="carrier-pigeon"), dict(rate_bps=1000),
                                    dict(model_bytes=4, servers=2), dict(ps_timeout_s=0)])
def test_config_rejects(fields):
    with pytest.raises(ValueError):
        PSBenchConfig(**fields)


@pytest.mark.parametrize("servers", [1, 2])
def test_simulated_phases_are_incast_through_the_server_nics(servers):
    # BSP, no compute: W workers push the model into the servers' S NICs, then pull it back.
    config = PSBenchConfig(workers=8, servers=servers, model_bytes=64_000_000)
    sim = simulated_ps_phases(config, 1e9)
    one_way = 8 * 64e6 * 8 / 1e9 / servers
    assert sim["push_s"] == pytest.approx(one_way, rel=1e-6)
    assert sim["pull_s"] == pytest.approx(one_way, rel=1e-6)
    assert sim["iteration_s"] == pytest.approx(2 * one_way, rel=1e-6)
    slower = simulated_ps_phases(config, 0.95e9)
    assert slower["iteration_s"] == pytest.approx(sim["iteration_s"] / 0.95, rel=1e-6)
