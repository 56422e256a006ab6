"""Units: sizes are bytes (KB = 1000, KiB = 1024), rates bit/s (Gbps = 1e9), durations seconds.

    .venv/bin/python -m pytest tests/unit/test_units.py -q
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.units import format_duration, format_rate, format_size, parse_duration, parse_rate, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4KB", 4_000),
        ("4kB", 4_000),
        ("4KiB", 4_096),
        ("4kib".replace("b", "B"), 4_096),
        ("1.5MB", 1_500_000),
        ("64MiB", 64 * 2**20),
        ("2GB", 2_000_000_000),
        ("1GiB", 2**30),
        ("1TiB", 2**40),
        ("3TB", 3 * 10**12),
        ("0.5KiB", 512),
        ("512", 512),
        ("512B", 512),
        (" 12 MB ", 12_000_000),
        ("4k", 4_000),
        ("1e3", 1_000),
        (512, 512),
        (2048.0, 2048),
    ],
)
def test_parse_size_accepts_decimal_and_binary_units(text: str | int | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8Kb", "bits"),
        ("1Mbit", "bit"),
        ("4b", "bit"),
        ("1Mbps", "rate"),
        ("100MB/s", "rate"),
        ("-3KB", "negative"),
        ("abc", "cannot parse"),
        ("", "cannot parse"),
        ("3XB", "unknown unit"),
        ("1.5B", "whole number"),
        ("0.3KB".replace("0.3", "0.0001"), "whole number"),
        ("1e400", "finite"),
    ],
)
def test_parse_size_rejects_bad_input_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        parse_size(text)
    assert repr(text) in str(error.value)


@pytest.mark.parametrize("value", [True, None, -1, 1.5, float("nan"), [4]])
def test_parse_size_rejects_non_sizes(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value)  # type: ignore[arg-type]


def test_format_size_examples() -> None:
    assert format_size(1_500_000) == "1.5MB"
    assert format_size(4096, binary=True) == "4KiB"
    assert format_size(999) == "999B"
    assert format_size(2 * 10**12) == "2TB"


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10**15), st.booleans())
def test_format_size_parses_back_within_rounding(num_bytes: int, binary: bool) -> None:
    text = format_size(num_bytes, binary=binary)
    try:
        parsed = parse_size(text)
    except ValueError:
        # Three decimals of a binary unit may not be a whole number of bytes ("1.333KiB").
        assert binary
        return
    assert math.isclose(parsed, num_bytes, rel_tol=5e-4, abs_tol=0.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1gbit", 1e9),
        ("10Gbps", 1e10),
        ("10gbps", 1e10),
        ("500mbit", 5e8),
        ("100Mbps", 1e8),
        ("2.5G", 2.5e9),
        ("40M", 4e7),
        ("1kbit", 1e3),
        ("64Kbps", 64e3),
        ("1Tbps", 1e12),
        ("800bit", 800.0),
        ("800bps", 800.0),
        ("100MB/s", 8e8),
        ("1MBps", 8e6),
        ("1e9", 1e9),
        (1e9, 1e9),
        (10, 10.0),
    ],
)
def test_parse_rate_in_bits_per_second(text: str | float, expected: float) -> None:
    assert parse_rate(text) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("40GbE", "unknown unit"),
        ("1Gibit", "binary prefix"),
        ("fast", "cannot parse"),
        ("-1Gbps", "negative"),
    ],
)
def test_parse_rate_rejects_bad_input(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        parse_rate(text)
    assert repr(text) in str(error.value)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True])
def test_parse_rate_rejects_bad_numbers(value: float) -> None:
    with pytest.raises(ValueError):
        parse_rate(value)


def test_format_rate_examples_and_round_trip() -> None:
    assert format_rate(1e10) == "10Gbps"
    assert format_rate(2.5e9) == "2.5Gbps"
    assert format_rate(1e8) == "100Mbps"
    assert format_rate(999) == "999bps"
    for value in (1e10, 2.5e9, 1e8, 123_456.0, 7.0):
        assert parse_rate(format_rate(value)) == pytest.approx(value, rel=5e-4)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5s", 5.0), ("200ms", 0.2), ("1.5", 1.5), ("2min", 120.0), ("10us", 1e-5), ("3ns", 3e-9), ("1h", 3600.0), (7, 7.0)],
)
def test_parse_duration(text: str | int, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("text", ["3x", "5m", "-1s", "soon"])
def test_parse_duration_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_duration(text)
    assert repr(text) in str(error.value)


def test_format_duration_round_trip() -> None:
    assert format_duration(0.2) == "200ms"
    assert format_duration(5) == "5s"
    assert format_duration(0) == "0s"
    for value in (0.2, 5.0, 1.5e-6, 3e-9, 90.0):
        assert parse_duration(format_duration(value)) == pytest.approx(value, rel=5e-4)
