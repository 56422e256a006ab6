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

A worker whose process was killed can be started again with ``MLFABRIC_INCARNATION=k`` (its
k-th restart; the same RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as before; or
``init(incarnation=k)``): :func:`init` then connects it to the running job's servers
(:meth:`mlfabric.transport.tcp.TcpTransport.rejoin`, the tcp transport only), the servers take
it back (:meth:`PSWorker.rejoin`) and the same code as at the start goes on (``init_model``
checks the layout, ``pull`` gets the current model). ``tests/local/test_ps_rejoin_processes.py``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from mlfabric.runtime.communicator import Communicator

from .config import PSConfig
from .consistency import Consistency
from .layout import PSLayout
from .policy import make_policy
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


#: A restarted worker's incarnation (1 for its first restart): :func:`init` rejoins the job.
INCARNATION_ENV = "MLFABRIC_INCARNATION"


def incarnation_from_env() -> int:
    text = os.environ.get(INCARNATION_ENV, "").strip() or "0"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{INCARNATION_ENV}={text!r}: expected an integer >= 0 "
                         "(1 for a worker's first restart)") from None
    if value < 0:
        raise ValueError(f"{INCARNATION_ENV}={value}: expected an integer >= 0")
    return value


def init(*, servers: int | None = None, replicas: int | None = None, consistency: str | Consistency = "bsp",
         transport: str = "tcp", timeout: float = 60.0, lost_worker_wait_s: float | None = None,
         routing: str = "direct", seed: int = 0, pace_ordered_pulls: bool = False, incarnation: int | None = None,
         mlnet: Any = None, **init_options: Any) -> PSJob:
    """Join the job (:func:`mlfabric.init`'s rendezvous and ``init_options``) and take this
    rank's role. ``servers``/``replicas`` default to ``MLFABRIC_PS_SERVERS`` (1) and
    ``MLFABRIC_PS_REPLICAS`` (0); the other ranks are workers. ``timeout`` bounds every wait;
    ``lost_worker_wait_s`` (default: a sixth of it) is how long BSP waits for a lost worker;
    ``pace_ordered_pulls``, ``mlnet`` (the trees of ``routing="mlnet"``): :class:`PSConfig`'s. ``incarnation`` (default
    ``MLFABRIC_INCARNATION``, else 0): >= 1 for a restarted worker, which rejoins the running
    job (module docstring)."""
    import mlfabric

    incarnation = incarnation_from_env() if incarnation is None else incarnation
    if incarnation:
        return _rejoin(incarnation, servers=servers, replicas=replicas, consistency=consistency, transport=transport,
                       timeout=timeout, lost_worker_wait_s=lost_worker_wait_s, routing=routing, seed=seed,
                       pace_ordered_pulls=pace_ordered_pulls, mlnet=mlnet, **init_options)
    comm = mlfabric.init(transport=transport, timeout=timeout, **init_options)
    try:
        layout = PSLayout.for_world(comm.world_size, servers, replicas)
        config = PSConfig(consistency=consistency, timeout_s=timeout, routing=routing, seed=seed,
                          lost_worker_wait_s=lost_worker_wait_s, pace_ordered_pulls=pace_ordered_pulls, mlnet=mlnet)
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


def _rejoin(incarnation: int, *, servers: int | None, replicas: int | None, consistency: str | Consistency,
            transport: str, timeout: float, lost_worker_wait_s: float | None, routing: str, seed: int,
            pace_ordered_pulls: bool, mlnet: Any = None, **init_options: Any) -> PSJob:
    """A restarted worker back in its running job: the job's store (served by rank 0, a
    server), a tcp transport connected to the servers as ``incarnation``, and the servers'
    consent (:meth:`PSWorker.rejoin`). Its communicator reaches the servers (and, where the
    policy asks, the other workers still alive): no collective over every rank."""
    from mlfabric.runtime.rendezvous import connect_store, job_info
    from mlfabric.transport.sockets import local_address_towards
    from mlfabric.transport.tcp import TcpTransport

    if transport != "tcp":
        raise ValueError(f"a restarted worker ({INCARNATION_ENV}={incarnation}) rejoins over the tcp transport only, "
                         f"not {transport!r}")
    if init_options:
        raise ValueError(f"a restarted worker takes none of {sorted(init_options)}: it joins the job's servers as "
                         "they are")
    job = job_info()
    layout = PSLayout.for_world(job.world_size, servers, replicas)
    if layout.role(job.rank) != "worker":
        raise ValueError(f"{INCARNATION_ENV}={incarnation} on {layout.describe(job.rank)}: only workers rejoin "
                         "(a lost server is replaced by its replica)")
    config = PSConfig(consistency=consistency, timeout_s=timeout, routing=routing, seed=seed,
                      lost_worker_wait_s=lost_worker_wait_s, pace_ordered_pulls=pace_ordered_pulls, mlnet=mlnet)
    store = connect_store(job, timeout)
    # mlnet's node talks to the other workers (its tree neighbours) too; the dead ones count as lost
    others = [r for r in layout.worker_ranks if r != job.rank] if make_policy(config).rejoin_reaches_workers else []
    tr = TcpTransport.rejoin(store, job.rank, job.world_size, incarnation, layout.server_ranks,
                             bind_addrs={"0": local_address_towards(job.master_addr)}, timeout=timeout, reach=others)
    try:
        comm = Communicator(tr, timeout=timeout)
        comm.store = store
        ps_job = PSJob(comm, layout, config)
        assert ps_job.worker is not None
        ps_job.worker.rejoin(incarnation)
    except BaseException:
        tr.close()
        raise
    return ps_job
