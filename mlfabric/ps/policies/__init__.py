"""The parameter server's policies, one module each, behind the seam of :mod:`mlfabric.ps.policy`.

    .venv/bin/python -m pytest tests/unit/test_ps_policy.py tests/unit/test_ps_scheduled.py -q

* :mod:`~mlfabric.ps.policies.direct` -- ``direct`` (BASELINE in MLNET, vanilla Async in MLfabric);
* :mod:`~mlfabric.ps.policies.mlnet` -- ``mlnet``: MLNET's aggregation / multicast trees;
* :mod:`~mlfabric.ps.policies.scheduled` -- ``scheduled``: MLfabric's scheduler, split by role
  (settings, the sans-I/O cores, the scheduler service, the worker side, the server side,
  the aggregator);
* :mod:`~mlfabric.ps.policies.ordered` -- TicTac's ordered pulls (a pull policy every server runs);
* :mod:`~mlfabric.ps.policies.replication` -- the replication feeds: chain, and MLfabric's
  network replication.

This package imports none of them: :func:`mlfabric.ps.policy.policy_factory` imports a
built-in policy's module when its name is first asked for, and the module registers itself.
"""
