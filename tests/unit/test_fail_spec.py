"""``--fail``: one parser for every form (mlfabric.train.failover.parse_fail), used by the
parameter server's failover runs (server:AT, aggregator:AT) and by elastic runs
(worker:RANK@S[,...], churn:NxK), each of which refuses the other's forms by name.

    .venv/bin/python -m pytest tests/unit/test_fail_spec.py -q
"""

from __future__ import annotations

import pytest

from mlfabric.train.elastic import parse_churn, parse_failures
from mlfabric.train.failover import FailSpec, Failure, WorkerFailure, parse_fail


def test_every_form_parses_in_one_place() -> None:
    assert parse_fail("server:6") == FailSpec(role="server", at_s=6.0)
    assert parse_fail("aggregator:300ms").at_s == pytest.approx(0.3)
    assert parse_fail("worker:2@3,worker:1@1.5", workers=4) == FailSpec(
        role="worker", workers=(WorkerFailure(rank=1, at_s=1.5), WorkerFailure(rank=2, at_s=3.0)))
    assert parse_fail("churn:15x5") == FailSpec(role="churn", churn=(15, 5))
    with pytest.raises(ValueError, match="expected server:AT or aggregator:AT .*, or in elastic runs worker:RANK@SECONDS"):
        parse_fail("disk:3")


def test_each_caller_takes_its_own_forms_and_names_the_others() -> None:
    assert Failure.parse("server:6") == Failure(role="server", at_s=6.0)
    assert parse_failures("worker:2@3", 4) == (WorkerFailure(rank=2, at_s=3.0),)
    assert parse_churn("churn:15x5") == (15, 5) and parse_churn("worker:1@2") is None
    with pytest.raises(ValueError, match="worker: is for elastic runs"):
        Failure.parse("worker:1@2")
    with pytest.raises(ValueError, match="an elastic run kills workers.*server:AT is for the PS modes"):
        parse_failures("server:2", 3)
    with pytest.raises(ValueError, match="worker 3 is outside the job .workers 0-2."):
        parse_failures("worker:3@1", 3)
    with pytest.raises(ValueError, match="churn:NxK kills a random worker every N steps"):
        parse_churn("churn:often")
