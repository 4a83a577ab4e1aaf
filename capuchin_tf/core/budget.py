"""Memory budgets as users write them ("2GiB", "1.5 GiB", 1073741824) turned into bytes, and bytes back into text.

Pure Python: imports no TensorFlow.

Units (case-insensitive, optional whitespace between number and unit):

- binary ``KiB``, ``MiB``, ``GiB``, ``TiB`` = 2**10, 2**20, 2**30, 2**40 bytes;
- decimal ``KB``, ``MB``, ``GB``, ``TB`` = 10**3, 10**6, 10**9, 10**12 bytes;
- bare ``K``, ``M``, ``G``, ``T`` are **binary**, as in TensorFlow's and most ML tools' memory options ("2G" = 2 GiB);
- ``B`` or no unit: bytes.
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1,
    "b": 1,
    **{letter: 1 << (10 * power) for power, letter in enumerate("kmgt", start=1)},
    **{letter + "ib": 1 << (10 * power) for power, letter in enumerate("kmgt", start=1)},
    **{letter + "b": 10 ** (3 * power) for power, letter in enumerate("kmgt", start=1)},
}

_SIZE = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)
_EXAMPLES = "'2GiB', '1.5 GiB', '512MiB', '300MB', '64KiB', '2G' or 1073741824 (bytes)"
_BINARY_NAMES = ("B", "KiB", "MiB", "GiB", "TiB")


def _invalid(value: object, reason: str) -> ValueError:
    return ValueError(f"invalid memory budget {value!r}: {reason}; expected e.g. {_EXAMPLES}")


def parse_budget(value: int | float | str) -> int:
    """A memory budget in bytes, from a positive int, an integral positive float or a size string (see module doc).

    A string with a unit may be fractional ("1.5 GiB"); the result is rounded down to whole bytes. A number of bytes
    given without a unit (or with ``B``) must be whole. Raises ValueError for a malformed, zero or negative budget
    and TypeError for a value that is neither a number nor a string (bool included).
    """
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise TypeError(
            f"memory budget must be an int, float or str, got {type(value).__name__} {value!r}; "
            f"expected e.g. {_EXAMPLES}"
        )
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m is None:
            raise _invalid(value, "not a number followed by an optional unit")
        number, unit = m.groups()
        scale = _UNITS.get(unit.lower())
        if scale is None:
            raise _invalid(value, f"unknown unit {unit!r} (use B, KiB/MiB/GiB/TiB, KB/MB/GB/TB or K/M/G/T)")
        exact = Fraction(number) * scale
    elif isinstance(value, numbers.Integral):
        exact, scale = Fraction(int(value)), 1
    else:
        if not math.isfinite(value):
            raise _invalid(value, "not a finite number")
        exact, scale = Fraction(value), 1
    if exact < 1:
        raise _invalid(value, "the budget must be positive (at least 1 byte)")
    if scale == 1 and exact.denominator != 1:
        raise _invalid(value, "not a whole number of bytes")
    return math.floor(exact)


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit it reaches, for messages: "100 B", "64.0 KiB", "512.0 MiB", "1.50 GiB".

    Two decimals below 10 units, one from 10 up; TiB is the largest unit. Negative counts keep their sign.
    """
    if abs(n) < 1024:
        return f"{n} B"
    power = min((abs(n).bit_length() - 1) // 10, len(_BINARY_NAMES) - 1)
    value = n / (1 << (10 * power))
    return f"{value:.2f} {_BINARY_NAMES[power]}" if abs(value) < 10 else f"{value:.1f} {_BINARY_NAMES[power]}"


def fraction_budget_mb(persistent_bytes: int, peak_bytes: int, fraction: float) -> int:
    """The protocol's budget "persistent + fraction x transient peak" (benchmarks.md; 0.5 is "half the transient
    peak"), in whole MiB, rounded up: what `--transient-fraction` turns into `--budget-mb`."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the transient fraction must be in (0, 1], got {fraction!r}")
    if persistent_bytes < 0 or peak_bytes < persistent_bytes:
        raise ValueError(f"need 0 <= persistent ({persistent_bytes}) <= peak ({peak_bytes}) bytes")
    return -(-int(persistent_bytes + fraction * (peak_bytes - persistent_bytes)) // MiB)
