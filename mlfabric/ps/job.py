"""Join a parameter-server job: one call on every rank, which learns its role from the layout.

    import mlfabric.ps
    job = mlfabric.ps.init(consistency="ssp:2")      # torchrun variables + MLFABRIC_PS_SERVERS
    if job.role == "worker":
        w = job.worker
        w.init_model("mlp", model, lr=0.05)
        for batch in data:
            params = w.pull("mlp"); ...; w.push("mlp", grads); w.clock()
    else:
        job.serve()                                    # servers and replicas, until the workers leave
    job.close()

Exercise it with ``python -m pytest tests/unit/test_ps.py tests/local/test_ps_processes.py``.

:func:`init` runs :func:`mlfabric.init` (rendezvous, the transport: plain TCP by default) and
builds this rank's role object on its transport; the :class:`~mlfabric.Communicator` stays
available as ``job.comm`` for collectives over all ranks (evaluation, barriers).
:meth:`PSJob.session` opens a further, independent PS instance on the same ranks (one per
training run: each has its own models, clocks and statistics). :func:`local_jobs` gives the
same on threads (the in-process transport), for tests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlfabric.runtime.communicator import Communicator

from .config import PSConfig
from .consistency import Consistency
from .layout import PSLayout
from .replica import Replica
from .server import ParameterServer, ServerStats
from .worker import PSWorker


class PSJob:
    """This rank's role in a PS job: ``worker``, ``server`` or ``replica`` is set, the others are None."""

    def __init__(self, comm: Communicator, layout: PSLayout, config: PSConfig) -> None:
        self.comm = comm
        self.layout = layout
        self.config = config
        self.role = layout.role(comm.rank)
        self.worker: PSWorker | None = None
        self.server: ParameterServer | None = None
        self.replica: Replica | None = None
        transport = comm.transport
        if self.role == "worker":
            self.worker = PSWorker(transport, layout, config)
        elif self.role == "server":
            self.server = ParameterServer(transport, layout, config)
        else:
            self.replica = Replica(transport, layout, config)

    @property
    def rank(self) -> int:
        return self.comm.rank

    def serve(self) -> ServerStats | dict[str, int]:
        """Servers and replicas: serve until every worker has left; returns the server's
        statistics (or the replica's model versions)."""
        if self.server is not None:
            return self.server.serve()
        if self.replica is not None:
            return self.replica.serve()
        raise RuntimeError(f"{self.layout.describe(self.rank)} is a worker: only servers and replicas serve")

    def session(self, index: int, **changes: Any) -> "PSJob":
        """Another PS instance on the same ranks (``index`` >= 1, distinct per instance, the
        same on every rank), with ``changes`` to the configuration (e.g. ``consistency``)."""
        if index < 1:
            raise ValueError("session 0 is the job's first instance; further ones count from 1")
        if "consistency" in changes and isinstance(changes["consistency"], str):
            changes["consistency"] = Consistency.parse(changes["consistency"])
        return PSJob(self.comm, self.layout, replace(self.config, session=index, **changes))

    def leave(self) -> None:
        """Workers: tell the servers this worker is done (the communicator stays open)."""
        if self.worker is not None:
            self.worker.leave()

    def close(self) -> None:
        self.leave()
        self.comm.close()

    def __enter__(self) -> "PSJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(*, servers: int | None = None, replicas: int | None = None, consistency: str | Consistency = "bsp",
         transport: str = "tcp", timeout: float = 60.0, lost_worker_wait_s: float | None = None,
         routing: str = "direct", seed: int = 0, pace_ordered_pulls: bool = False, **init_options: Any) -> PSJob:
    """Join the job (:func:`mlfabric.init`'s rendezvous and ``init_options``) and take this
    rank's role. ``servers``/``replicas`` default to ``MLFABRIC_PS_SERVERS`` (1) and
    ``MLFABRIC_PS_REPLICAS`` (0); the other ranks are workers. ``timeout`` bounds every wait;
    ``lost_worker_wait_s`` (default: a sixth of it) is how long BSP waits for a lost worker;
    ``pace_ordered_pulls``: :class:`PSConfig`'s."""
    import mlfabric

    comm = mlfabric.init(transport=transport, timeout=timeout, **init_options)
    try:
        layout = PSLayout.for_world(comm.world_size, servers, replicas)
        config = PSConfig(consistency=consistency, timeout_s=timeout, routing=routing, seed=seed,
                          lost_worker_wait_s=lost_worker_wait_s, pace_ordered_pulls=pace_ordered_pulls)
    except ValueError:
        comm.close()
        raise
    return PSJob(comm, layout, config)


def local_jobs(layout: PSLayout, config: PSConfig | None = None) -> list[PSJob]:
    """Every rank of ``layout`` as threads of this process (the in-process transport)."""
    import mlfabric

    config = config or PSConfig()
    comms = mlfabric.local_world(layout.world_size, timeout=config.timeout_s)
    return [PSJob(comm, layout, config) for comm in comms]
