"""An elastic communicator: a membership that shrinks on a lost rank and grows on a joiner.

    .venv/bin/python -m pytest -q tests/unit/test_elastic_membership.py tests/unit/test_elastic_recovery_faults.py \\
        tests/local/test_elastic_processes.py
    .venv/bin/mlfabric train --workload hyperplane --workers 4 --sync allreduce --elastic \\
        --fail worker:2@3 --rejoin 2 --dim 1024 --train-samples 8192 --json -

:class:`ElasticCommunicator` holds, for one process, the current membership epoch
(``runtime/membership.py``: the quorum) and a plain :class:`~mlfabric.runtime.Communicator`
over a transport of that epoch only. When a collective fails (a peer lost or departed, an
abort notice) the caller calls :meth:`ElasticCommunicator.reconfigure`: the survivors agree
on the next epoch's members through the store, each builds a fresh transport whose token is
the epoch's (so nothing of an old membership can be delivered), and the collectives go on
over the N-1 dense ranks. No process restarts.

A collective in flight when a peer died may complete on some survivors (those that had
received everything before the death) and fail on others. The *step* is what must end the
same everywhere, so the quorum records each member's committed step and the epoch starts at
the highest: members behind it (and joiners) receive the state from the members that hold it
(:meth:`Communicator.striped_copy`: chunked, striped over every such member, then checked
against the senders' CRC-32). So a step is committed on every live rank or on none: the
ranks that had aborted it are rolled forward, never the others back.

Joiners: a process started by hand or restarted (``initial=None``) takes a ticket for the
next epoch; the members' leader (dense rank 0) reads the ticket count at every step boundary
(:meth:`ElasticCommunicator.joiners_waiting`) and the wrapper carries that flag inside the
step's own allreduce, so every member decides at the same step to form the next epoch with
the joiner, which then receives the state before it takes part in the next step.

What holds the state is the caller's (:class:`StateHolder`; ``mlfabric/torch/elastic.py``
packs a model and an optimizer).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

import torch

from mlfabric.errors import MlfabricError, TransportError
from mlfabric.transport.base import CONTROL_CHANNEL, GOODBYE_TAG
from mlfabric.collectives.bcube import hierarchy_of
from mlfabric.topo.spec import TopologySpec
from mlfabric.transport.tcp import TcpTransport

from .communicator import DEFAULT_TIMEOUT_S, Communicator
from .control import Farewell
from .fair_share import nic_rates_from
from .membership import (
    DEFAULT_GRACE_S,
    ElasticError,
    Membership,
    MembershipStore,
    Store,
    agree,
    epoch_token,
)

log = logging.getLogger("mlfabric.elastic")

#: Bound on connecting to a new epoch's members: their listeners were up before they
#: published their endpoints, so a refused or silent dial means the member died.
DEFAULT_CONNECT_S = 2.0
#: State transfer chunk (bytes): chunk j comes from source j % sources.
DEFAULT_TRANSFER_CHUNK = 4 << 20


class StateHolder(Protocol):
    """What an elastic communicator hands to joiners and laggards."""

    #: Steps committed so far (the quorum starts an epoch at the members' highest).
    committed: int

    def signature(self) -> str:
        """The shape of the state (names, shapes, dtypes): a joiner must have the members'."""

    def pack(self) -> tuple[dict[str, Any], torch.Tensor]:
        """(a JSON-able header, the state's bytes as a flat uint8 tensor); the header says
        :attr:`committed` and whatever :meth:`unpack` needs."""

    def unpack(self, header: dict[str, Any], blob: torch.Tensor) -> None:
        """Take the state from a :meth:`pack` of another process (and its ``committed``)."""


@dataclass(frozen=True, kw_only=True)
class MembershipChange:
    """One change, as this process saw it (times: ``time.time()``, comparable across the
    processes of a host)."""

    epoch: int
    members: tuple[int, ...]
    reason: str
    began: float          # the failure was caught / the join decided
    formed: float         # the new transport was connected
    synced: float         # the state transfer (if any) was checked
    transferred_bytes: int
    sources: tuple[int, ...]   # member ids that sent state
    receivers: tuple[int, ...]  # member ids that received it
    #: Seconds of the striped copy alone (the network part of ``synced - formed``, which also
    #: holds the senders' packing and checksums); 0 without a transfer.
    copy_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "members": list(self.members), "reason": self.reason,
                "began": self.began, "formed": self.formed, "synced": self.synced,
                "transferred_bytes": self.transferred_bytes, "sources": list(self.sources),
                "receivers": list(self.receivers), "copy_s": self.copy_s}


class _EpochFailed(Exception):
    """A new epoch could not be set up (a member died during it): form the next one."""

    def __init__(self, message: str, gone: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.gone = set(gone)


class ElasticCommunicator:
    """See the module docstring. ``initial``: the member ids of the job's first membership
    (every process started with the job passes the same list); None: join a running job (a
    process given ``initial`` joins too when the job already runs: a restart with the same
    arguments).
    ``store`` must outlive every worker (the launcher serves it). ``timeout`` bounds each
    collective and each quorum; ``grace_s`` how long a quorum waits for a member that is not
    known gone."""

    def __init__(self, store: Store, member: int, state: StateHolder, *,
                 initial: Sequence[int] | None = None, job: str = "job", address: str = "127.0.0.1",
                 timeout: float = DEFAULT_TIMEOUT_S, grace_s: float = DEFAULT_GRACE_S,
                 connect_s: float = DEFAULT_CONNECT_S, chunk_bytes: int = DEFAULT_TRANSFER_CHUNK,
                 watchdog: float | None = None, topology: str | None = None,
                 hosts: Mapping[int, int] | None = None) -> None:
        if member < 0:
            raise ValueError(f"member id must be >= 0, got {member}")
        if initial is not None:
            initial = tuple(sorted(set(int(m) for m in initial)))
            if member not in initial:
                raise ValueError(f"member {member} is not in the initial members {list(initial)}")
        self.member = member
        self.state = state
        self.ms = MembershipStore(store, job)
        self.address = address
        self.timeout = float(timeout)
        self.grace_s = float(grace_s)
        self.connect_s = float(connect_s)
        self.chunk_bytes = int(chunk_bytes)
        self.watchdog = watchdog
        #: The cluster's shape (e.g. "bcube:n=3,k=2": member id i on its host i) and each
        #: member's host (host_hierarchical), for the epochs' communicators: see _connect.
        self.topology = None if topology is None else TopologySpec.parse(topology)
        self.hosts = None if hosts is None else {int(m): int(h) for m, h in hosts.items()}
        self._fallbacks_logged: set[tuple[int, str]] = set()
        self.token = self.ms.job_token()
        if initial is not None and self.ms.current_epoch() >= 0:
            # The job runs already: this is a restarted process given the same arguments as
            # at the start (torchrun --max-restarts does that): it joins.
            log.warning("member %d: the job is running (membership epoch %d): joining it", member,
                        self.ms.current_epoch())
            initial = None
        self.comm: Communicator | None = None
        self.membership: Membership | None = None
        self.history: list[MembershipChange] = []
        self._closed = False
        self._copy_s = 0.0  # the last state transfer's striped copy (MembershipChange.copy_s)
        # A joiner holds no state until its first transfer: it registers as step -1, so it is
        # never chosen to send.
        # At the start only the lowest member's state counts (like DDP's broadcast from rank 0):
        # the others receive it, so every member starts from the same parameters.
        self._has_state = initial is not None and member == initial[0]
        began = time.time()
        if initial is not None:
            self._move(0, previous=initial, gone=set(), joiner=False, reason="start", began=began,
                       grace_s=self.timeout)
        else:
            self._join(reason="joined", began=began)

    # -- what the caller reads ---------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's dense rank in the current epoch."""
        assert self.membership is not None
        return self.membership.rank_of(self.member)

    @property
    def world_size(self) -> int:
        assert self.membership is not None
        return self.membership.world_size

    @property
    def epoch(self) -> int:
        assert self.membership is not None
        return self.membership.epoch

    def joiners_waiting(self) -> bool:
        """Whether a process asked to join the next epoch (one store round trip: the wrapper
        asks on the leader only and spreads the answer inside the step's allreduce)."""
        return self.ms.joiner_count(self.epoch + 1) > 0

    # -- changes -----------------------------------------------------------------------------

    def reconfigure(self, reason: str, *, after_commit: bool = False) -> Membership:
        """Form the next epoch with the members that are still alive (and any joiner), bring
        every member to the highest committed step, and return the new membership. Call it
        on every member when a collective failed, or after a step whose allreduce said that
        joiners wait (``after_commit``: every collective called here completed, so peers
        still finishing the last one are let finish it instead of failing it)."""
        if self._closed:
            raise ElasticError(f"member {self.member}: the elastic communicator is closed")
        began = time.time()
        assert self.membership is not None and self.comm is not None
        old, members = self.comm, self.membership.members
        transport = old.transport
        gone = {members[p] for p in transport.gone_peers}
        # The collective's error names dense ranks of the old epoch; the members gone are ids.
        log.warning("member %d: leaving membership epoch %d %s (members gone: %s): %s", self.member,
                    self.membership.epoch, list(members), sorted(gone) or "none seen here", reason)
        self._move(self.membership.epoch + 1, previous=members, gone=gone, joiner=False, reason=reason,
                   began=began, grace_s=self.grace_s, old=old, leave_clean=after_commit)
        assert self.membership is not None
        return self.membership

    def _join(self, *, reason: str, began: float) -> None:
        epoch = self.ms.current_epoch() + 1
        deadline = time.monotonic() + self.timeout
        while True:
            previous = self.ms.closed(epoch - 1)
            if self._move(epoch, previous=() if previous is None else previous.members, gone=set(), joiner=True,
                          reason=reason, began=began, grace_s=self.grace_s, optional=True):
                return
            if time.monotonic() > deadline:
                raise ElasticError(f"member {self.member}: could not join the job within {self.timeout:g} s "
                                   f"(last tried membership epoch {epoch})")
            epoch = max(epoch + 1, self.ms.current_epoch() + 1)

    def _move(self, epoch: int, *, previous: Sequence[int], gone: set[int], joiner: bool, reason: str,
              began: float, grace_s: float, old: Communicator | None = None, optional: bool = False,
              leave_clean: bool = False) -> bool:
        """Agree on ``epoch`` and set it up, going on to later epochs while members die during
        the setup. ``optional`` (a joiner): return False when the quorum closed without us.
        ``leave_clean``: ``old``'s collectives all completed here (see :func:`_say_goodbye`)."""
        previous = tuple(previous)
        deadline = time.monotonic() + self.timeout
        while True:
            old_transport = None if old is None else old.transport
            old_members = previous

            def gone_now() -> set[int]:
                seen = set(gone)
                if old_transport is not None:
                    seen |= {old_members[p] for p in old_transport.gone_peers if p < len(old_members)}
                return seen

            leaving, clean = old, leave_clean
            leave_clean = False  # a later epoch's communicator is left after a failure

            def registered() -> None:
                if leaving is not None:
                    _say_goodbye(leaving, reason, clean=clean)

            membership = agree(self.ms, epoch, self.member, previous=previous, gone=gone_now,
                               step=self.state.committed if self._has_state else -1,
                               signature=self.state.signature(), joiner=joiner, may_close=not optional,
                               timeout=max(1.0, deadline - time.monotonic()), grace_s=grace_s,
                               on_registered=registered)
            if old is not None:
                _close_later(old)  # after registering: peers count us in, not as departed
                old = None
            if membership is None:
                if optional:
                    return False
                # Registered too late (we were slow, not dead): come back as a joiner.
                log.warning("member %d: membership epoch %d formed without it; joining the next", self.member, epoch)
                self._join(reason=f"rejoined after being left out ({reason})", began=began)
                return True
            try:
                comm = self._connect(membership)
            except _EpochFailed as exc:
                log.warning("member %d: membership epoch %d %s failed to form: %s", self.member, epoch,
                            list(membership.members), exc)
                previous, gone, epoch, joiner = membership.members, exc.gone, epoch + 1, False
                continue
            formed = time.time()
            try:
                sent, sources, receivers = self._sync(comm, membership)
            except (MlfabricError, _EpochFailed) as exc:
                log.warning("member %d: state transfer in membership epoch %d failed: %s", self.member, epoch, exc)
                if isinstance(exc, ElasticError) and not isinstance(exc, _TransferBroken):
                    comm.close(reason=str(exc))
                    raise
                previous, gone, epoch, joiner = membership.members, set(), epoch + 1, False
                old = comm
                continue
            self.comm, self.membership = comm, membership
            self._has_state = True
            change = MembershipChange(epoch=epoch, members=membership.members, reason=reason, began=began,
                                      formed=formed, synced=time.time(), transferred_bytes=sent,
                                      sources=sources, receivers=receivers, copy_s=self._copy_s)
            self.history.append(change)
            log.warning("member %d: membership epoch %d: members %s (rank %d of %d), %s; state from %s to %s",
                        self.member, epoch, list(membership.members), self.rank, self.world_size, reason,
                        list(sources), list(receivers))
            return True

    def _connect(self, membership: Membership) -> Communicator:
        """A transport of ``membership``'s epoch connected to every member, and a
        communicator on it."""
        epoch, rank = membership.epoch, membership.rank_of(self.member)
        transport = TcpTransport(rank, membership.world_size, epoch_token(self.token, epoch),
                                 bind_addrs={"0": self.address}, connect_timeout=self.connect_s,
                                 shared_memory=False)
        try:
            self.ms.publish(epoch, self.member, "endpoints", json.dumps(transport.endpoints))
            deadline = time.monotonic() + self.connect_s
            peers: dict[int, dict[str, str]] = {}
            while len(peers) < membership.world_size - 1:
                for index, member in enumerate(membership.members):
                    if member != self.member and index not in peers:
                        raw = self.ms.read(epoch, member, "endpoints")
                        if raw is not None:
                            peers[index] = json.loads(raw)
                if len(peers) < membership.world_size - 1:
                    if time.monotonic() > deadline:
                        silent = [m for i, m in enumerate(membership.members) if m != self.member and i not in peers]
                        raise _EpochFailed(f"members {silent} never published their endpoints within "
                                           f"{self.connect_s:g} s", gone=silent)
                    time.sleep(0.005)
            dead = []
            for index, endpoints in sorted(peers.items()):
                try:
                    transport.connect({index: endpoints})
                except TransportError as exc:
                    dead.append(membership.members[index])
                    log.warning("member %d: %s", self.member, exc)
            if dead:
                raise _EpochFailed(f"cannot connect to members {dead}", gone=dead)
            self._all_connected(membership)
            return Communicator(transport, timeout=self.timeout, watchdog=self.watchdog,
                                topology=self._topology_of(membership), hosts=self._hosts_of(membership))
        except BaseException:
            transport.close(b"")
            raise

    # -- what the remaining hosts support -------------------------------------------------------

    def _topology_of(self, membership: Membership) -> TopologySpec | None:
        """The topology for an epoch: the cluster's shape when its members are exactly the
        shape's hosts (member id i on host i), else none: with a host missing (N-1 members) or
        another process in its place, BCube's and the switch hierarchy's schedules do not fit,
        and the epoch's allreduce falls back (:meth:`algorithm_for`)."""
        if self.topology is None:
            return None
        if self.topology.kind == "edges":
            return self.topology
        hosts = math.prod(hierarchy_of(self.topology))
        return self.topology if membership.members == tuple(range(hosts)) else None

    def _hosts_of(self, membership: Membership) -> list[int] | None:
        """Each dense rank's host (from the member -> host map), for host_hierarchical over the
        ranks that remain (hosts may now hold different counts of ranks; a host with none is
        simply absent); None: the transport's own guess (the endpoints' addresses)."""
        if self.hosts is None:
            return None
        missing = [m for m in membership.members if m not in self.hosts]
        if missing:
            raise ElasticError(f"member {self.member}: members {missing} have no host in the hosts map "
                               f"{self.hosts}: give every member id that may join its host")
        return [self.hosts[m] for m in membership.members]

    def algorithm_for(self, wanted: str) -> str:
        """The allreduce to run in the current epoch for ``wanted``: itself where the epoch
        supports it, else ``ring`` (BCube and the switch hierarchy need the full cluster's
        shape: see :meth:`_topology_of`), logged once per epoch and algorithm."""
        assert self.comm is not None and self.membership is not None
        if wanted in ("bcube", "hierarchical") and self.comm.topology is None:
            key = (self.membership.epoch, wanted)
            if key not in self._fallbacks_logged:
                self._fallbacks_logged.add(key)
                shape = "no topology was given" if self.topology is None else (
                    f"members {list(self.membership.members)} are not the hosts of {self.topology}")
                log.warning("member %d: membership epoch %d runs ring instead of %s (%s)", self.member,
                            self.membership.epoch, wanted, shape)
            return "ring"
        return wanted

    def _all_connected(self, membership: Membership) -> None:
        """Wait until every member has dialled every other. Why: a member's death is seen by
        its peers as the end of the connection it dialled to them (their reader gets EOF); a
        member that dies before it has dialled a peer is invisible to that peer, which only
        writes to it, and a joiner waiting for that member's state would wait for the
        timeout (a churn run waited 60 s). After this barrier every death is seen."""
        epoch = membership.epoch
        self.ms.publish(epoch, self.member, "connected", "1")
        deadline = time.monotonic() + 2 * self.connect_s
        waiting = [m for m in membership.members if m != self.member]
        while waiting:
            waiting = [m for m in waiting if self.ms.read(epoch, m, "connected") is None]
            if waiting:
                if time.monotonic() > deadline:
                    raise _EpochFailed(f"members {waiting} did not connect to everyone within "
                                       f"{2 * self.connect_s:g} s", gone=waiting)
                time.sleep(0.005)

    def _sync(self, comm: Communicator, membership: Membership) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Bring every member to the epoch's committed step: (bytes received here, source ids,
        receiver ids)."""
        self._copy_s = 0.0
        sources, receivers = membership.sources(), membership.receivers()
        source_ids = tuple(membership.members[i] for i in sources)
        receiver_ids = tuple(membership.members[i] for i in receivers)
        if not receivers:
            return 0, source_ids, receiver_ids
        epoch, me = membership.epoch, membership.rank_of(self.member)
        if me in sources:
            header, blob = self.state.pack()
            blob = blob.contiguous().view(torch.uint8).reshape(-1)
            header = dict(header, nbytes=blob.numel(), crc32=zlib.crc32(_bytes(blob)), chunk_bytes=self.chunk_bytes)
            self.ms.publish(epoch, self.member, "state", json.dumps(header))
        else:
            headers = self._source_headers(comm, membership, source_ids)
            crcs = {h["crc32"] for h in headers.values()}
            if len(crcs) != 1:
                per_member = ", ".join(f"{m}: {h['crc32']:#010x}" for m, h in headers.items())
                raise ElasticError(f"member {self.member}: the members at step {membership.committed} hold different "
                                   f"states (CRC-32 per member: {per_member}); "
                                   "their training diverged: restart the job from a checkpoint")
            header = next(iter(headers.values()))
            blob = torch.empty(int(header["nbytes"]), dtype=torch.uint8)
        paced = self._pace_transfer(comm, sources, receivers) if me in sources else []
        copy_began = time.perf_counter()
        try:
            # The senders' chunk: every member must cut the buffer alike.
            comm.striped_copy(blob, sources, receivers, chunk_bytes=int(header["chunk_bytes"]))
        except MlfabricError as exc:
            # The collective's error names dense ranks; the log must name members.
            raise _TransferBroken(f"the state transfer from {list(source_ids)} to {list(receiver_ids)} "
                                  f"broke: {exc} (ranks of membership epoch {epoch} are members "
                                  f"{list(membership.members)}, in that order)") from exc
        finally:
            for peer in paced:  # the epoch's later collectives run unpaced
                try:
                    comm.transport.pace_connection(peer, comm.transport.channels[0], None)
                except MlfabricError:
                    pass  # the receiver is gone: nothing left to pace
        self._copy_s = time.perf_counter() - copy_began
        if me in sources:
            return 0, source_ids, receiver_ids
        got = zlib.crc32(_bytes(blob))
        if got != header["crc32"]:
            raise ElasticError(f"member {self.member}: the state received from members {list(source_ids)} in "
                               f"membership epoch {epoch} fails its checksum (CRC-32 {got:#010x}, the senders' "
                               f"{header['crc32']:#010x})")
        self.state.unpack(header, blob)
        self._has_state = True
        return blob.numel(), source_ids, receiver_ids

    def _pace_transfer(self, comm: Communicator, sources: Sequence[int], receivers: Sequence[int]) -> list[int]:
        """Pace this sender's connections to the receivers at its share of a NIC (the NIC
        rate, ``MLFABRIC_NIC_RATE``, over the larger of the senders and the receivers). Why:
        S senders into one receiver's port otherwise rely on TCP alone to share it, bursting
        into its queue; paced at their share they fill it together with a short queue (what
        mlfabric does for its other many-to-one traffic). Measured with 3 senders on the
        emulator at 1 Gbit/s (docs/results.md), the copy ran at 0.99-1.01 of one TCP flow
        paced and 0.96-1.16 unpaced: no difference shown at 3 senders (the copy's timer
        starts at the receiver, so that comparison is coarse). Returns the receivers paced
        (none when the rate is unknown or there is one sender)."""
        transport = comm.transport
        channel = transport.channels[0]
        rate = nic_rates_from(None, transport.channels).get(channel)
        if rate is None or len(sources) < 2:
            return []  # one sender keeps its flow's own congestion control
        share = rate / max(len(sources), len(receivers))
        return [peer for peer in receivers if transport.pace_connection(peer, channel, share)]

    def _source_headers(self, comm: Communicator, membership: Membership,
                        source_ids: tuple[int, ...]) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + self.timeout
        headers: dict[int, dict[str, Any]] = {}
        while len(headers) < len(source_ids):
            for member in source_ids:
                if member not in headers:
                    raw = self.ms.read(membership.epoch, member, "state")
                    if raw is not None:
                        headers[member] = json.loads(raw)
            if len(headers) < len(source_ids):
                if time.monotonic() > deadline:
                    raise _TransferBroken(f"members {[m for m in source_ids if m not in headers]} never described "
                                          f"their state within {self.timeout:g} s")
                gone = {membership.members[p] for p in comm.transport.gone_peers}
                silent = [m for m in source_ids if m not in headers and m in gone]
                if silent:
                    # Only those whose description is missing: the others may have left after
                    # describing theirs (a sender that finished, then failed its next step).
                    raise _TransferBroken(f"members {silent} left before describing their state "
                                          f"(gone from membership epoch {membership.epoch}: {sorted(gone)})")
                time.sleep(0.005)
        return headers

    # -- shutdown ----------------------------------------------------------------------------

    def finish(self) -> None:
        """Say in the store that training is over (joiners still waiting then give up with
        :class:`~mlfabric.runtime.membership.JobFinishedError`); call it on the members once
        the last step committed."""
        self.ms.finish(self.state.committed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.comm is not None:
            self.comm.close()

    def __enter__(self) -> "ElasticCommunicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TransferBroken(ElasticError):
    """A state transfer did not complete (a sender or receiver died): form the next epoch."""


def _bytes(blob: torch.Tensor) -> memoryview:
    return memoryview(blob.numpy()) if blob.numel() else memoryview(b"")


def _say_goodbye(comm: Communicator, reason: str, *, clean: bool = False) -> None:
    """Tell the old epoch's peers that this member left it (the goodbye a closing transport
    sends, naming the collectives it will not finish), without closing the transport yet: its
    peers may still run a collective of that epoch and must fail it now, not at its timeout
    (a joiner whose transfer failed while the senders finished theirs), while this member
    still learns, through the open transport, which peers die during the quorum."""
    # After a failure, last_seq -1: it finishes no collective of this epoch, not even one it
    # had called (the executor's own goodbye would count a collective that failed here as
    # called, and a peer waiting in it for a rank that died unseen by that peer would wait
    # for its timeout). ``clean`` (every collective called here completed: a step committed,
    # then joiners are admitted): the executor's own note, so a peer still receiving the last
    # step's data (sent before this goodbye, on the same connections) completes that step
    # instead of aborting it (it did, and then needed a state transfer for nothing).
    note = f"it left membership epoch's collectives ({reason})"
    farewell = comm.executor.farewell(note) if clean else Farewell(reason=note, last_seq=-1).encode()
    transport = comm.transport
    for peer in range(transport.world_size):
        if peer != transport.rank and not transport.is_gone(peer):
            try:
                transport.send(peer, GOODBYE_TAG, farewell, channel=CONTROL_CHANNEL)
            except MlfabricError:  # the peer is gone already: nothing to tell
                pass


def _close_later(comm: Communicator) -> None:
    """Close an old epoch's communicator off the critical path (its goodbyes flush for up to
    a couple of seconds to peers that may be hung)."""
    threading.Thread(target=comm.close, kwargs={"reason": "its membership epoch ended"},
                     name="mlfabric-elastic-close", daemon=True).start()
