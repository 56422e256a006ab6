"""The parameter server: roles, consistency models, routing policies (and MLfabric's scheduler).

    import mlfabric.ps
    job = mlfabric.ps.init(consistency="ssp:2")   # under torchrun / mlfabric launch

See docs/parameter_server.md. Exercise it with
``python -m pytest tests/unit/test_ps.py tests/local/test_ps_processes.py``.
"""

from .config import PSConfig
from .consistency import ClockBook, Consistency
from .job import PSJob, init, local_jobs
from .layout import PSLayout
from .model import ModelSpec
from .replica import Replica
from .policy import Policy, ReplicationFeed, ServerPort, WorkerPort, make_policy, policy_names, register_policy
from .rules import SGDMomentum, UpdateInfo
from .server import ParameterServer, ServerStats
from .worker import PSRequestError, PSWorker, WorkerStats

__all__ = [
    "ClockBook", "Consistency", "ModelSpec", "PSConfig", "PSJob", "PSLayout", "PSRequestError",
    "PSWorker", "ParameterServer", "Policy", "Replica", "ReplicationFeed", "SGDMomentum", "ServerPort", "ServerStats",
    "UpdateInfo", "WorkerPort", "WorkerStats", "init", "local_jobs", "make_policy", "policy_names", "register_policy",
]
