"""Elastic membership: the quorum, the striped state copy, and members as threads over tcp.

    .venv/bin/python -m pytest tests/unit/test_elastic_membership.py -q

Members run as threads of this process (each with its own epoch transports on loopback and a
shared in-memory store); a member leaves by closing its communicator, which its peers see as
a departed peer, exactly the path of a lost one after detection. Real processes killed with
SIGKILL are in tests/local/test_elastic_processes.py.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mlfabric.collectives.striped import stripes, striped_copy
from mlfabric.runtime.membership import (
    ElasticJoinError,
    Membership,
    MembershipStore,
    agree,
    epoch_token,
    expected_members,
)
from mlfabric.schedule import Recv, Send, validate
from mlfabric.torch.elastic import Elastic

from tests.unit.elastic_members import DIM, run_members
from tests.unit.elastic_members import batch as _batch

# -- pure logic ------------------------------------------------------------------------------


def test_stripes_round_robin_over_sources() -> None:
    plan = stripes(10, (1, 3), 3)
    assert plan == [(0, 3, 1), (3, 3, 3), (6, 3, 1), (9, 1, 3)]
    with pytest.raises(ValueError, match="at least one source"):
        stripes(10, (), 3)


def test_striped_copy_structure_and_validation() -> None:
    world, count, sources, receivers = 4, 10, (0, 2), (1, 3)
    schedules = [striped_copy(world, r, count, sources=sources, receivers=receivers, chunk=3) for r in range(world)]
    # Source 0 sends chunks 0 and 2 to both receivers; source 2 chunks 1 and 3.
    sends0 = sorted((op.peer, op.src.offset) for op in schedules[0].ops if isinstance(op, Send))
    assert sends0 == [(1, 0), (1, 6), (3, 0), (3, 6)]
    recvs1 = sorted((op.peer, op.dst.offset, op.dst.length) for op in schedules[1].ops if isinstance(op, Recv))
    assert recvs1 == [(0, 0, 3), (0, 6, 3), (2, 3, 3), (2, 9, 1)]
    assert schedules[0].cost.elements_sent["0"] == 2 * (3 + 3)
    validate(schedules)
    with pytest.raises(ValueError, match="both sources and receivers"):
        striped_copy(4, 0, 10, sources=(0, 1), receivers=(1,))


def test_membership_sources_and_receivers() -> None:
    m = Membership(epoch=3, members=(0, 1, 3, 7), steps={0: 12, 1: 11, 3: 12, 7: -1})
    assert m.committed == 12 and m.sources() == (0, 2) and m.receivers() == (1, 3)
    assert m.rank_of(7) == 3
    assert Membership.from_json(m.to_json()) == m
    assert expected_members((0, 1, 2, 3), {2}, [5]) == {0, 1, 3, 5}


def test_epoch_tokens_differ_per_epoch_and_job() -> None:
    assert epoch_token(b"a" * 16, 1) != epoch_token(b"a" * 16, 2)
    assert epoch_token(b"a" * 16, 1) != epoch_token(b"b" * 16, 1)
    assert len(epoch_token(b"a" * 16, 1)) == 16


def test_quorum_first_closer_wins_and_leaves_out_the_gone() -> None:
    ms = MembershipStore(dist.HashStore(), "t")
    results: dict[int, Membership | None] = {}

    def member(m: int) -> None:
        results[m] = agree(ms, 1, m, previous=(0, 1, 2), gone=lambda: {2}, step=5 + m, signature="s",
                           joiner=False, timeout=5.0)

    threads = [threading.Thread(target=member, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results[0] == results[1] == Membership(epoch=1, members=(0, 1), steps={0: 5, 1: 6})
    assert ms.current_epoch() == 1


def test_quorum_rejects_a_joiner_with_another_model() -> None:
    ms = MembershipStore(dist.HashStore(), "t")
    errors: dict[str, BaseException] = {}

    def joiner() -> None:
        try:
            agree(ms, 1, 9, previous=(0,), gone=set, step=-1, signature="other", joiner=True, timeout=5.0,
                  may_close=False)
        except ElasticJoinError as exc:
            errors["joiner"] = exc

    t = threading.Thread(target=joiner)
    t.start()
    deadline = time.monotonic() + 5
    # Wait for the joiner's ticket to be complete (joiners(), not joiner_count(): the count
    # moves before the ticket names the joiner, and a quorum that closes in between rightly
    # leaves the joiner for the next epoch instead of rejecting it).
    while not ms.joiners(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    won = agree(ms, 1, 0, previous=(0,), gone=set, step=4, signature="mine", joiner=False, timeout=5.0)
    t.join(10)
    assert won is not None and won.members == (0,)
    assert "differs from the members'" in str(errors["joiner"]) and "other" in str(errors["joiner"])


def test_quorum_times_out_with_a_clear_error() -> None:
    ms = MembershipStore(dist.HashStore(), "t")
    with pytest.raises(Exception, match="no quorum for membership epoch 1 within 0.2 s"):
        agree(ms, 1, 0, previous=(0, 1), gone=set, step=0, signature="s", joiner=False, timeout=0.2, grace_s=10)


# -- members as threads ----------------------------------------------------------------------

def _train(store: dist.Store, member: int, steps: int, initial: tuple[int, ...] | None, *,
           leave_at: int | None = None, dim: int = DIM, out: dict | None = None) -> None:
    model = nn.Linear(dim, 1)
    if member == 0:  # the members take member 0's parameters at the start (threads share torch's RNG)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    el = Elastic(model, opt, store=store, member=member, initial=initial, timeout=20, grace_s=3)
    try:
        while el.committed < steps:
            if leave_at is not None and el.committed == leave_at:
                el.close()  # departs: its peers see a departed peer in their next collective
                break
            x, y = _batch(el.committed, el.rank, el.world_size)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            el.step(weight=len(x))
    finally:
        if out is not None:
            out[member] = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(),
                           "committed": el.committed, "history": el.comm.history, "aborted": el.aborted}
        el.close()


def test_survivors_go_on_and_a_joiner_catches_up() -> None:
    store = dist.HashStore()
    out: dict = {}
    errors: list[BaseException] = []

    def run(*args, **kwargs) -> None:
        try:
            _train(store, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    steps = 30
    threads = [threading.Thread(target=run, args=(m, steps, (0, 1, 2)),
                                kwargs={"out": out, "leave_at": 8 if m == 2 else None}, daemon=True)
               for m in (0, 1, 2)]
    for t in threads:
        t.start()
    threads[2].join(30)
    ms = MembershipStore(store)
    deadline = time.monotonic() + 30
    while ms.current_epoch() < 1 and time.monotonic() < deadline:  # the survivors went on without it
        time.sleep(0.01)
    # Restarted with the arguments it was started with (as torchrun --max-restarts does): it joins.
    joiner = threading.Thread(target=run, args=(2, steps, (0, 1, 2)), kwargs={"out": out}, daemon=True)
    joiner.start()
    for t in (*threads, joiner):
        t.join(60)
    assert not errors, errors
    assert all(not t.is_alive() for t in (*threads, joiner))
    assert out[0]["committed"] == out[1]["committed"] == out[2]["committed"] == steps
    assert torch.equal(out[0]["params"], out[1]["params"]) and torch.equal(out[0]["params"], out[2]["params"])
    members = [c.members for c in out[0]["history"]]
    assert members[0] == (0, 1, 2) and (0, 1) in members and members[-1] == (0, 1, 2)
    joined = out[2]["history"][0]
    assert joined.receivers == (2,) and joined.transferred_bytes > 0 and set(joined.sources) == {0, 1}

    # The same training with no departure ends with the same parameters (the elastic steps
    # average over the ranks that contributed, weighted by their samples).
    ref: dict = {}
    store2 = dist.HashStore()
    ref_threads = [threading.Thread(target=_train, args=(store2, m, steps, (0, 1, 2)), kwargs={"out": ref},
                                    daemon=True) for m in (0, 1, 2)]
    for t in ref_threads:
        t.start()
    for t in ref_threads:
        t.join(60)
    assert torch.allclose(ref[0]["params"], out[0]["params"], atol=1e-5)


def test_admitting_a_joiner_aborts_no_step() -> None:
    """Regression (check 4's joiner test, 1 run in 4): the members commit a step whose
    allreduce says a joiner waits, then leave the epoch; the first to leave said it finished
    none of the epoch's collectives, which failed the step on a member still receiving its
    last bytes: that member aborted a step it could have committed and needed a state
    transfer. Now a member that leaves after a commit lets the others finish the step."""
    def slow_member_2(member: int, el: Elastic) -> None:
        # Member 2 takes in its messages late, so it is the last to complete each step: the
        # others leave the epoch while its last bytes wait in its mailbox.
        if member == 2:
            executor = el.comm.comm.executor
            original = executor._pass

            def late_pass(*args, **kwargs):  # type: ignore[no-untyped-def]
                time.sleep(0.02)
                return original(*args, **kwargs)
            executor._pass = late_pass

    for _ in range(2):
        out, errors = run_members(dist.HashStore(), {0: {}, 1: {}, 2: {}, 5: {"initial": None, "start_after": 0}},
                                  12, (0, 1, 2), slow_member_2, step_s=0.005)
        assert not errors, errors
        assert [out[m]["aborted"] for m in (0, 1, 2, 5)] == [0, 0, 0, 0]
        joins = [c for c in out[0]["history"] if 5 in c.members]
        assert len(joins) == 1 and joins[0].receivers == (5,), joins
        assert all(torch.equal(out[0]["params"], out[m]["params"]) for m in (1, 2, 5))


def test_a_joiner_with_another_model_is_refused_and_the_job_goes_on() -> None:
    store = dist.HashStore()
    out: dict = {}
    errors: dict[int, BaseException] = {}

    def run(member: int, *args, **kwargs) -> None:
        try:
            _train(store, member, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            errors[member] = exc

    threads = [threading.Thread(target=run, args=(m, 40, (0, 1)), kwargs={"out": out}, daemon=True) for m in (0, 1)]
    for t in threads:
        t.start()
    bad = threading.Thread(target=run, args=(5, 40, None), kwargs={"dim": DIM + 1}, daemon=True)
    bad.start()
    for t in (*threads, bad):
        t.join(60)
    assert isinstance(errors.get(5), ElasticJoinError), errors
    assert "weight:1x7:float32" in str(errors[5]) and "weight:1x6:float32" in str(errors[5])
    assert set(errors) == {5}
    assert out[0]["committed"] == out[1]["committed"] == 40
    assert torch.equal(out[0]["params"], out[1]["params"])


def test_leaving_an_epoch_fails_the_peers_collective_at_once() -> None:
    """Regression (churn run): rank 0's allreduce failed on a peer only it saw die (no abort
    notice for a lost peer); its goodbye must fail rank 1's run of that allreduce at once,
    although rank 0 had called it, instead of leaving rank 1 waiting for its timeout."""
    import mlfabric
    from mlfabric.errors import PeerLeftError, PeerLostError
    from mlfabric.runtime.elastic import _say_goodbye

    comms = mlfabric.local_world(3, timeout=30)
    try:
        futures = [comms[r].allreduce_async(torch.ones(4)) for r in (0, 1)]  # rank 2 never calls
        time.sleep(0.1)
        comms[0].transport._peer_lost(2, "seen dead by rank 0 only")
        with pytest.raises(PeerLostError):
            futures[0].wait()
        start = time.monotonic()
        _say_goodbye(comms[0], "test")
        with pytest.raises(PeerLeftError, match="rank 0 left"):
            futures[1].wait()
        assert time.monotonic() - start < 5
    finally:
        for comm in comms:
            comm.close()


class _Holder:
    """A StateHolder of one float tensor."""

    def __init__(self, value: float, committed: int) -> None:
        self.data = torch.full((1000,), value)
        self.committed = committed

    def signature(self) -> str:
        return "holder:1000"

    def pack(self) -> tuple[dict, torch.Tensor]:
        return {"committed": self.committed}, self.data.view(torch.uint8)

    def unpack(self, header: dict, blob: torch.Tensor) -> None:
        self.data.copy_(blob.view(torch.float32))
        self.committed = int(header["committed"])


def test_a_survivor_that_missed_the_last_step_is_rolled_forward() -> None:
    """A step that completed on member 1 but failed on member 0 (a peer died in the middle of
    it) ends committed on both: the new epoch starts at member 1's step and member 0 receives
    member 1's state (striped over 2 senders: members 1 and 2 both committed it)."""
    from mlfabric.runtime.elastic import ElasticCommunicator

    store = dist.HashStore()
    holders = {0: _Holder(0.0, 0), 1: _Holder(0.0, 0), 2: _Holder(0.0, 0)}
    ecs: dict[int, ElasticCommunicator] = {}
    errors: list[BaseException] = []

    def start(m: int) -> None:
        try:
            ecs[m] = ElasticCommunicator(store, m, holders[m], initial=(0, 1, 2), timeout=20, chunk_bytes=1024)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def again(m: int) -> None:
        try:
            ecs[m].reconfigure("the step failed here" if m == 0 else "a peer left")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    for target in (start, again):
        threads = [threading.Thread(target=target, args=(m,), daemon=True) for m in (0, 1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        if target is start:
            for m in (1, 2):  # members 1 and 2 committed step 5, member 0 aborted it at 4
                holders[m].data.fill_(5.0)
                holders[m].committed = 5
            holders[0].data.fill_(4.0)
            holders[0].committed = 4
    try:
        assert holders[0].committed == 5 and torch.equal(holders[0].data, holders[1].data)
        change = ecs[0].history[-1]
        assert change.sources == (1, 2) and change.receivers == (0,) and change.transferred_bytes == 4000
    finally:
        for ec in ecs.values():
            ec.close()


# -- the command line's errors (check 7) ---------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--workers", "3", "--elastic", "--fail", "worker:3@1"], "worker 3 is outside the job (workers 0-2)"),
    (["--workers", "1", "--elastic"], "--elastic needs at least 2 workers"),
    (["--workers", "3", "--elastic", "--fail", "server:2"], "an elastic run kills workers"),
    (["--workers", "3", "--rejoin", "1"], "add --elastic"),
    (["--workers", "3", "--elastic", "--sync", "ps-async"], "--sync allreduce only"),
])
def test_bad_elastic_options_are_usage_errors(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from mlfabric.cli import app

    result = CliRunner().invoke(app, ["train", "--workload", "hyperplane", *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_an_elastic_run_takes_its_workloads_defaults_and_refuses_lda() -> None:
    from mlfabric.train.elastic import ElasticRunConfig
    from mlfabric.train.harness import WORKLOAD_DEFAULTS

    mlp = ElasticRunConfig(workers=2, workload="mlp")
    assert (mlp.batch_size, mlp.lr, mlp.momentum, mlp.epochs, mlp.train_samples) == (64, 0.1, 0.9, 8, 32_768)
    assert WORKLOAD_DEFAULTS["mlp"]["lr"] == mlp.lr
    hyper = ElasticRunConfig(workers=2)
    assert (hyper.workload, hyper.train_samples, hyper.epochs, hyper.batch_size) == ("hyperplane", 8192, 48, 256)
    assert ElasticRunConfig(workers=2, workload="lenet5", epochs=1).epochs == 1  # given settings stay
    with pytest.raises(ValueError, match="not 'lda'.*count updates"):
        ElasticRunConfig(workers=2, workload="lda")


def test_an_elastic_lda_run_is_a_usage_error() -> None:
    from typer.testing import CliRunner

    from mlfabric.cli import app

    result = CliRunner().invoke(app, ["train", "--workload", "lda", "--workers", "2", "--elastic"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "--elastic trains hyperplane, mlp, lenet5, lstm" in result.output


def test_several_senders_pace_their_share_of_the_nic(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the NIC rate known (MLFABRIC_NIC_RATE, as the emulator sets it), each of S senders
    paces its connection to the joiner at rate / S during the copy and lifts the cap after
    it; one sender (the first epoch's) does not pace."""
    from mlfabric.transport.tcp import TcpTransport

    calls: list[tuple[int, int, float | None]] = []
    original = TcpTransport.pace_connection

    def record(self: TcpTransport, peer: int, channel: str, rate_bps: float | None) -> bool:
        calls.append((self.rank, peer, rate_bps))
        return original(self, peer, channel, rate_bps)

    monkeypatch.setattr(TcpTransport, "pace_connection", record)
    monkeypatch.setenv("MLFABRIC_NIC_RATE", "1gbit")
    out, errors = run_members(dist.HashStore(), {0: {}, 1: {}, 2: {}, 5: {"initial": None, "start_after": 0}},
                              6, (0, 1, 2), lambda member, el: None, step_s=0.005)
    assert not errors, errors
    paced = sorted((rank, peer, rate) for rank, peer, rate in calls if rate is not None)
    assert paced == [(0, 3, pytest.approx(1e9 / 3)), (1, 3, pytest.approx(1e9 / 3)), (2, 3, pytest.approx(1e9 / 3))]
    assert sorted((rank, peer) for rank, peer, rate in calls if rate is None) == [(0, 3), (1, 3), (2, 3)]
    assert all(torch.equal(out[0]["params"], out[m]["params"]) for m in (1, 2, 5))


def test_a_member_that_registers_and_leaves_during_the_check_is_not_left_out() -> None:
    """Regression (the emulated transfer runs, 2 of 9 left a sender out): member 0 registers
    for epoch 1 and says goodbye to epoch 0 while member 1 is checking the quorum. Member 1
    reading the registrations before asking who is gone saw 0 gone but not registered and
    closed epoch 1 without it; reading who is gone first, it sees 0's registration."""
    ms = MembershipStore(dist.HashStore(), "t")

    def zero_registers_then_leaves() -> set[int]:
        if ms.registration(1, 0) is None:
            ms.register(1, 0, step=4, signature="s", joiner=False)
        return {0}

    won = agree(ms, 1, 1, previous=(0, 1), gone=zero_registers_then_leaves, step=4, signature="s", joiner=False,
                timeout=5.0, grace_s=10.0)
    assert won is not None and won.members == (0, 1) and won.steps == {0: 4, 1: 4}


def _record_algorithms(seen: dict) -> Callable[[int, Elastic], None]:
    """A patch that records, per member, (epoch, the allreduce the step ran) at every step."""
    def patch(member: int, el: Elastic) -> None:
        original = el.comm.algorithm_for

        def record(wanted: str) -> str:
            got = original(wanted)
            seen.setdefault(member, []).append((el.comm.epoch, got))
            return got
        el.comm.algorithm_for = record  # type: ignore[method-assign]
    return patch


def test_bcube_falls_back_to_ring_while_a_host_is_missing_and_returns_after_the_rejoin(
        caplog: pytest.LogCaptureFixture) -> None:
    """Four members on BCube(2,2) (member i on host i) allreduce with BML; member 3 leaves:
    the three that remain are not a BCube, so their epoch runs ring (logged once); member 3
    comes back and the full membership runs bcube again. All end with the same parameters."""
    seen: dict = {}
    out, errors = run_members(dist.HashStore(), {0: {}, 1: {}, 2: {}, 3: {"leave_at": 4, "rejoin_after": 1}}, 24,
                              (0, 1, 2, 3), _record_algorithms(seen), step_s=0.02,
                              options={"algorithm": "bcube", "topology": "bcube:n=2,k=2"})
    assert not errors, errors
    runs = {}
    for epoch, algorithm in seen[0]:
        runs.setdefault(epoch, set()).add(algorithm)
    members = {c.epoch: c.members for c in out[0]["history"]}
    assert runs[0] == {"bcube"} and members[0] == (0, 1, 2, 3)
    assert runs[1] == {"ring"} and members[1] == (0, 1, 2)
    last = max(runs)
    assert runs[last] == {"bcube"} and members[last] == (0, 1, 2, 3), (runs, members)
    assert caplog.text.count("membership epoch 1 runs ring instead of bcube (members [0, 1, 2] are not the hosts "
                             "of bcube:n=2,k=2)") == 3  # once per member of that epoch
    assert all(torch.equal(out[0]["params"], out[m]["params"]) for m in (1, 2, 3))


def test_host_hierarchical_runs_over_the_hosts_that_remain() -> None:
    """Members 0, 1 on host 0 and 2, 3 on host 1 reduce host by host; member 3 leaves: the
    epoch of 0, 1, 2 still runs host_hierarchical, over hosts [0, 0, 1]."""
    seen: dict = {}
    hosts_seen: list = []

    def patch(member: int, el: Elastic) -> None:
        _record_algorithms(seen)(member, el)
        if member == 0:
            original = el.comm._connect

            def connect(membership: Membership):  # type: ignore[no-untyped-def]
                comm = original(membership)
                hosts_seen.append((membership.epoch, comm.hosts))
                return comm
            el.comm._connect = connect  # type: ignore[method-assign]

    out, errors = run_members(dist.HashStore(), {0: {}, 1: {}, 2: {}, 3: {"leave_at": 4}}, 12, (0, 1, 2, 3), patch,
                              options={"algorithm": "host_hierarchical", "hosts": {0: 0, 1: 0, 2: 1, 3: 1}})
    assert set(errors) == {3}, errors
    assert {a for _, a in seen[0]} == {"host_hierarchical"}
    assert (1, (0, 0, 1)) in hosts_seen, hosts_seen
    assert torch.equal(out[0]["params"], out[1]["params"]) and torch.equal(out[0]["params"], out[2]["params"])


def test_an_elastic_run_past_its_timeout_names_the_workers_still_running() -> None:
    """Regression: the message listed log paths in a temporary directory removed with the
    error; it carries the still-running ranks and their logs' ends instead."""
    from typer.testing import CliRunner

    from mlfabric.cli import app

    result = CliRunner().invoke(app, ["train", "--workload", "hyperplane", "--workers", "2", "--elastic", "--dim",
                                      "16", "--train-samples", "512", "--batch-size", "64", "--epochs", "1",
                                      "--timeout", "0.5"], env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    assert "did not finish within its timeout" in result.output
    assert "ranks still running: [0, 1]" in result.output and "--- rank 0 (worker0-0.log)" in result.output
