"""Point-to-point sends and receives (runtime/p2p.py) on the in-process transport: matching
order, any-source receives, dtypes and layouts, and errors that name the peer in bounded time.

    python -m pytest tests/unit/test_p2p.py -q
"""

from __future__ import annotations

import time

import pytest
import torch

from mlfabric.errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from mlfabric.runtime.p2p import MAX_TAG, PointToPoint
from mlfabric.transport.local import LocalFabric


@pytest.fixture()
def pair() -> list[PointToPoint]:
    transports = LocalFabric(3).transports()
    endpoints = [PointToPoint(t, timeout=5) for t in transports]
    yield endpoints
    for p2p in endpoints:
        p2p.close()
    for t in transports:
        t.close()


def test_messages_of_one_tag_match_in_order_and_tags_apart(pair: list[PointToPoint]) -> None:
    a, b, _ = pair
    # Receives posted first, out of tag order: each takes its own tag's messages, in order.
    outs = {(tag, k): torch.zeros(3) for tag in (1, 2) for k in range(2)}
    posted = [(2, 0), (1, 0), (1, 1), (2, 1)]  # (tag, k): the k-th receive of that tag
    futures = {key: b.recv_async(outs[key], 0, tag=key[0]) for key in posted}
    for k in range(2):
        for tag in (2, 1):
            a.send_async(torch.full((3,), 10.0 * tag + k), 1, tag=tag).wait()
    for key, future in futures.items():
        assert future.wait() == 0  # the source rank
        assert outs[key].tolist() == [10.0 * key[0] + key[1]] * 3


def test_any_source_receive_names_the_sender(pair: list[PointToPoint]) -> None:
    _, b, c = pair
    out = torch.zeros(2, dtype=torch.int64)
    future = b.recv_async(out, None, tag=MAX_TAG)
    c.send_async(torch.tensor([7, 8]), 1, tag=MAX_TAG)
    assert future.wait() == 2 and out.tolist() == [7, 8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.complex64])
def test_dtypes_and_non_contiguous_tensors_arrive_whole(pair: list[PointToPoint], dtype: torch.dtype) -> None:
    a, b, _ = pair
    source = (torch.arange(12).view(3, 4) % 5).to(dtype).t()  # non-contiguous on both sides
    out = torch.zeros(4, 3, dtype=dtype).t().contiguous().t()
    assert not source.is_contiguous() and not out.is_contiguous()
    b_future = b.recv_async(out, 0)
    a.send_async(source, 1).wait()
    b_future.wait()
    assert torch.equal(out, source)


def test_size_or_dtype_mismatch_names_the_peer(pair: list[PointToPoint]) -> None:
    a, b, _ = pair
    a.send_async(torch.zeros(3), 1, tag=4)
    with pytest.raises(CollectiveMismatchError, match=r"rank 1: receive from peer 0 \(tag 4\) expected 2 x float32"):
        b.recv_async(torch.zeros(2), 0, tag=4).wait()
    a.send_async(torch.zeros(2, dtype=torch.int32), 1, tag=4)
    with pytest.raises(CollectiveMismatchError, match="bytes of int32"):
        b.recv_async(torch.zeros(2), 0, tag=4).wait()


def test_unmatched_receive_times_out_on_time(pair: list[PointToPoint]) -> None:
    _, b, _ = pair
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"rank 1: receive from peer 2 \(tag 9, 1 x float32\) timed out"):
        b.recv_async(torch.zeros(1), 2, tag=9, timeout=0.5).wait()
    assert 0.5 <= time.monotonic() - start < 1.5


def test_receive_from_a_peer_that_left_fails_at_once() -> None:
    fabric = LocalFabric(2)
    t0, t1 = fabric.transports()
    p2p = PointToPoint(t1, timeout=30)
    future = p2p.recv_async(torch.zeros(1), 0)
    start = time.monotonic()
    t0.close()  # a goodbye: rank 0 left on purpose
    with pytest.raises(PeerLostError, match="peer 0 is gone"):
        future.wait()
    assert time.monotonic() - start < 1.0  # not the 30 s timeout
    p2p.close()
    t1.close()


def test_bad_arguments_are_refused(pair: list[PointToPoint]) -> None:
    a = pair[0]
    with pytest.raises(ValueError, match="tag -1 is outside"):
        a.send_async(torch.zeros(1), 1, tag=-1)
    with pytest.raises(ValueError, match="cannot send to peer 0"):
        a.send_async(torch.zeros(1), 0)
    with pytest.raises(ValueError, match="cannot receive from peer 3"):
        a.recv_async(torch.zeros(1), 3)


def test_close_fails_what_is_pending(pair: list[PointToPoint]) -> None:
    b = pair[1]
    future = b.recv_async(torch.zeros(1), 0)
    b.close()
    with pytest.raises(Exception, match="shut down"):
        future.wait()
