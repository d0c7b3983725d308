"""The one place where sizes, link rates and delays are read from text.

Every flag and option that takes a size (``--memory``, ``--memory-budget``,
``plan:memory=...``), a rate (``--bandwidth``) or a delay (``--latency``) goes through
these parsers, so a unit means the same thing everywhere:

- Sizes: ``KiB``/``MiB``/``GiB``/``TiB`` (also ``Ki``... without the ``B``) are binary,
  1024**k bytes; ``KB``/``MB``/``GB``/``TB`` are decimal, 1000**k bytes, as the SI and IEC
  prefixes say. A bare ``K``/``M``/``G``/``T`` is refused: half of the tools in use read
  it as binary and half as decimal, and a memory limit that is 7% off is a silent
  failure. A plain number (or ``B``) is bytes. Units are case-insensitive.
- Rates are tc's syntax, because the text is handed to ``tc`` as written: ``bit``,
  ``kbit``, ``mbit``, ``gbit``, ``tbit`` (bits, decimal), ``kibit``... (bits, binary) and
  ``bps``, ``kbps``, ``mbps``... (BYTES per second, as in tc), ``kibps``... (bytes,
  binary). A bare number is refused (tc reads it as bits, most people as bytes).
- Durations are tc's too: ``us``, ``ms``, ``s`` (and their ``usec``/``msec``/``sec``
  spellings).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = [
    "MAX_DURATION_S",
    "MAX_RATE_BPS",
    "MIN_RATE_BPS",
    "RATE_UNITS",
    "SIZE_UNITS",
    "canonical_duration",
    "canonical_rate",
    "format_size",
    "parse_duration",
    "parse_rate",
    "parse_size",
]

#: Bytes per size unit (lower-case keys; parsing is case-insensitive).
SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMBIGUOUS_SIZE_UNITS = ("k", "m", "g", "t")
#: The largest size accepted: more than any machine addresses, far below int64's limit.
MAX_SIZE = 2**60

#: Bits per second per tc rate unit (tc's own table: ``bps`` is bytes per second).
RATE_UNITS: dict[str, int] = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
#: Slowest link accepted: below this the token bucket's burst (and one packet) takes
#: seconds to drain, so no collective finishes within any sensible timeout.
MIN_RATE_BPS = 10**3
#: Fastest link accepted: beyond what a veth pair carries, and beyond the range where the
#: token bucket's burst (4 ms of traffic) fits tc's 32-bit byte counts.
MAX_RATE_BPS = 10**12

#: Seconds per tc time unit.
_TIME_UNITS: dict[str, float] = {
    "us": 1e-6,
    "usec": 1e-6,
    "usecs": 1e-6,
    "ms": 1e-3,
    "msec": 1e-3,
    "msecs": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
}
#: Longest one-way delay accepted: every collective would outlast its timeout beyond it.
MAX_DURATION_S = 60.0

_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_SIZE_RE = re.compile(_NUMBER + r"(?:[eE]([+-]?[0-9]+))?\s*([a-zA-Z]*)")
_RATE_RE = re.compile(_NUMBER + r"([a-zA-Z]*)")
_TIME_RE = re.compile(_NUMBER + r"([a-zA-Z]*)")


def parse_size(text: str | int, *, allow_zero: bool = False, what: str = "size") -> int:
    """A size in bytes: ``2GiB`` = 2 * 2**30, ``2GB`` = 2 * 10**9, ``4096`` = 4096.

    Fractions are allowed (``1.5GiB``) and rounded down to whole bytes; exponents too
    (``1e9``). See the module docstring for the units and why a bare ``G`` is refused.

    Raises:
        ValueError: not a size, an ambiguous or unknown unit, a negative, zero (unless
            `allow_zero`) or absurdly large size; the message says what is accepted.
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid {what} {text!r}: expected e.g. 512MiB, 2GB or 4096")
    if isinstance(text, int):
        value = Fraction(text)
        shown = str(text)
    else:
        shown = str(text).strip()
        m = _SIZE_RE.fullmatch(shown)
        if not m:
            raise ValueError(
                f"invalid {what} {text!r}: expected a number and a unit, e.g. 512MiB, 2GB or "
                f"4096 (bytes); units {', '.join(u for u in SIZE_UNITS if u)} (any case)"
            )
        number, exponent, unit = m.groups()
        key = unit.lower()
        if key in _AMBIGUOUS_SIZE_UNITS:
            k = _AMBIGUOUS_SIZE_UNITS.index(key) + 1
            u = unit.upper()
            raise ValueError(
                f"ambiguous {what} {text!r}: write {number}{u}B ({number} x 10^{3 * k} bytes) "
                f"or {number}{u}iB ({number} x 2^{10 * k} bytes)"
            )
        if key not in SIZE_UNITS:
            raise ValueError(
                f"invalid {what} {text!r}: unknown unit {unit!r} (accepted: B, KB, MB, GB, TB "
                "= 1000^k bytes; KiB, MiB, GiB, TiB = 1024^k bytes; any case)"
            )
        value = Fraction(number) * SIZE_UNITS[key]
        if exponent is not None:
            if abs(int(exponent)) > 30:
                raise ValueError(f"invalid {what} {text!r}: exponent out of range")
            value *= Fraction(10) ** int(exponent)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"invalid {what} {shown!r}: must be {'>= 0' if allow_zero else '> 0'}")
    if value > MAX_SIZE:
        raise ValueError(f"invalid {what} {shown!r}: larger than {format_size(MAX_SIZE)}")
    return math.floor(value)


def format_size(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``1.50 GiB``)."""
    for unit, size in (
        ("EiB", 2**60),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _rate_parts(text: str) -> tuple[Fraction, str]:
    shown = str(text).strip()
    m = _RATE_RE.fullmatch(shown)
    if not m or m.group(2).lower() not in RATE_UNITS:
        raise ValueError(
            f"invalid rate {text!r}: expected a number and a tc unit without a space, e.g. "
            f"100mbit, 1gbit (units: {', '.join(RATE_UNITS)}; bps is bytes per second)"
        )
    return Fraction(m.group(1)), m.group(2).lower()


def parse_rate(text: str) -> float:
    """A tc-style link rate (``100mbit``, ``1gbit``, ``125mbps``) in bits per second.

    Raises:
        ValueError: not a number followed by a tc unit, or outside
            [`MIN_RATE_BPS`, `MAX_RATE_BPS`].
    """
    number, unit = _rate_parts(text)
    bps = number * RATE_UNITS[unit]
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ValueError(
            f"invalid rate {text!r}: must be between 1kbit and 1tbit "
            "(tc's token bucket cannot shape a veth link outside that range)"
        )
    return float(bps)


def canonical_rate(text: str) -> str:
    """`text` as tc expects it (checked, trimmed, lower-case): ``" 1GBit"`` -> ``"1gbit"``."""
    parse_rate(text)
    return str(text).strip().lower()


def parse_duration(text: str, *, what: str = "duration") -> float:
    """A tc-style delay (``5ms``, ``200us``, ``0.1s``) in seconds; `what` names it in errors.

    Raises:
        ValueError: not a number followed by a tc time unit, or above `MAX_DURATION_S`.
    """
    shown = str(text).strip()
    m = _TIME_RE.fullmatch(shown)
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise ValueError(
            f"invalid {what} {text!r}: expected a number and a unit without a space, e.g. "
            "5ms, 200us or 0.1s (units: us, ms, s)"
        )
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if seconds > MAX_DURATION_S:
        raise ValueError(
            f"invalid {what} {text!r}: at most {MAX_DURATION_S:g}s (longer delays only "
            "make every collective time out)"
        )
    return seconds


def canonical_duration(text: str) -> str:
    """`text` as tc expects it (checked, trimmed, lower-case)."""
    parse_duration(text)
    return str(text).strip().lower()
