"""Issue #38 check 4: faults during recovery. A second member dies during the quorum, another
during a state transfer, the joiner itself dies mid-transfer: the others go on, and the log
names who and what; a message from an old membership is never delivered, on a bare epoch
transport and injected into a live job.

    .venv/bin/python -m pytest tests/unit/test_elastic_recovery_faults.py -q

Members are threads of this process over loopback tcp (tests/unit/elastic_members.py); one
"dies" at a chosen point by raising ``Died`` (its thread ends, its sockets close), which its
peers see as a departed peer: the path of a lost one after detection. SIGKILLed processes are
in tests/local/test_elastic_processes.py and the churn runs (docs/results.md).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from mlfabric.errors import MlfabricError
from mlfabric.runtime.elastic import ElasticCommunicator
from mlfabric.runtime.membership import Membership, MembershipStore, epoch_token
from mlfabric.torch.elastic import Elastic
from mlfabric.transport.base import encode_header
from mlfabric.transport.framing import add_frame

from tests.unit.elastic_members import Died, run_members


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "mlfabric.elastic")


def test_a_message_from_an_old_membership_is_never_delivered() -> None:
    """A connection made with epoch 0's token to an epoch-1 transport is refused at its
    handshake; the same frame with epoch 1's token is delivered (the test can fail)."""
    from mlfabric.transport.tcp import TcpTransport

    job = b"j" * 16
    live = TcpTransport(0, 2, epoch_token(job, 1))
    try:
        host, port = live.endpoints["0"].removeprefix("tcp://").rsplit(":", 1)
        for epoch in (0, 1):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(encode_header(epoch_token(job, epoch), 1, 0, 0))
                parts: list = []
                add_frame(parts, 77, b"", memoryview(b"stale" if epoch == 0 else b"fresh"), 0)
                sock.sendall(b"".join(bytes(p) for p in parts))
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    if epoch == 0 and live.rejected_messages:
                        break
                    if epoch == 1 and live.mailbox.pending():
                        break
                    time.sleep(0.01)
            if epoch == 0:
                assert live.rejected_messages == 1
                time.sleep(0.2)
                assert live.mailbox.pending() == 0
        msg = live.try_recv(77, src=1)
        assert msg is not None and bytes(msg.payload) == b"fresh"
    finally:
        live.close()


def test_a_member_that_dies_during_the_quorum_is_left_out_of_the_next_epoch(caplog: pytest.LogCaptureFixture) -> None:
    """Member 3 leaves; member 2 registers for the next epoch and dies before connecting: the
    others find it silent at connection time and form one more epoch without it."""
    def patch(member: int, el: Elastic) -> None:
        if member == 2:
            def die(membership: Membership) -> None:
                raise Died()
            el.comm._connect = die  # type: ignore[method-assign]

    plan = {0: {}, 1: {}, 2: {}, 3: {"leave_at": 5}}
    out, errors = run_members(dist.HashStore(), plan, 20, (0, 1, 2, 3), patch)
    assert set(errors) == {2, 3} and all(isinstance(e, Died) for e in errors.values()), errors
    assert torch.equal(out[0]["params"], out[1]["params"])
    # Epoch 1 (0, 1, 2) closed but never formed (member 2 never connected): epoch 2 did.
    assert [(c.epoch, c.members) for c in out[0]["history"]] == [(0, (0, 1, 2, 3)), (2, (0, 1))]
    # The log names who and what: member 3 gone from epoch 0, member 2 silent in epoch 1's setup.
    log = _warnings(caplog)
    assert re.search(r"member \d: leaving membership epoch 0 \[0, 1, 2, 3\] \(members gone: \[[\d, ]*3\]\): "
                     r"step 5 aborted: .*rank 3 left the job", log), log
    assert "member 0: membership epoch 1 [0, 1, 2] failed to form: members [2] never published their endpoints" in log, log
    assert "member 0: membership epoch 2: members [0, 1]" in log, log


def test_a_sender_that_dies_during_the_state_transfer_is_replaced_by_the_others(caplog: pytest.LogCaptureFixture) -> None:
    """A joiner's state comes from members 0, 1 and 2; member 1 dies as the transfer starts: the
    joiner and the others form the next epoch and the joiner receives the state from 0 and 2."""
    def patch(member: int, el: Elastic) -> None:
        el.comm.chunk_bytes = 8  # the 56-byte state in 7 chunks, striped over the three senders
        if member == 1:
            original = el.comm._sync

            def die_when_sending(comm, membership):  # type: ignore[no-untyped-def]
                if membership.receivers():
                    comm.transport.close(b"")  # dies: its peers lose it mid-transfer
                    raise Died()
                return original(comm, membership)
            el.comm._sync = die_when_sending  # type: ignore[method-assign]

    plan = {0: {}, 1: {}, 2: {}, 5: {"initial": None, "start_after": 0}}
    out, errors = run_members(dist.HashStore(), plan, 30, (0, 1, 2), patch)
    assert set(errors) == {1} and isinstance(errors[1], Died), errors
    assert torch.equal(out[0]["params"], out[2]["params"]) and torch.equal(out[0]["params"], out[5]["params"])
    joined = out[5]["history"][0]
    assert joined.members == (0, 2, 5) and set(joined.sources) == {0, 2} and joined.receivers == (5,)
    # Who sees the failure first varies (the joiner waiting for member 1's description, or a
    # sender in the copy); each line names member 1 and what broke.
    log = _warnings(caplog)
    assert re.search(r"member \d: state transfer in membership epoch 1 failed: (the state transfer from \[0, 1, 2\] "
                     r"to \[5\] broke: .* rank 1 left the job .* members \[0, 1, 2, 5\], in that order"
                     r"|members \[1\] left before describing their state)", log), log
    assert "member 5: membership epoch 2: members [0, 2, 5]" in log, log


def test_a_member_that_never_dials_its_peers_is_left_out_within_the_connect_bound() -> None:
    """Regression (churn run): a member that dies (here: hangs) after publishing its endpoints
    but before dialling its peers is invisible to them; without the connection barrier they
    waited for the collective timeout. Now the epoch fails within 2 x connect_s and the next
    one forms without it."""
    from mlfabric.transport.tcp import TcpTransport

    zombies: list[TcpTransport] = []

    def patch(member: int, el: Elastic) -> None:
        if member == 1:
            def hang(membership: Membership) -> None:
                transport = TcpTransport(membership.rank_of(1), membership.world_size,
                                         epoch_token(el.comm.token, membership.epoch))
                zombies.append(transport)
                el.comm.ms.publish(membership.epoch, 1, "endpoints", json.dumps(transport.endpoints))
                raise Died()
            el.comm._connect = hang  # type: ignore[method-assign]

    start = time.monotonic()
    try:
        out, errors = run_members(dist.HashStore(), {0: {}, 1: {}, 2: {}, 3: {"leave_at": 3}}, 10, (0, 1, 2, 3),
                                   patch)
    finally:
        for transport in zombies:
            transport.close()
    assert set(errors) == {1, 3}, errors
    assert [c.members for c in out[0]["history"]] == [(0, 1, 2, 3), (0, 2)]
    assert torch.equal(out[0]["params"], out[2]["params"])
    assert time.monotonic() - start < 18  # the collective timeout (20 s) was not waited for


def test_the_joiner_that_dies_mid_transfer_is_left_out_and_the_members_go_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Joiner 5 receives its state striped over members 0, 1 and 2 (one 8-byte chunk each, in
    turn); member 0 sends at once, members 1 and 2 a little later. The joiner dies once member
    0's chunks are in and the others' are not: the senders that were still sending fail the
    transfer, every member forms the next epoch without the joiner, and all three finish with
    the same parameters."""
    seen: dict[str, int] = {}
    original_sync = ElasticCommunicator._sync

    def sync(self: ElasticCommunicator, comm, membership: Membership):  # type: ignore[no-untyped-def]
        if 5 not in membership.members or not membership.receivers():
            return original_sync(self, comm, membership)
        real_copy = comm.striped_copy
        if self.member == 5:
            def copy_and_die(blob, sources, receivers, **kw):  # type: ignore[no-untyped-def]
                blob.zero_()
                done = threading.Event()

                def die_when_member_0s_part_is_in() -> None:
                    deadline = time.monotonic() + 10
                    while not done.is_set() and time.monotonic() < deadline:
                        if blob[:8].any():  # chunk 0 comes from member 0
                            seen["received"] = int(blob.view(-1, 8).any(dim=1).sum()) * 8
                            seen["total"] = blob.numel()
                            comm.close(reason="it died (test)")  # its sockets close mid-transfer
                            return
                        time.sleep(0.001)
                watcher = threading.Thread(target=die_when_member_0s_part_is_in, daemon=True)
                watcher.start()
                try:
                    return real_copy(blob, sources, receivers, **kw)
                finally:
                    done.set()
                    watcher.join(10)
            comm.striped_copy = copy_and_die
            try:
                return original_sync(self, comm, membership)
            except MlfabricError as exc:
                raise Died() from exc
        if self.member in (1, 2):
            def late_copy(*args, **kw):  # type: ignore[no-untyped-def]
                time.sleep(0.5)  # the joiner dies in between
                return real_copy(*args, **kw)
            comm.striped_copy = late_copy
        return original_sync(self, comm, membership)

    monkeypatch.setattr(ElasticCommunicator, "_sync", sync)

    def patch(member: int, el: Elastic) -> None:
        el.comm.chunk_bytes = 8  # the 56-byte state in 7 chunks: 0, 3, 6 from member 0

    plan = {0: {}, 1: {}, 2: {}, 5: {"initial": None, "start_after": 0}}
    out, errors = run_members(dist.HashStore(), plan, 30, (0, 1, 2), patch, step_s=0.01)
    assert set(errors) == {5} and isinstance(errors[5], Died), errors
    assert 0 < seen["received"] < seen["total"] == 56, seen  # it died mid-transfer
    assert torch.equal(out[0]["params"], out[1]["params"]) and torch.equal(out[0]["params"], out[2]["params"])
    assert [c.members for c in out[1]["history"]][-1] == (0, 1, 2)
    log = _warnings(caplog)
    assert re.search(r"member [12]: state transfer in membership epoch 1 failed: the state transfer from "
                     r"\[0, 1, 2\] to \[5\] broke: .*rank 3 left the job \(it died \(test\).* members "
                     r"\[0, 1, 2, 5\], in that order", log), log
    assert "(members gone: [5])" in log, log
    assert "member 1: membership epoch 2: members [0, 1, 2]" in log, log


def test_a_message_of_an_old_membership_injected_into_a_live_job_is_never_delivered() -> None:
    """While members 0 and 1 train in membership epoch 1 (member 2 left at step 3), a
    connection made with epoch 0's token (an old member's) reaches member 0's live epoch-1
    transport and sends a frame on the tag the step allreduces use: it is refused at the
    handshake, nothing of it reaches the mailbox, and the members finish equal."""
    store = dist.HashStore()
    live: dict[int, Elastic] = {}

    def patch(member: int, el: Elastic) -> None:
        live[member] = el

    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(zip(("out", "errors"), run_members(
        store, {0: {}, 1: {}, 2: {"leave_at": 3}}, 80, (0, 1, 2), patch, step_s=0.02))), daemon=True)
    runner.start()
    ms = MembershipStore(store)
    deadline = time.monotonic() + 30
    while ms.current_epoch() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ms.current_epoch() == 1
    while (0 not in live or live[0].comm.epoch != 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    transport = live[0].comm.comm.transport
    endpoints = json.loads(ms.read(1, 0, "endpoints") or "{}")
    host, port = next(iter(endpoints.values())).removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(encode_header(epoch_token(ms.job_token(), 0), 1, 0, 0))
        parts: list = []
        add_frame(parts, 1, b"", memoryview(torch.full((8,), 1e6).numpy().tobytes()), 0)
        sock.sendall(b"".join(bytes(p) for p in parts))
        while transport.rejected_messages == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert transport.rejected_messages == 1
    runner.join(90)
    assert not runner.is_alive()
    out, errors = result["out"], result["errors"]
    assert set(errors) == {2} and isinstance(errors[2], Died), errors
    assert torch.equal(out[0]["params"], out[1]["params"]) and torch.isfinite(out[0]["params"]).all()
    assert [c.members for c in out[0]["history"]] == [(0, 1, 2), (0, 1)]
