"""Emulated clusters on one machine: namespaces, rate-limited NICs, churn, stragglers, launcher.

    sudo .venv/bin/python -m pytest tests/emu -q
    sudo .venv/bin/python -m mlfabric.emu launch --hosts 4 --rate 100mbit -- python train.py

Modules: :mod:`~mlfabric.emu.cluster` (plan + build star/racks/bcube clusters, rates, cleanup),
:mod:`~mlfabric.emu.churn` (N1-N3 bandwidth churn, trace CSV), :mod:`~mlfabric.emu.stragglers`
(C1-C3, eager-SGD delay injection; pure), :mod:`~mlfabric.emu.launcher` (the launcher),
:mod:`~mlfabric.emu.doctor`, :mod:`~mlfabric.emu.goodput` (TCP meter for tests),
:mod:`~mlfabric.emu.cli` (typer commands). See ``docs/emulator.md``.
"""

from typing import TYPE_CHECKING

from mlfabric._lazy import lazy_exports

if TYPE_CHECKING:
    from mlfabric.emu.churn import CHURN_MODELS, ChurnModel, ChurnRunner, churn_model, churn_schedule
    from mlfabric.emu.cluster import Cluster, ClusterPlan, cleanup, list_runs, plan_cluster
    from mlfabric.emu.cmd import EmuCommandError, EmuUnavailableError, have_root
    from mlfabric.emu.launcher import LaunchSpec, launch
    from mlfabric.emu.stragglers import (
        STRAGGLER_PRESETS, ImbalanceInjector, LinearSkew, RandomDelay, StragglerModel, imbalance_model,
    )

# Resolved on first use (mlfabric/_lazy.py): `mlfabric.emu.cli`, which every `mlfabric`
# command imports, then loads without numpy and the cluster machinery.
_EXPORTS = {
    "churn": ("CHURN_MODELS", "ChurnModel", "ChurnRunner", "churn_model", "churn_schedule"),
    "cluster": ("Cluster", "ClusterPlan", "cleanup", "list_runs", "plan_cluster"),
    "cmd": ("EmuCommandError", "EmuUnavailableError", "have_root"),
    "launcher": ("LaunchSpec", "launch"),
    "stragglers": ("STRAGGLER_PRESETS", "ImbalanceInjector", "LinearSkew", "RandomDelay", "StragglerModel",
                   "imbalance_model"),
}
__getattr__ = lazy_exports(__name__, {name: module for module, names in _EXPORTS.items() for name in names})

__all__ = [name for names in _EXPORTS.values() for name in names]
