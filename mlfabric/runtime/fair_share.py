"""Fair-share pacing: the rate at which each connection of a collective is paced.

Some algorithms send to several peers at once through one NIC: BML's threads send to the
``n-1`` neighbours of a level together, the P2P parameter server to all ``N-1`` peers. Their
closed form (and the simulator) assumes those flows share the NIC equally and end together.
Competing TCP flows do not: one gets ahead, finishes early, and the step waits for the
others' tail (on emulated BCube(3,2) at 500 Mbit/s, BML's step 0 over plain sockets ended
after 391-414 ms where 357 ms is what the NIC's goodput allows, docs/results.md). Pacing each
connection at its share of the NIC removes the contest: no queue builds at the shaper, no
flow loses packets, and they end together (362-364 ms in the same experiment).

A builder states each connection's share of the NIC in ``Cost.link_shares``; this module
turns shares and the NIC rate into pacing rates (pure logic), and the communicator hands the
changes to the transport (``Transport.pace_connection``; the zmq transport sets the kernel
socket's ``SO_MAX_PACING_RATE``). Without a known NIC rate nothing is paced. Caps follow the
most recently submitted collective: one that sends a single flow at a time lifts the caps on
its connections, also while an earlier asynchronous collective still uses them (that costs
the earlier one its fairness, never its correctness).

Exercise it with ``python -m pytest tests/unit/test_fair_share.py``.
"""

from __future__ import annotations

import os
from typing import Mapping

from mlfabric.schedule import Schedule

__all__ = ["NIC_RATE_ENV", "PAYLOAD_FRACTION", "connection_rates", "nic_rates_from"]

#: ``MLFABRIC_NIC_RATE="500mbit"`` (every channel) or ``"0=1gbit,1=500mbit"`` (per channel):
#: the line rate of the NIC behind each channel; the emulator's launchers set it.
NIC_RATE_ENV = "MLFABRIC_NIC_RATE"

#: Pacing counts TCP payload, a NIC's rate counts frames: with a 1500-byte MTU the headers
#: are 4.4% of a full frame (1448 payload bytes of 1514), so a share's payload rate is at most
#: 0.956 of it. 0.95 leaves the shaper ~0.6% of slack so that no queue builds (0.90 was 5%
#: slower in the plain-socket experiment; without pacing, the step's last flow ended 8-15% late).
#: 0.96 (paced TCP delivers ~0.99 of its cap) tied on plain sockets but gave BML calls a tail
#: in the full benchmark (1009-1018 ms for half the calls vs 987-1008 ms at 0.95).
PAYLOAD_FRACTION = 0.95


def nic_rates_from(value: str | float | Mapping[str, float] | None, channels: tuple[str, ...]) -> dict[str, float]:
    """Per channel, the NIC rate in bit/s from an argument or, when ``value`` is None, from
    ``MLFABRIC_NIC_RATE``. Accepts a number (bit/s), ``"500mbit"``, ``"0=1gbit,1=500mbit"``
    or a mapping; an empty result means the rate is unknown (nothing is paced)."""
    from mlfabric.transport.pacing import parse_pace

    if value is None:
        value = os.environ.get(NIC_RATE_ENV, "")
    if isinstance(value, Mapping):
        rates = {str(channel): float(rate) for channel, rate in value.items()}
    elif isinstance(value, (int, float)):
        rates = {channel: float(value) for channel in channels}
    else:
        rates = parse_pace(value, channels, what=f"nic_rate / {NIC_RATE_ENV}")
    for channel, rate in rates.items():
        if rate <= 0:
            raise ValueError(f"nic_rate of channel {channel!r} must be positive, got {rate}")
    return rates


def connection_rates(schedule: Schedule, nic_rates_bps: Mapping[str, float]) -> dict[tuple[int, str], float | None]:
    """For every connection ``schedule`` sends on, its pacing rate in bit/s of payload, or
    None for unpaced (the whole NIC, or a channel whose rate is unknown)."""
    shares = schedule.cost.link_shares
    out: dict[tuple[int, str], float | None] = {}
    for op in schedule.sends():
        connection = (op.peer, op.channel)
        share = shares.get(connection)
        rate = nic_rates_bps.get(op.channel)
        out[connection] = None if share is None or rate is None else PAYLOAD_FRACTION * rate * share
    return out
