"""The parameter server's seam (mlfabric/ps/policy.py): no import cycle, no policy name outside the registry, user policies.

    .venv/bin/python -m pytest tests/unit/test_ps_policy.py -q
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mlfabric.ps
from mlfabric.ps import PSConfig, PSLayout, Policy, register_policy
from tests.unit.test_ps import run_job

pytestmark = pytest.mark.usefixtures("isolated_policy_registry")

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_cycles"] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_among_the_ps_modules() -> None:
    tool = _tool()
    graph = tool.import_graph(ROOT / "mlfabric" / "ps")
    assert "mlfabric.ps.policy" in graph and "mlfabric.ps.policies.scheduled.service" in graph
    assert tool.cycles(graph) == []


def test_the_cycle_counter_finds_a_cycle() -> None:
    tool = _tool()
    assert tool.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert tool.cycles({"a": {"b"}, "b": set()}) == []


def test_no_policy_name_is_compared_outside_the_registry() -> None:
    assert _tool().policy_name_comparisons(ROOT / "mlfabric" / "ps") == []


def test_unknown_policies_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'nope'; choose one of direct, mlnet, scheduled"):
        PSConfig(routing="nope")
    with pytest.raises(ValueError, match="registered already"):
        register_policy("direct", lambda config: Policy())


class _DropOddClocks(Policy):
    """A user's policy: pushes computed at odd clocks never leave the worker."""

    name = "drop-odd"

    def send_push(self, worker: Any, model: str, components: list[torch.Tensor], pushes: list[Any]) -> Any:
        if worker.clock_value % 2:
            return None  # dropped: push() returns False
        return super().send_push(worker, model, components, pushes)


def test_a_registered_policy_runs_through_the_runtime() -> None:
    register_policy("drop-odd", lambda config: _DropOddClocks(), replace=True)
    assert "drop-odd" in mlfabric.ps.policy_names()
    layout = PSLayout(servers=1, workers=2)

    def work(w: Any) -> Any:
        w.init_model("m", torch.zeros(4), lr=1.0)
        results = []
        for _ in range(4):
            w.pull("m")
            results.append(w.push("m", torch.ones(4)))
            w.clock()
        return results, w.stats.pushes_dropped

    out, _ = run_job(layout, PSConfig(consistency="async", timeout_s=20, routing="drop-odd"), work)
    for rank in layout.worker_ranks:
        assert out[rank] == ([True, False, True, False], 2)
    assert out[0].worker_updates == 4  # 2 workers x the 2 even clocks
