"""Units for sizes (bytes), rates (bit/s) and durations (seconds), parsed and formatted.

Every size, rate and duration that enters mlfabric from a user (CLI flags, topology specs,
trace files, configs) goes through these functions, so the whole package agrees on one
convention:

* sizes are **bytes**: ``KB/MB/GB/TB`` are powers of 1000, ``KiB/MiB/GiB/TiB`` powers of 1024;
  bit suffixes (``Kb``, ``Mbit``...) are rejected, because a size in bits is almost always a
  typo for a rate;
* rates are **bit/s**: tc-style ``kbit/mbit/gbit/tbit/bit``, ``Kbps/Mbps/Gbps/Tbps/bps``, and
  bare ``K/M/G/T`` all mean powers of 1000 bits per second (``10Gbps`` = 1e10 bit/s);
  byte rates are spelled ``MBps``/``MB/s`` (powers of 1000 bytes per second);
* durations are **seconds**: ``s``, ``ms``, ``us``, ``ns``, ``min``, ``h``, or a bare number.

Exercise it with::

    .venv/bin/python -m pytest tests/unit/test_units.py -q
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

__all__ = [
    "parse_size",
    "format_size",
    "parse_rate",
    "format_rate",
    "parse_duration",
    "format_duration",
]

# A number: 12, 1.5, .5, 1e9, 2.5E-3 (no sign: negative sizes/rates/durations are rejected
# separately so the error can say so).
_NUMBER = r"(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_QUANTITY = re.compile(r"^\s*" + _NUMBER + r"\s*(?P<unit>[A-Za-z/]*)\s*$")

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}


def _split(text: str, what: str, example: str) -> tuple[float, str, str]:
    """Split ``text`` into (number, unit, number-as-written) or raise a ValueError naming it."""
    stripped = text.strip()
    if stripped.startswith("-"):
        raise ValueError(f"{what} {text!r} is negative; expected a non-negative {what} like {example}")
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"cannot parse {what} {text!r}; expected a number with an optional unit, like {example}")
    number = float(match.group("num"))
    if not math.isfinite(number):
        raise ValueError(f"{what} {text!r} is not a finite number")
    return number, match.group("unit"), match.group("num")


def _check_number(value: float, what: str, original: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what} {original!r} is a bool, not a number")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{what} {original!r} is not finite")
    if value < 0:
        raise ValueError(f"{what} {original!r} is negative")
    return value


# --------------------------------------------------------------------------- sizes (bytes)


def _size_multiplier(unit: str, text: str) -> int:
    """Bytes per unit for a size suffix; rejects bit suffixes with an explanation."""
    if unit in ("", "B"):
        return 1
    lowered = unit.lower()
    if unit == "b" or lowered.endswith("bit") or lowered.endswith("bits") or lowered.endswith("bps") or "/" in unit:
        raise ValueError(f"size {text!r} has a bit or rate unit {unit!r}; sizes are bytes (use B, KB, MiB, ...)")
    if unit.endswith("b"):
        # 'Kb', 'Mb', 'Kib': a lower-case b means bits by convention, and sizes are bytes.
        raise ValueError(
            f"size {text!r} ends in a lower-case 'b' (bits); sizes are bytes, write {unit[:-1]}B instead"
        )
    # The prefix letters are case-insensitive ('kB' == 'KB', 'mib' prefix == 'MiB').
    prefix = lowered[:-1] if unit.endswith("B") else lowered
    if prefix in _BINARY:
        return _BINARY[prefix]
    if prefix in _DECIMAL and prefix != "":
        return _DECIMAL[prefix]
    raise ValueError(
        f"size {text!r} has an unknown unit {unit!r}; use B, KB/MB/GB/TB (powers of 1000) "
        "or KiB/MiB/GiB/TiB (powers of 1024)"
    )


def parse_size(value: str | int | float) -> int:
    """Parse a size in bytes: ``"4KB"`` -> 4000, ``"4KiB"`` -> 4096, ``"1.5MB"`` -> 1500000, ``512`` -> 512.

    Integers and floats are taken as a number of bytes. Fractional byte counts are rejected
    (``"1.5B"``), as are bit units (``"8Kb"``, ``"1Mbit"``) and negative values.
    """
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is a bool, not a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value!r} is negative")
        return value
    if isinstance(value, float):
        number = _check_number(value, "size", value)
        if not number.is_integer():
            raise ValueError(f"size {value!r} is not a whole number of bytes")
        return int(number)
    if not isinstance(value, str):
        raise ValueError(f"size {value!r} has type {type(value).__name__}; expected str, int or float")
    _, unit, num_text = _split(value, "size", "'4KB', '64MiB' or '1024'")
    multiplier = _size_multiplier(unit, value)
    # Decimal arithmetic: '1.001KB' is exactly 1001 bytes (float would give 1000.9999...).
    total = Decimal(num_text) * multiplier
    if total != total.to_integral_value():
        raise ValueError(f"size {value!r} is {total} bytes, not a whole number of bytes")
    return int(total)


def _format_scaled(value: float, steps: list[tuple[float, str]], unit0: str) -> str:
    for factor, suffix in steps:
        if value >= factor:
            scaled = value / factor
            text = f"{scaled:.3f}".rstrip("0").rstrip(".")
            return f"{text}{suffix}"
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return f"{text}{unit0}"


def format_size(num_bytes: int | float, *, binary: bool = False) -> str:
    """Human-readable size: ``format_size(1500000)`` -> ``'1.5MB'``; ``binary=True`` uses KiB/MiB/...

    The output parses back with :func:`parse_size` to the same value when it has at most three
    decimals of the chosen unit.
    """
    number = _check_number(num_bytes, "size", num_bytes)
    if binary:
        steps = [(2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB")]
    else:
        steps = [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")]
    return _format_scaled(number, steps, "B")


# --------------------------------------------------------------------------- rates (bit/s)

_RATE_BITS = {
    # tc style
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    # bits per second
    "bps": 1,
    "kbps": 10**3,
    "mbps": 10**6,
    "gbps": 10**9,
    "tbps": 10**12,
    "b/s": 1,
    "kb/s": 10**3,
    "mb/s": 10**6,
    "gb/s": 10**9,
    "tb/s": 10**12,
    "bit/s": 1,
    "kbit/s": 10**3,
    "mbit/s": 10**6,
    "gbit/s": 10**9,
    "tbit/s": 10**12,
    # bare prefixes mean bit/s
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
# Byte rates need case: 'MBps' / 'MB/s' are bytes, 'Mbps' / 'Mb/s' are bits.
_RATE_BYTES = {
    "Bps": 8,
    "KBps": 8 * 10**3,
    "MBps": 8 * 10**6,
    "GBps": 8 * 10**9,
    "TBps": 8 * 10**12,
    "B/s": 8,
    "KB/s": 8 * 10**3,
    "MB/s": 8 * 10**6,
    "GB/s": 8 * 10**9,
    "TB/s": 8 * 10**12,
    "kBps": 8 * 10**3,
    "kB/s": 8 * 10**3,
}


def parse_rate(value: str | int | float) -> float:
    """Parse a rate in bit/s: ``"1gbit"``, ``"10Gbps"``, ``"500mbit"``, ``"2.5G"``, ``1e9``, ``"100MB/s"``.

    tc-style ``kbit/mbit/gbit``, ``Kbps/Mbps/Gbps`` and bare ``K/M/G`` are powers of 1000 bit/s;
    ``KBps/MBps/GBps`` and ``KB/s/MB/s/GB/s`` are powers of 1000 *bytes* per second (x8).
    Numbers are bit/s.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _check_number(value, "rate", value)
    if not isinstance(value, str):
        raise ValueError(f"rate {value!r} has type {type(value).__name__}; expected str, int or float")
    number, unit, _ = _split(value, "rate", "'10Gbps', '1gbit' or '2.5G'")
    if unit in _RATE_BYTES:
        return number * _RATE_BYTES[unit]
    lowered = unit.lower()
    if lowered in _RATE_BITS:
        return number * _RATE_BITS[lowered]
    if lowered.endswith("ib") or lowered.endswith("ibit") or lowered.endswith("ibps"):
        raise ValueError(f"rate {value!r} uses a binary prefix; rates use powers of 1000 (Kbps, Mbps, Gbps)")
    raise ValueError(
        f"rate {value!r} has an unknown unit {unit!r}; use bit/kbit/mbit/gbit, bps/Kbps/Mbps/Gbps, "
        "bare K/M/G (bit/s), or MBps / MB/s for bytes per second"
    )


def format_rate(bits_per_second: float) -> str:
    """Human-readable rate in bit/s: ``format_rate(1e10)`` -> ``'10Gbps'``; parses back with :func:`parse_rate`."""
    number = _check_number(bits_per_second, "rate", bits_per_second)
    steps = [(1e12, "Tbps"), (1e9, "Gbps"), (1e6, "Mbps"), (1e3, "Kbps")]
    return _format_scaled(number, steps, "bps")


# --------------------------------------------------------------------------- durations (s)

_DURATION = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "ns": 1e-9,
    # No bare 'm': it would be read as milli by some and minutes by others.
    "min": 60.0,
    "h": 3600.0,
}


def parse_duration(value: str | int | float) -> float:
    """Parse a duration in seconds: ``"5s"`` -> 5.0, ``"200ms"`` -> 0.2, ``"1.5"`` -> 1.5, ``"2min"`` -> 120."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _check_number(value, "duration", value)
    if not isinstance(value, str):
        raise ValueError(f"duration {value!r} has type {type(value).__name__}; expected str, int or float")
    number, unit, _ = _split(value, "duration", "'5s', '200ms' or '1.5'")
    lowered = unit.lower()
    if lowered not in _DURATION:
        raise ValueError(f"duration {value!r} has an unknown unit {unit!r}; use s, ms, us, ns, min or h")
    return number * _DURATION[lowered]


def format_duration(seconds: float) -> str:
    """Human-readable duration: ``format_duration(0.2)`` -> ``'200ms'``; parses back with :func:`parse_duration`."""
    number = _check_number(seconds, "duration", seconds)
    if number == 0:
        return "0s"
    for factor, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if number >= factor:
            text = f"{number / factor:.3f}".rstrip("0").rstrip(".")
            return f"{text}{suffix}"
    text = f"{number / 1e-9:.3f}".rstrip("0").rstrip(".")
    return f"{text}ns"
