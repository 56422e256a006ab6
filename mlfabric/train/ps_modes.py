"""The parameter-server modes of ``mlfabric train``: names, consistency, and a server's part of a run.

    mlfabric train --workload hyperplane --workers 4 --servers 1 \\
        --sync allreduce,ps-bsp,ps-ssp:2,ps-async --delay-bound 8 --epochs 8

Modes: ``ps-bsp`` (bulk synchronous: synchronous SGD through the servers), ``ps-ssp:S``
(MLNET's stale synchronous parallel with staleness S), ``ps-async`` (every update applied on
arrival; ``--delay-bound TAU`` drops updates whose delay would exceed TAU, MLfabric §3.1;
MLfabric's "vanilla Async"), ``mlfabric-a:TAU`` (MLfabric-A: asynchronous with delay bound
TAU, every update scheduled by MLfabric's scheduler: ordering, drops, aggregation,
:mod:`mlfabric.ps.policies.scheduled`), ``mlfabric-s`` (MLfabric-S, §6: BSP rounds whose updates the
scheduler orders and aggregates for the round's makespan), ``mlnet-binary``, ``mlnet-rack`` and
``mlnet-tree:D`` (MLNET's aggregation/multicast trees, :mod:`mlfabric.ps.policies.mlnet`: BSP, or SSP
inside the tree with ``+ssp:S``, e.g. ``mlnet-rack+ssp:2``; rack trees take the racks of the
launch's topology).
A user-written routing policy (``mlfabric.ps.register_policy``, docs/parameter_server.md
"Writing a policy") runs as ``ps-bsp@NAME`` (any ``ps-*`` mode, ``@`` and the policy's
name), with its module listed in ``MLFABRIC_PS_PLUGINS`` so that every rank registers it:
``MLFABRIC_PS_PLUGINS=examples/ps_policy_drop.py mlfabric train --sync ps-bsp,ps-bsp@drop-alternate``.
Replicas (``--replicas R``): chain replication (the server forwards each update it applies),
or under MLfabric-A ``--replication network --div-max X`` (§5.3: the workers send copies of
their updates, scheduled so that the replica stays within Div_max X, a norm or ``Nu``
updates); under MLfabric-A the replica measures its true divergence and the eq. (11) estimate
at every batch end (``max_divergence``, ``max_divergence_estimate`` in runs[]).
Workers train with :class:`mlfabric.torch.PSOptimizer`; servers (``--servers``, ranks
``0..S-1`` of the launch) serve one PS session per run (:meth:`mlfabric.ps.PSJob.session`).

Exercise it with ``python -m pytest tests/local/test_ps_train.py -q``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any

from mlfabric.ps.consistency import Consistency

if TYPE_CHECKING:
    import torch

    from mlfabric.ps import PSJob

PREFIX = "ps-"
MLFABRIC_A = "mlfabric-a:"
MLFABRIC_S = "mlfabric-s"
MLNET = "mlnet-"
POLICY_SEP = "@"  # ps-bsp@NAME: the ps-bsp mode routed by the registered policy NAME
PS_MODE_FORMS = ("ps-bsp", "ps-ssp:S", "ps-async", "mlfabric-a:TAU", MLFABRIC_S, "mlnet-binary[+ssp:S]",
                 "mlnet-rack[+ssp:S]", "mlnet-tree:D[+ssp:S]", "ps-*@POLICY")


def is_ps_mode(mode: str) -> bool:
    """Whether ``mode`` runs on the parameter server (in the launch with server ranks)."""
    return mode.startswith(PREFIX) or mode.startswith(MLFABRIC_A) or mode == MLFABRIC_S or mode.startswith(MLNET)


def mlnet_options(mode: str) -> dict[str, Any]:
    """``mlnet-rack+ssp:2`` -> consistency ssp:2, routing mlnet over rack trees."""
    from mlfabric.ps.policies.mlnet import MLNetSettings

    tree, plus, consistency = mode.removeprefix(MLNET).partition("+")
    try:
        settings = MLNetSettings(tree=tree)
        parsed = Consistency.parse(consistency) if plus else Consistency(kind="bsp")
        if parsed.kind != "ssp" and plus:
            raise ValueError(f"the staleness suffix is +ssp:S, got +{consistency}")
    except ValueError as exc:
        raise ValueError(f"sync mode {mode!r}: {exc}; the PS modes are {', '.join(PS_MODE_FORMS)}") from None
    return {"consistency": parsed, "routing": "mlnet", "mlnet": settings}


def session_options(mode: str, delay_bound: int | None = None, nic_rate_bps: float | None = None, *,
                    replicas: int = 0, replication: str = "chain", div_max: str | None = None,
                    measure_divergence: bool = True, workers_per_host: int = 1,
                    trees: bool = False) -> dict[str, Any]:
    """The :meth:`mlfabric.ps.PSJob.session` options of a PS mode: its consistency and, for
    MLfabric-A, the scheduled routing policy (planning with the NIC rate when known; with
    ``replicas``, replicating as ``replication`` says within ``div_max`` and measuring the
    replicas' divergence at batch ends). MLfabric-A and -S (#36): ``workers_per_host``
    co-located workers summed on their host, ``trees`` for pipelined aggregation trees and
    multicast model distribution."""
    issue36 = {"workers_per_host": workers_per_host, "trees": trees}
    if mode.startswith(MLNET):
        return mlnet_options(mode)
    if mode.startswith(PREFIX) and POLICY_SEP in mode:
        base, _, policy = mode.partition(POLICY_SEP)
        if not policy:
            raise ValueError(f"sync mode {mode!r}: name the policy after '@' (ps-bsp@NAME)")
        return {"consistency": ps_consistency(base, delay_bound), "routing": policy}
    if mode == MLFABRIC_S:
        from mlfabric.ps.policies.scheduled.settings import DEFAULT_RATE_BPS, ScheduledSettings

        return {"consistency": Consistency(kind="bsp"), "routing": "scheduled",
                "scheduled": ScheduledSettings(rate_bps=nic_rate_bps or DEFAULT_RATE_BPS, **issue36)}
    if mode.startswith(MLFABRIC_A):
        from mlfabric.ps.policies.scheduled.settings import DEFAULT_RATE_BPS, ScheduledSettings

        tau = mode.removeprefix(MLFABRIC_A)
        try:
            bound = int(tau)
        except ValueError:
            raise ValueError(f"sync mode {mode!r}: the delay bound must be an integer (mlfabric-a:8)") from None
        from mlfabric.ps.divergence import DivergenceBound

        replicating = {"replication": replication, "measure_divergence": measure_divergence,
                       "divergence": DivergenceBound.parse(div_max) if div_max else None} if replicas else {}
        return {"consistency": Consistency(kind="async", delay_bound=bound), "routing": "scheduled",
                "scheduled": ScheduledSettings(rate_bps=nic_rate_bps or DEFAULT_RATE_BPS, **replicating, **issue36)}
    return {"consistency": ps_consistency(mode, delay_bound)}


def _scheduled_figures(server_stats: list[dict[str, Any]], daemons: list[dict[str, Any]]) -> dict[str, Any]:
    if not daemons:
        return {}
    requested = sum(d["requested"] for d in daemons)
    decided = requested - sum(d["fallbacks"] for d in daemons)
    sent = decided - sum(d["dropped_by_scheduler"] for d in daemons)

    def mean_ms(key: str, n: int) -> float | None:
        return 1e3 * sum(d.get(key, 0.0) for d in daemons) / n if n else None

    held = [s["scheduler"]["request_to_decision_ms"] for s in server_stats
            if (s.get("scheduler") or {}).get("request_to_decision_ms") is not None]
    return {"skipped": sum(s.get("skipped", 0) for s in server_stats),
            "dropped_by_scheduler": sum(d["dropped_by_scheduler"] for d in daemons),
            "fallbacks": sum(d["fallbacks"] for d in daemons),
            "decision_wait_ms": mean_ms("decision_wait_s", requested),
            # the part of decision_wait_ms the scheduler held the request (batching, planning):
            # the rest is the control round trip (simulate mlfabric --emulated reads it)
            "request_to_decision_ms": held[0] if held else None,
            "start_wait_ms": mean_ms("start_wait_s", sent), "send_ms": mean_ms("send_s", sent)}


def ps_consistency(mode: str, delay_bound: int | None = None) -> Consistency:
    """``ps-bsp`` -> bsp, ``ps-ssp:2`` -> ssp:2, ``ps-async`` -> async (with ``delay_bound``),
    ``mlfabric-a:8`` -> async:8."""
    if mode.startswith(MLFABRIC_A) or mode == MLFABRIC_S or mode.startswith(MLNET):
        return session_options(mode)["consistency"]
    if not is_ps_mode(mode):
        raise ValueError(f"{mode!r} is not a parameter-server mode ({', '.join(PS_MODE_FORMS)})")
    mode, _, policy = mode.partition(POLICY_SEP)  # ps-bsp@NAME: the consistency is ps-bsp's
    if policy:
        from mlfabric.ps.policy import policy_factory

        policy_factory(policy)  # raises naming the registered policies
    try:
        consistency = Consistency.parse(mode.removeprefix(PREFIX))
    except ValueError as exc:
        raise ValueError(f"sync mode {mode!r}: {exc}; the PS modes are {', '.join(PS_MODE_FORMS)}") from None
    if consistency.kind == "async":
        if consistency.delay_bound is not None:
            raise ValueError(f"sync mode {mode!r}: give the delay bound with --delay-bound, not in the mode")
        return Consistency(kind="async", delay_bound=delay_bound)
    return consistency


def serve_run(session: "PSJob", numel: int, dtype: "torch.dtype", *,
              kill: "tuple[float, str] | None" = None) -> tuple[dict[str, Any], "torch.Tensor"]:
    """A server's (or replica's) part of one run: serve until the workers leave, while taking
    part in the barrier that starts the workers' clocks (the workers register their model
    before it, so the server must already answer); returns the statistics and this server's
    shard of the final model placed in a zero flat vector (the ranks sum these to get the
    whole model). ``kill`` ``(at_s, fault_dir)``: this server's process crashes ``at_s`` after
    the barrier (:mod:`mlfabric.train.failover`). A replica that took over returns the
    statistics of the server it became, its own under ``took_over`` and its model at the
    takeover under ``takeover_models``."""
    import threading

    import torch

    final = torch.zeros(numel, dtype=dtype)
    outcome: dict[str, Any] = {}

    def serve() -> None:
        try:
            outcome["stats"] = session.serve()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the rank's main thread
            outcome["error"] = exc

    thread = threading.Thread(target=serve, name=f"mlfabric-ps-serve-{session.rank}", daemon=True)
    thread.start()
    session.comm.barrier()
    if kill is not None and session.server is not None:
        from .failover import kill_on_turn

        session.server.on_turn = kill_on_turn(session.server, *kill)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    replica = session.replica
    server = session.server or (replica.promoted if replica is not None else None)
    if server is None:  # a replica: what it measured (it serves no shard of the final model)
        return ({"replica": replica.stats.as_dict()} if replica is not None else {}), final
    stats = server.stats.as_dict()
    if replica is not None:  # it took over its lost server
        stats.update(took_over=replica.stats.as_dict(), takeover_models=replica.takeover_values)
    shard = server.shards.get("model")
    if shard is not None:
        final[shard.offset:shard.offset + shard.length] = shard.values
    return stats, final


def summarize(server_stats: list[dict[str, Any]], worker_stats: list[dict[str, Any]], *, run_s: float | None = None,
              nic_rate_bps: float | None = None) -> dict[str, Any]:
    """The run's PS figures (``runs[]`` fields of train's JSON) from every server's and
    replica's statistics (serve_run's) and every worker's. ``run_s`` and ``nic_rate_bps`` (the
    run's time and the NICs' rate, when known) give each server NIC's busy share."""
    replica_stats = [s["replica"] if "replica" in s else s["took_over"] for s in server_stats
                     if "replica" in s or "took_over" in s]
    server_stats = [s for s in server_stats if "replica" not in s]
    delays: Counter = Counter()
    for s in server_stats:
        delays.update({int(k): v for k, v in s["delays"].items()})
    applied_worker = sum(delays.values())
    latencies = [w["pull_latency_ms_mean"] for w in worker_stats if w.get("pull_latency_ms_mean") is not None]
    lag: Counter = Counter()
    for s in server_stats:
        lag.update({int(k): v for k, v in s["clock_lag"].items()})
    return {
        "max_delay": max(delays) if delays else None,
        "mean_delay": sum(k * v for k, v in delays.items()) / applied_worker if applied_worker else None,
        # every worker update not applied: over the bound at a server, dropped by the
        # scheduler (MLfabric-A's Alg. 2), or planned but not in at its server in time (skipped)
        "dropped": sum(s["dropped"] + s.get("skipped", 0) + s.get("scheduler", {}).get("dropped_by_scheduler", 0)
                       for s in server_stats),
        "updates_applied": sum(s["updates_applied"] for s in server_stats),
        "worker_updates_applied": applied_worker,
        "delay_histogram": {str(k): delays[k] for k in sorted(delays)},
        "clock_lag_histogram": {str(k): lag[k] for k in sorted(lag)},
        "pull_latency_ms": statistics.fmean(latencies) if latencies else None,
        "server_bytes_in": [s["bytes_in"] for s in server_stats],
        "server_bytes_out": [s["bytes_out"] for s in server_stats],
        # bytes into the replicas (models, updates, notes; not the probes that measure them), and
        # through each server's NIC (in + out, probes excluded): replication's cost
        "replica_bytes": (sum(r["bytes_in"] for r in replica_stats) if replica_stats
                          else sum(s.get("replica_bytes", 0) for s in server_stats)),
        "server_nic_bytes": [s["bytes_in"] + s["bytes_out"] - s.get("probe_bytes", 0) for s in server_stats],
        # #36: worker updates per update transfer the servers applied (a host sum or an
        # aggregate carries several), and each server NIC's busy share: its busier direction's
        # bytes over the run time at the NIC's rate (None when the rate is not known)
        "updates_per_server_transfer": (applied_worker / sum(s["updates_applied"] for s in server_stats)
                                        if sum(s["updates_applied"] for s in server_stats) else None),
        "server_nic_busy": ([8 * max(s["bytes_in"], s["bytes_out"]) / (run_s * nic_rate_bps) for s in server_stats]
                            if run_s and nic_rate_bps else None),
        "max_divergence": max((r["max_divergence"] for r in replica_stats if r["max_divergence"] is not None),
                              default=None),
        "max_divergence_estimate": max((r["max_divergence_estimate"] for r in replica_stats
                                        if r["max_divergence_estimate"] is not None), default=None),
        "divergence_probes": sum(r["probes"] for r in replica_stats),
        "replica_waits": sum(s.get("replica_waits", 0) for s in server_stats),
        "bound_overruns": sum(s.get("bound_overruns", 0) for s in server_stats),
        "checkpoints": sum(s.get("checkpoints", 0) for s in server_stats),
        "checkpoint_s": sum(s.get("checkpoint_s", 0.0) for s in server_stats),
        # MLfabric (scheduled policy): pull answers relayed by distributors, worker updates
        # the scheduler sent through aggregators, and its batches.
        "pulls_relayed": sum(s.get("pulls_relayed", 0) for s in server_stats),
        "pull_batches": sum(s.get("pull_batches", 0) for s in server_stats),
        "aggregated": sum(s.get("scheduler", {}).get("aggregated", 0) for s in server_stats),
        "scheduler_batches": sum(s.get("scheduler", {}).get("batches", 0) for s in server_stats),
        # ... and where their updates went and a push's time went (what the simulator's
        # batch_wait_s / commit_wait_s / model_wait_s are compared with): planned entries not in
        # at the server in time (skipped), updates the scheduler dropped, pushes without a
        # decision in time (fallbacks), and per scheduled push the mean wait for the decision,
        # for the planned start, and to hand the update over (ms)
        **_scheduled_figures(server_stats, [w["scheduled"] for w in worker_stats if w.get("scheduled")]),
        "lost_workers": sorted({w for s in server_stats for w in s["lost_workers"]}),
        # per worker: the times it redirected to a replica that took over a lost server
        "worker_failovers": [w.get("failovers", 0) for w in worker_stats],
        # mlnet (ps/policies/mlnet.py): the largest c_worker - c_model any pull returned, the sums the
        # tree nodes sent up, pulls answered from a node's copy, children lost by their node.
        **_mlnet_figures([w["mlnet"] for w in worker_stats if w.get("mlnet")]),
        "missing_rounds": server_stats[0]["missing_rounds"] if server_stats else [],
    }


def _mlnet_figures(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    if not nodes:
        return {}
    lags = [n["max_staleness"] for n in nodes if n["max_staleness"] is not None]
    return {"max_staleness": max(lags) if lags else None,
            "tree_sums": sum(n["sums_forwarded"] for n in nodes),
            "pulls_from_cache": sum(n["pulls_from_cache"] for n in nodes),
            "pulls_upstream": sum(n["pulls_upstream"] for n in nodes),
            "lost_children": sorted({c for n in nodes for c in n["lost_children"]}),
            # MLNET §3's failure handling: re-attachments after a lost parent, orphans adopted,
            # nodes that fell back to direct push/pull, clocks sent again to a new parent
            "repairs": sum(n.get("repairs", 0) for n in nodes),
            "adopted": sum(n.get("adopted", 0) for n in nodes),
            "fallbacks": sum(n.get("fallbacks", 0) for n in nodes),
            "resent_clocks": sum(n.get("resent_clocks", 0) for n in nodes)}
