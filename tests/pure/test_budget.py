"""parse_budget and format_bytes (capuchin_tf.core.budget): accepted forms, rejections and their messages, round
trip."""

from __future__ import annotations

import fractions

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capuchin_tf.core.budget import format_bytes, parse_budget

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    "value, expected",
    [
        (1, 1),
        (1073741824, GiB),
        (4096.0, 4096),
        (fractions.Fraction(8, 1), 8),
        ("1073741824", GiB),
        ("100B", 100),
        ("100 b", 100),
        ("2GiB", 2 * GiB),
        ("1.5 GiB", 3 * GiB // 2),
        ("512MiB", 512 * MiB),
        ("64KiB", 64 * KiB),
        ("1TiB", TiB),
        ("300MB", 300_000_000),
        ("0.3 GB", 300_000_000),  # exact: no binary floating-point rounding
        ("2KB", 2000),
        ("1tb", 10**12),
        ("2G", 2 * GiB),  # bare letters are binary
        ("512m", 512 * MiB),
        ("64K", 64 * KiB),
        ("1T", TiB),
        ("2gib", 2 * GiB),
        ("2GIB", 2 * GiB),
        ("  2 GiB  ", 2 * GiB),
        ("\t16\tMiB\n", 16 * MiB),
        (".5 KiB", 512),
        ("3. MiB", 3 * MiB),
        ("+1KiB", KiB),
        ("1.1 KiB", 1126),  # 1126.4 bytes, rounded down
    ],
)
def test_accepted_forms(value, expected):
    got = parse_budget(value)
    assert got == expected
    assert type(got) is int


@pytest.mark.parametrize(
    "value, reason",
    [
        (0, "must be positive"),
        (-5, "must be positive"),
        (0.0, "must be positive"),
        (-1.0, "must be positive"),
        ("0", "must be positive"),
        ("0 GiB", "must be positive"),
        ("-2GiB", "must be positive"),
        ("0.0001 KiB", "at least 1 byte"),
        (float("nan"), "not a finite number"),
        (float("inf"), "not a finite number"),
        (float("-inf"), "not a finite number"),
        (1.5, "not a whole number of bytes"),
        ("1.5", "not a whole number of bytes"),
        ("10.5 B", "not a whole number of bytes"),
        ("5 XB", "unknown unit 'XB'"),
        ("2 GiBs", "unknown unit 'GiBs'"),
        ("2 PiB", "unknown unit 'PiB'"),
        ("", "not a number followed by an optional unit"),
        ("   ", "not a number followed by an optional unit"),
        ("GiB", "not a number followed by an optional unit"),
        ("2 G iB", "not a number followed by an optional unit"),
        ("1e9", "not a number followed by an optional unit"),
        ("1,024", "not a number followed by an optional unit"),
        ("\u0661\u0662 MiB", "not a number followed by an optional unit"),  # Arabic-Indic digits
    ],
)
def test_rejections_quote_the_value_and_show_examples(value, reason):
    with pytest.raises(ValueError) as info:
        parse_budget(value)
    msg = str(info.value)
    assert f"invalid memory budget {value!r}" in msg
    assert reason in msg
    assert "'2GiB'" in msg and "'512MiB'" in msg and "1073741824" in msg


@pytest.mark.parametrize("value", [True, False, None, [1], {"GiB": 1}, b"2GiB"])
def test_wrong_types_raise_type_error(value):
    with pytest.raises(TypeError) as info:
        parse_budget(value)
    msg = str(info.value)
    assert type(value).__name__ in msg and repr(value) in msg
    assert "int, float or str" in msg and "'2GiB'" in msg


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (100, "100 B"),
        (1023, "1023 B"),
        (KiB, "1.00 KiB"),
        (64 * KiB, "64.0 KiB"),
        (512 * MiB, "512.0 MiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (2 * TiB, "2.00 TiB"),
        (2048 * TiB, "2048.0 TiB"),  # TiB is the largest unit
        (-3 * GiB // 2, "-1.50 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@given(st.integers(min_value=1, max_value=1 << 50))
def test_format_then_parse_is_within_rounding(n):
    back = parse_budget(format_bytes(n))
    # three significant digits at least: relative error <= 0.5%, plus at most one byte from rounding down
    assert abs(back - n) <= n * 0.005 + 1


@given(st.integers(min_value=1, max_value=1 << 60), st.sampled_from(["", "B", " b", "  "]))
def test_whole_bytes_parse_exactly(n, unit):
    assert parse_budget(f"{n}{unit}") == n
    assert parse_budget(n) == n
    if n < 1 << 53:  # exactly representable as a float
        assert parse_budget(float(n)) == n


@given(
    st.integers(min_value=1, max_value=1 << 20),
    st.sampled_from([("KiB", KiB), ("k", KiB), ("MiB", MiB), ("M", MiB), ("gib", GiB), ("MB", 10**6), ("gb", 10**9)]),
)
def test_whole_units_scale_exactly(count, unit_scale):
    unit, scale = unit_scale
    assert parse_budget(f"{count} {unit}") == count * scale



def test_fraction_budget_is_persistent_plus_the_fraction_of_the_transient_rounded_up_to_a_mib():
    from capuchin_tf.core.budget import fraction_budget_mb

    mib = 1 << 20
    assert fraction_budget_mb(10 * mib, 30 * mib, 0.5) == 20
    assert fraction_budget_mb(10 * mib, 31 * mib, 0.5) == 21  # 20.5 MiB rounds up
    assert fraction_budget_mb(10 * mib, 30 * mib, 1.0) == 30
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="fraction"):
            fraction_budget_mb(10 * mib, 30 * mib, bad)
    with pytest.raises(ValueError, match="persistent"):
        fraction_budget_mb(30 * mib, 10 * mib, 0.5)
