"""The gradient partition orders of mlfabric.order.gradients (ByteScheduler-style).

Run: python -m pytest tests/unit/test_order_gradients.py
"""

from __future__ import annotations

import pytest

from mlfabric.order.gradients import Partition, fifo_order, finish_times, partition_params, priority_order


def test_partitions_cut_each_parameter_in_order_and_cover_it() -> None:
    parts = partition_params([("w", 10, 4), ("b", 3, 4)], partition_bytes=16)
    assert [(p.param, p.offset, p.numel, p.nbytes) for p in parts] == [
        ("w", 0, 4, 16), ("w", 4, 4, 16), ("w", 8, 2, 8), ("b", 0, 3, 12)]
    # A partition smaller than one element still carries one element.
    assert [p.numel for p in partition_params([("x", 3, 8)], partition_bytes=5)] == [1, 1, 1]


@pytest.mark.parametrize("params, size, match", [
    ([("w", 4, 4)], 0, "partition_bytes"),
    ([("w", 4, 4), ("w", 2, 4)], 8, "repeat"),
    ([("w", 0, 4)], 8, "0 elements"),
])
def test_partition_params_rejects_bad_input(params, size, match) -> None:
    with pytest.raises(ValueError, match=match):
        partition_params(params, size)


# A 3-layer net: the backward hands over c (big, 4 partitions) first, then b, then a (the
# layer the next forward needs first). Each partition holds the link 1 s.
PARTS = partition_params([("a", 1, 4), ("b", 1, 4), ("c", 4, 4)], partition_bytes=4)
READY = {"c": 0.0, "b": 0.5, "a": 1.5}
PRIORITY = {"a": 0, "b": 1, "c": 2}


def one_second(_: Partition) -> float:
    return 1.0


def test_fifo_serves_in_backward_order() -> None:
    assert [p.param for p in fifo_order(PARTS, READY)] == ["c", "c", "c", "c", "b", "a"]


def test_priority_lets_the_first_layer_overtake_the_queue() -> None:
    order = priority_order(PARTS, READY, PRIORITY, one_second)
    # t=0 only c is ready; t=1 b is (c's 3 others wait); t=2 a is.
    assert [p.param for p in order] == ["c", "b", "a", "c", "c", "c"]
    assert [p.offset for p in order if p.param == "c"] == [0, 1, 2, 3]
    fifo, prio = finish_times(fifo_order(PARTS, READY), READY, one_second), finish_times(order, READY, one_second)
    # a, the first layer, is reduced at 3 s instead of 6 s; the last one finishes as late as before.
    assert (fifo["a"], prio["a"]) == (6.0, 3.0)
    assert max(fifo.values()) == max(prio.values()) == 6.0


def test_priority_waits_for_late_gradients_and_breaks_ties_by_ready_time() -> None:
    parts = partition_params([("x", 1, 4), ("y", 1, 4), ("z", 1, 4)], partition_bytes=4)
    ready = {"x": 5.0, "y": 0.0, "z": 0.0}
    order = priority_order(parts, ready, {"x": 0, "y": 1, "z": 1}, one_second)
    # y and z tie (one TIO level): the model's order decides; x is not ready until 5 s.
    assert [p.param for p in order] == ["y", "z", "x"]
    assert finish_times(order, ready, one_second) == {"y": 1.0, "z": 2.0, "x": 6.0}


def test_orders_need_a_time_and_priority_for_every_parameter() -> None:
    with pytest.raises(ValueError, match="no ready time"):
        fifo_order(PARTS, {"a": 0.0})
    with pytest.raises(ValueError, match="no priority"):
        priority_order(PARTS, READY, {"a": 0}, one_second)
