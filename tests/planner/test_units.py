"""planner.units: byte counts, times and rates parsed and written for people."""

import pytest

from planner.units import format_rate


def test_format_bytes_and_ms_never_overflow():
    from planner.units import format_bytes, format_ms

    assert format_bytes(10**400) == "inf B" and format_ms(10**400) == "inf ms"
    assert format_bytes(float("nan")) == "nan B"
    assert format_bytes(5 * 2**30) == "5.00 GiB" and format_ms(3.2) == "3.20 ms"


@pytest.mark.parametrize("value, text", [
    (0.578, "0.578"), (0.0012345, "0.00123"), (9.996, "10.0"), (12.34, "12.3"), (99.94, "99.9"), (99.96, "100"),
    (933.4, "933"), (1867.2, "1,867"), (0, "0"),
])
def test_rates_have_three_significant_digits(value, text):
    assert format_rate(value) == text


def test_parse_bytes():
    from planner.errors import UsageError
    from planner.units import parse_bytes

    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes("123B") == 123
    assert parse_bytes("40G") == parse_bytes("40g") == parse_bytes("40GB") == parse_bytes("40gb") == 40 * 10**9
    assert parse_bytes("40Gi") == parse_bytes("40gib") == 40 * 2**30
    assert parse_bytes("1e3KB") == 10**6 and parse_bytes("2T") == 2 * 10**12
    for bad, message in (("", "cannot read it as a size"), ("GiB", "cannot read"), ("5 parsecs", "cannot read"),
                         ("nan", "cannot read"), ("inf GB", "cannot read"), ("-5GB", "negative"),
                         ("1e400", "has no unit"), ("1e400GB", "too large"), ("2e18GiB", "too large"),
                         ("40", "40 has no unit: did you mean 40GiB"),
                         ("42949672960", "did you mean 42949672960B")):
        with pytest.raises(UsageError, match=message) as raised:
            parse_bytes(bad, "--budget")
        assert "\n" not in str(raised.value) and str(raised.value).startswith("--budget ")
