"""Parsing and formatting of byte counts and times."""

import math
import re

from planner.errors import UsageError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse '40GiB', '80 GB', '1.5TiB' or '123456' into a byte count."""
    match = _BYTES_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise UsageError(
            f"cannot read {text!r} as a size: write a number with a unit such as 40GiB, 80GB or 512MiB"
        )
    return int(round(float(match.group(1)) * _BYTE_UNITS[unit]))


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


def _as_float(value: float) -> float:
    """float(value), with integers beyond a float's range as infinity instead of an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
