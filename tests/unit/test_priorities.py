"""Job priorities (MLNET §3): the mark a job's packets carry, the emulator's priority queues
that serve it, and the multi-job benchmark's settings (no root needed here; the emulated
checks are in tests/emu/test_job_priorities.py).

    .venv/bin/python -m pytest tests/unit/test_priorities.py -q
"""

from __future__ import annotations

import re
import socket

import pytest

from mlfabric.bench.mlnet_priorities import PriorityBenchConfig, _expected
from mlfabric.emu.cluster import _fair_uplink_commands, _htb_commands
from mlfabric.transport.sockets import PRIORITY_ENV, parse_priority, priority_from_env, priority_tos, set_priority


@pytest.mark.parametrize("bad", [8, -1, "x", "1.5", "", " 9", True])
def test_a_priority_out_of_range_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match=r"priority must be an integer from 0 \(unmarked, the default\) to 7"):
        parse_priority(bad)


def test_priorities_go_in_the_ip_precedence_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [priority_tos(p) for p in range(8)] == [0, 0x20, 0x40, 0x60, 0x80, 0xA0, 0xC0, 0xE0]
    monkeypatch.delenv(PRIORITY_ENV, raising=False)
    assert priority_from_env() == 0
    monkeypatch.setenv(PRIORITY_ENV, " 3 ")
    assert priority_from_env() == 3
    with socket.socket() as sock:
        set_priority(sock, 6)
        assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0xC0


def test_every_shaped_nic_has_a_strict_priority_class_per_priority() -> None:
    cmds = _htb_commands("eth0", 100_000_000, 625_000)
    assert cmds[0] == "qdisc replace dev eth0 root handle 1: htb default 100"  # unmarked: priority 0
    classes = {m[1]: int(m[2]) for c in cmds if (m := re.search(r"classid (1:10\d) htb .* prio (\d)", c))}
    assert classes == {f"1:10{p}": 7 - p for p in range(8)}  # HTB serves prio 0 (priority 7) first
    filters = [c for c in cmds if c.startswith("filter")]
    assert filters == [f"filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip tos {p << 5:#x} 0xe0 "
                       f"flowid 1:10{p}" for p in range(1, 8)]
    assert all("rate 8000bit ceil 100000000bit" in c for c in cmds if "classid 1:10" in c)


def test_an_uplink_serves_marked_traffic_before_each_hosts_fair_share() -> None:
    cmds = _fair_uplink_commands("u0", 100_000_000, ["10.0.0.1", "10.0.0.2"], "src", 625_000)
    tos_filters = [i for i, c in enumerate(cmds) if "match ip tos" in c]
    host_filters = [c for c in cmds if "match ip src" in c]
    assert len(tos_filters) == 7 and all(" prio 1 " in cmds[i] for i in tos_filters)
    assert len(host_filters) == 2 and all(" prio 2 " in c for c in host_filters)
    assert all("prio 7" in c for c in cmds if re.search(r"classid 1:[23] ", c))  # the hosts' shares: last
    with pytest.raises(ValueError, match="at most 253 per rack"):
        _fair_uplink_commands("u0", 100_000_000, [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(254)], "src", 1)


def test_the_benchmark_settings_are_checked_and_priorities_are_a_permutation() -> None:
    assert sorted(PriorityBenchConfig(jobs=4).priorities()) == [1, 2, 3, 4]
    assert PriorityBenchConfig(jobs=4, seed=0).priorities() == PriorityBenchConfig(jobs=4, seed=0).priorities()
    for bad, message in [(dict(jobs=1), "jobs must be 2..7"), (dict(jobs=8), "jobs must be 2..7"),
                         (dict(workers=0), "workers and iterations"), (dict(routing="ring"), "direct or mlnet"),
                         (dict(scenarios=("fast",)), "scenarios are fair, priority, alone")]:
        with pytest.raises(ValueError, match=message):
            PriorityBenchConfig(**bad)


def test_the_benchmarks_expected_model_is_the_bsp_mean() -> None:
    # workers 0 and 1 push (k mod 7) + 1 and (k mod 7) + 2: mean (k mod 7) + 1.5, twice
    assert _expected(8, 2, 2).tolist() == [-2 * ((k % 7) + 1.5) for k in range(8)]
