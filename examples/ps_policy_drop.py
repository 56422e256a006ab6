"""A user-written parameter-server policy: the last worker's link loses its update every other round.

    MLFABRIC_PS_PLUGINS=examples/ps_policy_drop.py mlfabric train --workload hyperplane --workers 2 \\
        --servers 1 --sync ps-bsp,ps-bsp@drop-alternate --epochs 2 --json out.json
    .venv/bin/python -m pytest tests/local/test_ps_user_policy.py -q

How to write one (docs/parameter_server.md, "Writing a policy"): subclass
:class:`mlfabric.ps.Policy` (its defaults are the ``direct`` policy), override the hooks of the
side you change -- here the server side's :meth:`~mlfabric.ps.Policy.claim_push`, which may take
a push before the runtime applies it -- and register a factory under a name with
:func:`mlfabric.ps.register_policy`. ``PSConfig(routing="drop-alternate")`` then builds it on
every rank; through ``mlfabric train`` the mode ``ps-bsp@drop-alternate`` does, with this file
named in ``MLFABRIC_PS_PLUGINS`` so that every process of the launch imports it.

The effect is in the run's JSON (``runs[]``): under BSP a round applies the updates that came,
so ``worker_updates_applied`` is ``workers x steps - steps / 2`` and ``dropped`` is
``steps / 2``, where plain ``ps-bsp`` applies every update and drops none.
"""

from __future__ import annotations

from typing import Any

from mlfabric.ps import Policy, PSConfig, ServerPort, register_policy


class DropAlternate(Policy):
    """The ``direct`` policy, except that a server drops the last worker's pushes of odd
    clocks (as a lossy link would), counting them as dropped."""

    name = "drop-alternate"

    def claim_push(self, server: ServerPort, worker: int, header: dict[str, Any], payload: memoryview) -> bool:
        if worker == server.layout.workers - 1 and int(header["clock"]) % 2 == 1:
            server.stats.dropped += 1
            return True  # claimed: the runtime does not apply it
        return False


def _factory(config: PSConfig) -> Policy:
    return DropAlternate()


register_policy("drop-alternate", _factory, replace=True)
