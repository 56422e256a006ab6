"""The gradient partition orders of mlfabric.order.gradients (ByteScheduler-style).

Run: python -m pytest tests/unit/test_order_gradients.py
"""

from __future__ import annotations

import pytest

from mlfabric.order.gradients import (Partition, fifo_order, finish_times, partition_params, predicted_step,
                                      priority_order)

F32 = "float32"


def test_large_parameters_are_cut_and_small_consecutive_ones_fused() -> None:
    parts = partition_params([("w", 10, 4, F32), ("b", 1, 4, F32), ("c", 2, 4, F32), ("d", 3, 4, F32)],
                             partition_bytes=16)
    assert [(p.segments, p.nbytes) for p in parts] == [
        ((("w", 0, 4),), 16), ((("w", 4, 4),), 16), ((("w", 8, 2),), 8),   # w: 40 bytes in 16-byte pieces
        ((("b", 0, 1), ("c", 0, 2)), 12),                                  # b + c fit in 16 bytes
        ((("d", 0, 3),), 12)]                                              # d would overflow them
    assert [p.name for p in parts] == ["w[0:4]", "w[4:8]", "w[8:10]", "b+c", "d[0:3]"]
    assert parts[3].params == ("b", "c")
    # A partition smaller than one element still carries one element.
    assert [p.segments[0][2] for p in partition_params([("x", 3, 8, "float64")], partition_bytes=5)] == [1, 1, 1]


def test_only_one_dtype_is_fused() -> None:
    parts = partition_params([("a", 1, 4, F32), ("b", 1, 4, "int32"), ("c", 1, 4, "int32")], partition_bytes=64)
    assert [p.params for p in parts] == [("a",), ("b", "c")]


@pytest.mark.parametrize("params, size, match", [
    ([("w", 4, 4, F32)], 0, "partition_bytes"),
    ([("w", 4, 4, F32), ("w", 2, 4, F32)], 8, "repeat"),
    ([("w", 0, 4, F32)], 8, "0 elements"),
])
def test_partition_params_rejects_bad_input(params, size, match) -> None:
    with pytest.raises(ValueError, match=match):
        partition_params(params, size)


# A 3-layer net: the backward hands over c (big, 4 partitions) first, then b, then a (the
# layer the next forward needs first). Each partition holds the link 1 s.
PARTS = partition_params([("a", 1, 4, F32), ("b", 1, 4, F32), ("c", 4, 4, F32)], partition_bytes=4)
READY = {"c": 0.0, "b": 0.5, "a": 1.5}
PRIORITY = {"a": 0, "b": 1, "c": 2}


def one_second(_: Partition) -> float:
    return 1.0


def test_fifo_serves_in_backward_order() -> None:
    assert [p.params[0] for p in fifo_order(PARTS, READY)] == ["c", "c", "c", "c", "b", "a"]


def test_priority_lets_the_first_layer_overtake_the_queue() -> None:
    order = priority_order(PARTS, READY, PRIORITY, one_second)
    # t=0 only c is ready; t=1 b is (c's 3 others wait); t=2 a is.
    assert [p.params[0] for p in order] == ["c", "b", "a", "c", "c", "c"]
    assert [p.segments[0][1] for p in order if p.params == ("c",)] == [0, 1, 2, 3]
    fifo, prio = finish_times(fifo_order(PARTS, READY), READY, one_second), finish_times(order, READY, one_second)
    # a, the first layer, is reduced at 3 s instead of 6 s; the last one finishes as late as before.
    assert (fifo["a"], prio["a"]) == (6.0, 3.0)
    assert max(fifo.values()) == max(prio.values()) == 6.0


def test_a_fused_partition_waits_for_its_last_gradient_and_has_its_most_urgent_priority() -> None:
    parts = partition_params([("a", 1, 4, F32), ("b", 1, 4, F32), ("c", 6, 4, F32)], partition_bytes=8)
    assert [p.params for p in parts] == [("a", "b"), ("c",), ("c",), ("c",)]
    order = priority_order(parts, READY, PRIORITY, one_second)
    # a+b is ready at 1.5 s (a's time, not b's 0.5 s), with a's priority: at 2 s it
    # overtakes c's last piece.
    assert [p.name for p in order] == ["c[0:2]", "c[2:4]", "a+b", "c[4:6]"]
    assert finish_times(order, READY, one_second) == {"c": 4.0, "a": 3.0, "b": 3.0}


def test_priority_waits_for_late_gradients_and_breaks_ties_by_ready_time() -> None:
    parts = partition_params([("x", 1, 4, F32), ("y", 1, 4, F32), ("z", 1, 4, F32)], partition_bytes=4)
    ready = {"x": 5.0, "y": 0.0, "z": 0.0}
    order = priority_order(parts, ready, {"x": 0, "y": 1, "z": 1}, one_second)
    # y and z tie (one TIO level): the model's order decides; x is not ready until 5 s.
    assert [p.params[0] for p in order] == ["y", "z", "x"]
    assert finish_times(order, ready, one_second) == {"y": 1.0, "z": 2.0, "x": 6.0}


def test_orders_need_a_time_and_priority_for_every_parameter() -> None:
    with pytest.raises(ValueError, match="no ready time"):
        fifo_order(PARTS, {"a": 0.0})
    with pytest.raises(ValueError, match="no priority"):
        priority_order(PARTS, READY, {"a": 0}, one_second)


def test_predicted_step_overlaps_the_next_forward_only_with_the_gate() -> None:
    # The forward: a (1 s, needs a), b (1 s), a ReLU (0.5 s, no parameters), c (1 s); the
    # backward takes 2 s.
    forward = [(1.0, ["a"]), (1.0, ["b"]), (0.5, []), (0.5, ["c"])]
    ready = {"c": 0.0, "b": 0.5, "a": 1.5}
    fifo = fifo_order(PARTS, ready)
    prio = priority_order(PARTS, ready, PRIORITY, one_second)
    # DDP: everything reduced at 6 s, then the 3 s forward.
    assert predicted_step(fifo, ready, one_second, forward, 2.0, overlap=False) == 9.0
    # fifo with the gate: a is reduced last (6 s): no better.
    assert predicted_step(fifo, ready, one_second, forward, 2.0, overlap=True) == 9.0
    # priority: a at 3 s, b at 2 s, c at 6 s: a runs 3-4, b 4-5, the ReLU 5-5.5, c waits
    # until 6: 6.5 s.
    assert predicted_step(prio, ready, one_second, forward, 2.0, overlap=True) == 6.5
    # With a free link (no transfer time) the backward and forward alone remain.
    assert predicted_step(prio, ready, lambda _: 0.0, forward, 2.0, overlap=True) == 5.0


def test_tio_follows_the_first_use_where_bytescheduler_follows_the_declaration() -> None:
    """ByteScheduler's priority is a parameter's index in model.parameters(); a model that
    declares its head before its body gets the head's gradient first. TIO's, from the DAG
    the forward runs, puts the body first."""
    import torch
    from torch import nn

    from mlfabric.order import parameter_priorities

    class HeadFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 2)
            self.body = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.body(x)))

    model = HeadFirst()
    declared = [k for k, _ in model.named_parameters()]
    prio = parameter_priorities(model, (torch.randn(2, 4),))
    assert declared == ["head.weight", "head.bias", "body.weight", "body.bias"]
    assert sorted(prio, key=lambda k: (prio[k], declared.index(k))) == [
        "body.weight", "body.bias", "head.weight", "head.bias"]
