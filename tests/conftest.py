"""Fixtures shared by the whole test tree.

    .venv/bin/python -m pytest tests -q
"""

from __future__ import annotations

import pytest


@pytest.fixture()
def isolated_policy_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PS policy registry as it was before the test: a test that registers a policy (or
    loads one through ``MLFABRIC_PS_PLUGINS`` in this process) leaves no name behind for later
    tests (a leaked ``drop-alternate`` once changed the list another test's error named)."""
    from mlfabric.ps import policy

    monkeypatch.setattr(policy, "_REGISTRY", dict(policy._REGISTRY))
    monkeypatch.setattr(policy, "_plugins_loaded", set(policy._plugins_loaded))
