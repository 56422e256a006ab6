"""MLfabric's update scheduler, the pure core (no networking, no I/O): network model,
ordering (Alg. 1/2), aggregation (Alg. 3, §10.3 distribution), the facade, a plain
reference, an exhaustive solver for small batches and the benchmark.

    .venv/bin/python -m pytest tests/unit/test_ps_scheduler*.py -q
    mlfabric bench scheduler --updates 100,500,1000 --json out.json

See docs/mlfabric_scheduler.md for what the paper leaves open and what was decided.
"""

from mlfabric.ps.scheduler.aggregation import (AggregationResult, DistributionResult, GroupPlan, PullBatchPlan, aggregate,
                                               distribute, objectives, plan_pull_batch)
from mlfabric.ps.scheduler.netstate import INF, NetState, Transfer, down_link, up_link
from mlfabric.ps.scheduler.ordering import Batch, OrderDecision, OrderResult, order_updates
from mlfabric.ps.scheduler.scheduler import (BatchSchedule, Decision, Plan, Scheduler, SchedulerConfig, UpdateRequest,
                                             plan_batch)

__all__ = [
    "INF", "AggregationResult", "Batch", "BatchSchedule", "Decision", "DistributionResult", "GroupPlan", "NetState",
    "OrderDecision", "OrderResult", "Plan", "PullBatchPlan", "Scheduler", "SchedulerConfig", "Transfer",
    "UpdateRequest", "aggregate", "distribute", "down_link", "objectives", "order_updates", "plan_batch",
    "plan_pull_batch", "up_link",
]
