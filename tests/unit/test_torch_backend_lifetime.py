"""The "mlfabric" process group's lifetime: errored(), abort() and shutdown(), and DDP over the
elastic group (mlfabric.torch.Elastic.ddp()).

    .venv/bin/python -m pytest tests/unit/test_torch_backend_lifetime.py -q

Ranks are threads of this process over loopback tcp (``mlfabric.local_world``); the elastic
members share an in-memory store. Real processes under torchrun with a SIGKILL are in
tests/local/test_elastic_processes.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mlfabric
from mlfabric.errors import CollectiveError, PeerLeftError, PeerLostError
from mlfabric.runtime.membership import MembershipStore
from mlfabric.torch import ProcessGroupMlfabric, ProcessGroupOptions
from mlfabric.torch.elastic import Elastic, ElasticProcessGroup


def _groups(n: int) -> list[ProcessGroupMlfabric]:
    return [ProcessGroupMlfabric(c, ProcessGroupOptions().resolved()) for c in mlfabric.local_world(n, timeout=30)]


def test_errored_is_none_while_healthy_and_names_the_peer_after_an_abort() -> None:
    pgs = _groups(3)
    try:
        assert [pg.errored() for pg in pgs] == [None, None, None]
        works = [pgs[r].allreduce([torch.ones(4)]) for r in (0, 1)]  # rank 2 never calls it
        time.sleep(0.1)
        start = time.monotonic()
        pgs[2].abort()
        assert time.monotonic() - start < 1.0  # returns at once, does not wait for the collective
        for work in works:
            with pytest.raises(PeerLeftError, match="rank 2 left the job .the process group was aborted"):
                work.wait()
        for r in (0, 1):
            err = pgs[r].errored()
            assert isinstance(err, PeerLeftError) and err.peer == 2, err
        assert isinstance(pgs[2].errored(), CollectiveError) and "aborted" in str(pgs[2].errored())
    finally:
        for pg in pgs:
            pg.shutdown()


def test_abort_fails_this_ranks_pending_operations_and_later_calls_clearly() -> None:
    pgs = _groups(2)
    try:
        recv = pgs[0].recv([torch.zeros(3)], 1, 0)
        pgs[0].abort()
        with pytest.raises(CollectiveError, match="receive from peer 1 .* did not complete: the process group was aborted"):
            recv.wait()
        with pytest.raises(CollectiveError, match="communicator is closed"):
            pgs[0].allreduce([torch.ones(2)]).wait()
        # The peer learns it without running anything.
        err = pgs[1].errored()
        assert isinstance(err, PeerLostError) and err.peer == 0 and "group rank 0 left" in str(err)
    finally:
        for pg in pgs:
            pg.shutdown()


def test_shutdown_and_abort_are_idempotent_in_any_order() -> None:
    pgs = _groups(2)
    pgs[1].comm.transport._peer_lost(0, "killed (test)")  # a peer lost, nothing in flight
    err = pgs[1].errored()
    assert isinstance(err, PeerLostError) and "group rank 0 was lost (killed (test))" in str(err)
    for pg in pgs:
        assert pg.shutdown() is None and pg.abort() is None and pg.shutdown() is None


# -- DDP over the elastic group ----------------------------------------------------------------

DIM = 6


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 7)
    x = torch.randn(12, DIM, generator=gen)
    y = x.sum(1, keepdim=True)
    part = torch.arange(12)[rank::world]  # 12 splits evenly over 1, 2 and 3 ranks
    return x[part], y[part]


def _ddp_member(store: dist.Store, member: int, steps: int, out: dict, errors: dict, *,
                leave_at: int | None = None, abort_at: int | None = None) -> None:
    try:
        model = nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 1))
        # Seeded per parameter, not through torch's global generator: the members are threads
        # sharing it, and the reference run must start from the same parameters.
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        el = Elastic(model, opt, store=store, member=member, initial=(0, 1, 2), timeout=20, grace_s=3)
        ddp = el.ddp()
        group = el.process_group
        committed, errored_seen = [], []
        while el.committed < steps:
            if leave_at is not None and el.committed == leave_at:
                group.shutdown()  # leaves the job; the others go on
                out[member] = {"left": True}
                return
            if abort_at is not None and el.committed == abort_at:
                abort_at = None
                group.abort()  # this epoch's operations fail: the step aborts everywhere
            x, y = _batch(el.committed, el.rank, el.world_size)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            if group.errored() is not None:
                errored_seen.append(el.committed)
            committed.append(el.step())
        out[member] = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(),
                       "members": [c.members for c in el.comm.history], "aborted": el.aborted,
                       "errored_seen": errored_seen,
                       "size": group.size(), "repr": repr(group)}
        el.finish()
        el.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors[member] = exc


def test_ddp_on_the_elastic_group_survives_a_departure_and_a_rejoin() -> None:
    """DDP over ElasticProcessGroup: member 2 leaves (shutdown()) at step 8, the others go on as
    two, member 2 comes back (the same arguments: it joins) and all three end equal, and equal
    to a run of the same DDP training with no departure."""
    store = dist.HashStore()
    out: dict = {}
    errors: dict = {}
    threads = [threading.Thread(target=_ddp_member, args=(store, m, 30, out, errors),
                                kwargs={"leave_at": 8 if m == 2 else None}, daemon=True) for m in (0, 1, 2)]
    for t in threads:
        t.start()
    threads[2].join(30)
    ms = MembershipStore(store)
    deadline = time.monotonic() + 30
    while ms.current_epoch() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ms.current_epoch() >= 1, "the survivors did not form a membership without member 2"
    out.pop(2)
    joiner = threading.Thread(target=_ddp_member, args=(store, 2, 30, out, errors), daemon=True)
    joiner.start()
    for t in (*threads, joiner):
        t.join(90)
    assert not errors, errors
    assert torch.equal(out[0]["params"], out[1]["params"]) and torch.equal(out[0]["params"], out[2]["params"])
    assert out[0]["members"][0] == (0, 1, 2) and (0, 1) in out[0]["members"] and out[0]["members"][-1] == (0, 1, 2)
    assert out[0]["aborted"] == 1 and out[2]["aborted"] == 0
    assert all(out[m]["size"] == 3 for m in (0, 1, 2))
    # errored() said so at the failed step only (checked after each backward), then None again.
    assert set(out[0]["errored_seen"]) <= {8} and set(out[1]["errored_seen"]) <= {8} and out[2]["errored_seen"] == []
    assert "ElasticProcessGroup(member=0" in out[0]["repr"]

    ref: dict = {}
    store2 = dist.HashStore()
    ref_threads = [threading.Thread(target=_ddp_member, args=(store2, m, 30, ref, errors), daemon=True)
                   for m in (0, 1, 2)]
    for t in ref_threads:
        t.start()
    for t in ref_threads:
        t.join(90)
    assert not errors, errors
    assert ref[0]["aborted"] == 0
    torch.testing.assert_close(ref[0]["params"], out[0]["params"], atol=1e-5, rtol=0)


def test_aborting_the_elastic_group_aborts_the_step_and_the_members_go_on() -> None:
    """abort() on member 1's elastic group at step 5: that step aborts on every member (member
    1's own buckets fail at once, the others' when it leaves the epoch), errored() says so
    until the next membership, and all three go on together (member 1 through a join: its
    peers saw it leave the epoch)."""
    store = dist.HashStore()
    out: dict = {}
    errors: dict = {}
    threads = [threading.Thread(target=_ddp_member, args=(store, m, 12, out, errors),
                                kwargs={"abort_at": 5 if m == 1 else None}, daemon=True) for m in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert torch.equal(out[0]["params"], out[1]["params"]) and torch.equal(out[0]["params"], out[2]["params"])
    assert out[1]["errored_seen"] == [5] and out[1]["aborted"] == 1
    assert out[0]["members"][-1] == (0, 1, 2) and len(out[0]["members"]) >= 2
    assert out[1]["members"][-1] == (0, 1, 2)
    assert set(out[0]["errored_seen"]) <= {5} and set(out[2]["errored_seen"]) <= {5}


def test_ddp_refuses_what_the_elastic_group_sets_itself() -> None:
    store = dist.HashStore()
    model = nn.Linear(3, 1)
    el = Elastic(model, torch.optim.SGD(model.parameters(), lr=0.1), store=store, member=0, initial=(0,), timeout=5)
    try:
        with pytest.raises(ValueError, match="sets \\['init_sync'\\] itself"):
            el.ddp(init_sync=True)
        assert isinstance(el.process_group, ElasticProcessGroup) and el.process_group.size() == 1
        el.ddp()
        with pytest.raises(ValueError, match="weight"):
            el.step(weight=4.0)
    finally:
        el.close()
