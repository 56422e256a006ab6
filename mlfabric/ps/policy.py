"""The parameter server's one seam: what a policy is, the ports it reaches the runtime through, the registry.

    .venv/bin/python -m pytest tests/unit/test_ps_policy.py -q

The runtime (:mod:`~mlfabric.ps.server`, :mod:`~mlfabric.ps.worker`, :mod:`~mlfabric.ps.replica`)
moves tensors, keeps versions and consistency, and names no policy. A *policy* decides how
traffic travels and when it counts; it is an object with the methods of :class:`Policy`
(whose defaults are the ``direct`` behaviour, so a policy overrides only what it changes):

* **worker side** -- how a push (:meth:`Policy.send_push`), a pull (:meth:`Policy.send_pull`)
  and a clock (:meth:`Policy.send_clock`) leave the worker; what follows a failover
  (:meth:`Policy.after_failover`) and a leave (:meth:`Policy.flush`);
* **server side** -- which messages it claims (:meth:`Policy.claim_push`,
  :meth:`Policy.claim_message`, :meth:`Policy.claims_pull`): a push it claims is held (applied
  later through the port's ``apply``), dropped, or staged; when held pulls are answered
  (:meth:`Policy.ready_to_answer`, :meth:`Policy.answer_at`: "wake me at t", the
  :meth:`Policy.held_ranks` whose updates are still due) and how (:meth:`Policy.answer_pulls`);
  what it does at every turn (:meth:`Policy.step`) and with the rounds (:meth:`Policy.round_limit`);
* **configuration** -- which consistency models it runs under (:meth:`Policy.validate`), and
  whether a replica can take over under it (:meth:`Policy.failover_refusal`).

What follows an applied update is the server's :class:`ReplicationFeed` (chain, or MLfabric's
network replication: :mod:`mlfabric.ps.policies.replication`), picked by the policy
(:meth:`Policy.replication_feed`).

A policy reaches the runtime only through the port it is handed: :class:`WorkerPort` (the
worker: its transport, layout, the rank serving each shard, ``fail_over``, ``lost_error``,
``track``) and :class:`ServerPort` (the server: shards, stats, clock book, ``apply``, ``track``,
``feed``). The ports are structural types: the runtime's objects satisfy them; nothing behind
them is private API.

**Registry.** ``mlfabric.ps.register_policy(name, factory)`` makes ``PSConfig(routing=name)``
build ``factory(config)`` on every rank. The built-in policies (``direct``, ``scheduled``,
``mlnet``) register themselves when first asked for; a user's module registers its own, and is
imported in every process of a launch when named in ``MLFABRIC_PS_PLUGINS`` (comma-separated
module names or ``.py`` paths; ``mlfabric train --sync ps-async@NAME`` then runs it, see
``examples/ps_policy_drop_stale.py`` and docs/parameter_server.md, "Writing a policy"). This
module is the only place a policy's name is compared.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from mlfabric.transport.base import SendHandle, Transport, tensor_bytes

from . import protocol

if TYPE_CHECKING:
    from mlfabric.errors import PeerLostError

    from .config import PSConfig
    from .consistency import ClockBook
    from .layout import PSLayout
    from .model import ModelSpec
    from .shard import PendingPull, Shard

#: Environment variable naming modules (or ``.py`` files) that register policies; every
#: process of a launch imports them on the first lookup of a name not registered yet.
PLUGINS_ENV = "MLFABRIC_PS_PLUGINS"


# --------------------------------------------------------------------------- the ports


class WorkerPort(Protocol):
    """What a policy may use of the worker it routes for (:class:`mlfabric.ps.PSWorker`)."""

    transport: Transport
    layout: "PSLayout"
    config: "PSConfig"
    channel: str
    who: str
    index: int
    clock_value: int
    serving: list[int]
    models: "dict[str, ModelSpec]"

    def server_rank(self, server: int) -> int: ...

    def fail_over(self, peer: int) -> bool: ...

    def lost_error(self, peer: int, what: str) -> "PeerLostError": ...

    def track(self, handle: SendHandle, source: Any) -> None: ...


class ServerPort(Protocol):
    """What a policy may use of the server it runs in (:class:`mlfabric.ps.ParameterServer`)."""

    transport: Transport
    layout: "PSLayout"
    config: "PSConfig"
    channel: str
    who: str
    server: int
    stats: Any
    book: "ClockBook"
    shards: "dict[str, Shard]"
    feed: "ReplicationFeed"
    routing: "Policy"
    replicas: list[int]
    nic_rate_bps: float | None

    def shard(self, model: str, what: str) -> "Shard": ...

    def apply(self, shard: "Shard", gradient: torch.Tensor, workers: tuple[int, ...], computed_from: tuple[int, ...],
              *, weight: float, unit: int | None = None, members: list[list[int]] | None = None,
              norm: float | None = None) -> None: ...

    def receive_push(self, worker: int, header: dict[str, Any], payload: memoryview) -> None: ...

    def send_replica(self, replica: int, header: bytes, values: torch.Tensor | bytes) -> None: ...

    def track(self, handle: SendHandle, source: Any) -> None: ...

    def wake(self) -> None: ...


# --------------------------------------------------------------------------- the policy


class Policy:
    """The declared seam (module docstring); the defaults are the ``direct`` policy (BASELINE
    in MLNET, vanilla Async in MLfabric): every worker sends each server its component of an
    update in one message, and each server answers each pull itself."""

    name = "direct"
    #: Whether a server counts an update only with its sender's clock and then tells its
    #: replicas that clock (mlnet's tree sums): replicas hold updates until the clock note
    #: and keep the workers' clocks, which a replica that takes over needs.
    commits_on_clock = False
    #: Whether pushes need the update's norm (MLfabric's scheduler plans on it; computing it
    #: costs a float64 pass over the gradient, so the worker skips it when no policy reads it).
    needs_push_norm = False
    #: Whether a restarted worker may rejoin (``ParameterServer._rejoin``): only where the
    #: policy holds no per-worker state that a new process would have to be taken back into
    #: (trees, schedules). The direct policy sets it; others refuse the rejoin, naming them.
    takes_back_workers = False
    #: Whether a restarted worker's transport dials the other workers too, not only the
    #: servers (mlnet: its node talks to tree neighbours; one that cannot be reached counts as lost).
    rejoin_reaches_workers = False

    # -- configuration -----------------------------------------------------------------------

    def validate(self, config: "PSConfig") -> None:
        """Raise ValueError when ``config`` (its consistency) is one this policy cannot run."""

    def failover_refusal(self, config: "PSConfig", layout: "PSLayout") -> str | None:
        """Why a replica cannot take over a lost server under this policy (None: it can)."""
        return None

    def replication_feed(self, config: "PSConfig") -> "ReplicationFeed":
        """What follows an applied update on a server with replicas (chain replication)."""
        from .policies.replication import ChainFeed

        return ChainFeed()

    # -- worker side ---------------------------------------------------------------------------

    def send_push(self, worker: WorkerPort, model: str, components: list[torch.Tensor],
                  pushes: "list[protocol.Push]") -> list[SendHandle] | None:
        """Send component ``j`` of an update (with header ``pushes[j]``, encoded once here)
        toward server ``j``; None if the policy dropped the update instead (MLfabric's
        scheduler, Alg. 2)."""
        tag = protocol.request_tag(worker.config.session)
        handles = []
        for j, (component, push) in enumerate(zip(components, pushes)):  # a loop, not a comprehension: one frame less
            handles.append(worker.transport.send(worker.server_rank(j), tag, tensor_bytes(component),
                                                 meta=push.encode(), channel=worker.channel))
        return handles

    def send_pull(self, worker: WorkerPort, pulls: "list[protocol.Pull]", *, clocks: list[bytes] | None = None) -> None:
        """Ask every server for its shard (``pulls[j]`` to server ``j``), after the CLOCK
        header ``clocks[j]`` where given (in the same hand-off, :func:`send_pulls_directly`)."""
        send_pulls_directly(worker, pulls, clocks=clocks)

    def send_clock(self, worker: WorkerPort, clock: int) -> bool:
        """The worker finished iteration ``clock``: True if the policy sent it (mlnet: up the
        trees, with the sums); False: the runtime sends a CLOCK to every server."""
        return False

    def after_failover(self, worker: WorkerPort, replica: int) -> None:
        """The worker's requests for a lost server's shard go to ``replica`` now: it learns the
        worker's clock (an ADOPT), unless the policy tells it otherwise."""
        worker.transport.send(replica, protocol.request_tag(worker.config.session), b"", channel=worker.channel,
                              meta=protocol.Adopt(clock=worker.clock_value).encode())

    def before_rejoin(self, worker: WorkerPort, incarnation: int) -> int:
        """A restarted worker is about to ask the servers back in (:meth:`PSWorker.rejoin`):
        prepare its way back and return the first clock the policy can take it at (its
        servers count it from there or later; mlnet: its node re-enters the trees)."""
        return 0

    def after_rejoin(self, worker: WorkerPort, clock: int) -> None:
        """The servers took the restarted worker back: it counts from ``clock`` on."""

    def flush(self, timeout: float) -> None:
        """The worker leaves: what the policy still holds leaves before the leave message."""

    def worker_report(self) -> dict[str, Any] | None:
        """What the policy measured on this worker, for the run's JSON (None: nothing)."""
        return None

    def tree_parents(self, workers: int, servers: int, worker_ranks: list[int]) -> Any:
        """The aggregation trees this policy routes over (per server, each worker's parent
        rank; -1 the server), or None: no trees (``mlfabric train --fail aggregator`` needs them)."""
        return None

    # -- server side ---------------------------------------------------------------------------

    def start(self, server: ServerPort) -> None:
        """The server starts serving (the scheduled policy starts its scheduler on server 0)."""

    def stop(self, server: ServerPort) -> None:
        """The server stopped serving."""

    def claim_message(self, server: ServerPort, src: int, header: dict[str, Any], payload: memoryview) -> bool:
        """A request other than a push (from a worker, or from another server): True if the
        policy took it (the scheduled policy's batch orders, an mlnet node re-attaching)."""
        return False

    def claim_push(self, server: ServerPort, worker: int, header: dict[str, Any], payload: memoryview) -> bool:
        """A worker's push: True if the policy holds it (to apply later through the port),
        stages it or dropped it; False: the runtime applies it under the consistency model."""
        return False

    def before_clock(self, server: ServerPort, rank: int, worker: int, clock: int) -> None:
        """A CLOCK from ``rank`` is about to tick (mlnet: the node's staged sums count now)."""

    def after_clock(self, server: ServerPort, workers: list[int], clock: int) -> None:
        """``workers`` finished ``clock`` at this server."""

    def on_lost(self, server: ServerPort, rank: int) -> None:
        """``rank`` (a worker) was lost: forget what it left half-sent."""

    def step(self, server: ServerPort, now: float) -> None:
        """Every turn of the serving loop, after the requests: apply what is due (held pushes)."""

    def finish(self, server: ServerPort) -> None:
        """Every worker is gone: apply what arrived of what the policy still holds."""

    def round_limit(self, server: ServerPort, now: float) -> int | None:
        """BSP: the first round the policy still waits on (None: none)."""
        return None

    def held_ranks(self, server: ServerPort, model: str) -> set[int]:
        """Workers whose pulls wait: an update of theirs is still to be applied."""
        return set()

    def claims_pull(self, pull: "PendingPull") -> bool:
        """Whether this policy answers ``pull`` (routing policies answer what no pull policy
        before them claimed)."""
        return True

    def ready_to_answer(self, server: ServerPort) -> bool:
        """Whether the server answers the pulls that are ready now, or holds them to answer
        them in one batch later (MLfabric's model distribution batches requests)."""
        return True

    def answer_at(self) -> float | None:
        """When held pulls can be answered (``time.monotonic()``), so the server wakes then;
        None: no time of its own."""
        return None

    def answer_pulls(self, server: ServerPort, pulls: "list[PendingPull]", shard: torch.Tensor,
                     header: protocol.ModelReply, *, source: "Shard | None" = None) -> list[SendHandle]:
        """Send ``shard`` (a snapshot that stays untouched until the handles are done) to the
        workers of ``pulls`` under ``header`` (typed: a policy encodes it once per distinct
        header it sends, with what it adds); ``source``: the server's shard it was taken from."""
        return answer_directly(server, pulls, shard, header)

    def others_answered(self, server: ServerPort, ranks: list[int]) -> None:
        """Another policy answered pulls of ``ranks`` (ordered pulls lift their pacing)."""


class ReplicationFeed(Protocol):
    """What follows an applied update on a server with replicas (:mod:`mlfabric.ps.policies.replication`)."""

    network: bool

    def after_apply(self, server: ServerPort, shard: "Shard", version: int, gradient: torch.Tensor,
                    workers: tuple[int, ...], computed_from: tuple[int, ...], weight: float, unit: int | None,
                    members: list[list[int]] | None, norm: float | None) -> None: ...

    def on_ack(self, server: ServerPort, replica: int, header: dict[str, Any]) -> None: ...

    def refusal(self, server: ServerPort, replica: int) -> str | None: ...

    def hold_last(self, server: ServerPort, shard: "Shard", norm: float | None, now: float) -> bool: ...

    def probe(self, server: ServerPort, shard: "Shard", batch: int) -> None: ...


# --------------------------------------------------------------------------- direct sends


def send_pulls_directly(worker: WorkerPort, pulls: "list[protocol.Pull]", *,
                        clocks: list[bytes] | None = None) -> None:
    """Pull ``j`` to server ``j``; with ``clocks``, CLOCK header ``clocks[j]`` just before it,
    in one transport call (one segment on tcp, so the server takes both in one turn)."""
    tag = protocol.request_tag(worker.config.session)
    for j, pull in enumerate(pulls):
        header = pull.encode()
        if clocks is None:
            worker.transport.send(worker.server_rank(j), tag, b"", meta=header, channel=worker.channel)
        else:
            worker.transport.send_many(worker.server_rank(j), [(tag, b"", clocks[j]), (tag, b"", header)],
                                       channel=worker.channel)


def answer_directly(server: ServerPort, pulls: "list[PendingPull]", shard: torch.Tensor,
                    header: protocol.ModelReply) -> list[SendHandle]:
    """The server sends ``shard`` to each puller itself (``header`` encoded once for all)."""
    if not pulls:
        return []
    payload, meta = tensor_bytes(shard), header.encode()
    return [server.transport.send(p.rank, protocol.reply_tag(server.config.session, p.request_id), payload,
                                  meta=meta, channel=server.channel)
            for p in pulls]


# --------------------------------------------------------------------------- the registry

PolicyFactory = Callable[["PSConfig"], Policy]

#: The built-in policies: the module that registers each (imported on first use, so that this
#: module imports no policy and no policy module imports another through it).
_BUILTIN = {"direct": "mlfabric.ps.policies.direct", "scheduled": "mlfabric.ps.policies.scheduled",
            "mlnet": "mlfabric.ps.policies.mlnet"}
_REGISTRY: dict[str, PolicyFactory] = {}
_LOCK = threading.Lock()
_plugins_loaded: set[str] = set()


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make ``PSConfig(routing=name)`` build ``factory(config)`` (a :class:`Policy`) on every
    rank that registered it. ValueError if ``name`` is taken (``replace=True`` overrides)."""
    if not name or not isinstance(name, str) or "@" in name or "," in name:
        raise ValueError(f"a policy name is a non-empty string without '@' or ',', got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_policy({name!r}, factory): factory must be callable, got {type(factory).__name__}")
    if name in _BUILTIN and name not in _REGISTRY:
        # a built-in's module registers it first (this is that call when the module is importing)
        importlib.import_module(_BUILTIN[name])
    with _LOCK:
        if name in _REGISTRY and not replace and _REGISTRY[name] is not factory:
            raise ValueError(f"policy {name!r} is registered already; pass replace=True to override it")
        _REGISTRY[name] = factory


def policy_names() -> list[str]:
    """The names ``PSConfig(routing=...)`` accepts now (built-in and registered)."""
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def _load_plugins() -> None:
    for item in filter(None, (s.strip() for s in os.environ.get(PLUGINS_ENV, "").split(","))):
        if item in _plugins_loaded:
            continue
        _plugins_loaded.add(item)
        if item.endswith(".py"):
            path = Path(item).resolve()
            name = f"mlfabric_ps_plugin_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ValueError(f"{PLUGINS_ENV}: cannot load {item!r} (not a Python file)")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(item)


def policy_factory(name: str) -> PolicyFactory:
    """The factory registered as ``name`` (importing a built-in's module, or the
    ``MLFABRIC_PS_PLUGINS`` modules, on first use); ValueError naming the known ones."""
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        _load_plugins()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(policy_names())} (register "
                         f"others with mlfabric.ps.register_policy, and list their module in {PLUGINS_ENV})")
    return factory


def make_policy(config: "PSConfig") -> Policy:
    """A fresh policy object for ``config.routing`` (one per worker or server)."""
    return policy_factory(config.routing)(config)


def validate_policy(config: "PSConfig") -> None:
    """``config``'s policy exists and accepts ``config`` (PSConfig calls it)."""
    make_policy(config).validate(config)


__all__ = ["PLUGINS_ENV", "Policy", "PolicyFactory", "ReplicationFeed", "ServerPort", "WorkerPort",
           "answer_directly", "make_policy", "policy_factory", "policy_names", "register_policy",
           "send_pulls_directly", "validate_policy"]
