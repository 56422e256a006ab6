"""When a replica can take over a lost server, and which one: the rule workers and replicas share.

    .venv/bin/python -m pytest tests/unit/test_ps_failover.py -q

A worker (:meth:`mlfabric.ps.PSWorker.fail_over`) and a replica (:meth:`mlfabric.ps.Replica.serve`)
both ask :func:`failover_refusal` before a takeover: the consistency model must let the clocks
be rebuilt, and the routing policy must allow it (:meth:`mlfabric.ps.policy.Policy.failover_refusal`).
"""

from __future__ import annotations

from mlfabric.transport.base import Transport

from .config import PSConfig
from .layout import PSLayout
from .policy import make_policy

#: Consistency models a replica takes over under: their clocks can be rebuilt from the
#: workers' own (a BSP round in flight at the lost server cannot).
FAILOVER_KINDS = ("async", "ssp")

#: How long a replica whose server was lost waits for the payloads of units the server had
#: applied (network replication: they come from the workers -- on their way, or asked for
#: again) before it takes over without them.
PROMOTION_GRACE_S = 0.5


def failover_refusal(config: PSConfig, layout: PSLayout) -> str | None:
    """Why a replica of this job cannot take over a lost server (None: it can)."""
    if config.consistency.kind not in FAILOVER_KINDS:
        return (f"consistency {config.consistency}: a round in flight at the lost server cannot be rebuilt from "
                "the replica (failover works under async and SSP)")
    return make_policy(config).failover_refusal(config, layout)


def live_replicas(layout: PSLayout, transport: Transport, server: int) -> list[int]:
    """The replicas of shard ``server`` still in the job, in layout order: the first takes over
    a lost server, the others follow it."""
    gone = transport.gone_peers
    return [r for r in layout.replicas_of(server) if r not in gone]
