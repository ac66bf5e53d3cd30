"""Parsing and formatting of byte counts and times."""

import math
import re

from planner.errors import UsageError, cut, printable

#: unit -> bytes, case-insensitive. Decimal like disk and link datasheets (K, M, G, T and KB, MB, GB, TB are
#: powers of 1000), binary with an i (KiB, MiB, GiB, TiB, or Ki, Mi, Gi, Ti: powers of 1024). G is GB, not GiB.
_BYTE_UNITS = {
    "b": 1,
    **{f"{prefix}{suffix}": 10 ** (3 * power) for power, prefix in enumerate("kmgt", 1) for suffix in ("", "b")},
    **{f"{prefix}i{suffix}": 2 ** (10 * power) for power, prefix in enumerate("kmgt", 1) for suffix in ("", "b")},
}
#: what --help and size errors say about units
SIZE_HELP = "G and GB are 10^9 bytes, GiB is 2^30, likewise K, M, T; a number needs its unit"
#: no size this tool handles comes near this: refuse instead of overflowing a 64-bit byte count downstream
MAX_BYTES = 2**60
_BYTES_RE = re.compile(r"^\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str = "size") -> int:
    """Parse '40GiB', '80 GB', '40G' (= 40 * 10^9) or '1.5TiB' into a byte count; one-line UsageError otherwise.

    A bare number is refused (``--budget 40`` used to mean 40 bytes): the error suggests the likely unit.
    """
    match = _BYTES_RE.match(str(text))
    if match is None or match.group(2).lower() not in _BYTE_UNITS | {"": 1}:
        raise UsageError(f"{flag} {_echo(repr(str(text)))}: cannot read it as a size; write a number with a unit "
                         f"such as 40GiB, 80GB or 512MiB ({SIZE_HELP})")
    number, unit = match.group(1), match.group(2).lower()
    value = float(number)
    if not unit:
        likely = _echo(f"{number}GiB" if value < 2**20 else f"{number}B")
        raise UsageError(f"{flag} {_echo(number)} has no unit: did you mean {likely}? ({SIZE_HELP})")
    num_bytes = value * _BYTE_UNITS[unit]
    if not math.isfinite(num_bytes) or num_bytes > MAX_BYTES:
        raise UsageError(f"{flag} {_echo(text)} is too large to be a size (more than {MAX_BYTES} bytes)")
    if num_bytes < 0:
        raise UsageError(f"{flag} {_echo(text)} is negative; give a size such as 40GiB")
    return int(round(num_bytes))


def _echo(text: object) -> str:
    """The user's value for an error line: printable, cut to 40 characters (a 400-digit --budget echoed whole
    made a line past the 300-character contract)."""
    return cut(printable(str(text).strip()), 40)


def format_bytes(num_bytes: float) -> str:
    """Format a byte count for people, in binary units ('38.50 GiB'); any number formats, however large."""
    value = _as_float(num_bytes)
    if not math.isfinite(value):
        return f"{value} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_ms(time_ms: float) -> str:
    """Format a duration in milliseconds with sensible precision; any number formats, however large."""
    time_ms = _as_float(time_ms)
    if not math.isfinite(time_ms):
        return f"{time_ms} ms"
    if time_ms >= 100:
        return f"{time_ms:.1f} ms"
    if time_ms >= 1:
        return f"{time_ms:.2f} ms"
    return f"{time_ms * 1000:.0f} us"


def format_rate(value: float) -> str:
    """A rate (tokens/s, GB/s) with three significant digits, whole from 100 up: 0.578, 12.3, 933, 1,867
    ("1 tokens/s" for 0.578 read as a whole token per second)."""
    value = _as_float(value)
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    decimals = 2 - math.floor(math.log10(abs(value)))
    text = f"{value:.{decimals}f}"
    if abs(float(text)) >= 10 ** (3 - decimals):  # 9.996 rounds up to 10.00: one digit fewer after the point
        text = f"{value:.{max(decimals - 1, 0)}f}"
    return text


def _as_float(value: float) -> float:
    """float(value), with integers beyond a float's range as infinity instead of an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
