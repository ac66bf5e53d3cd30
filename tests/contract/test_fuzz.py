"""A bounded, seeded slice of the fuzz campaign (tests/fuzz/) in CI: zero failures in every family.

The full campaign (>= 15,000 cases) is ``PYTHONPATH=. python3 scripts/fuzz_campaign.py --seed 25``; this slice
runs the same generators on another seed, so CI keeps finding cases the campaign did not. A failure names the
family, seed and index: ``tests.fuzz.case_for(family, seed, index)`` rebuilds the case.
"""

import tempfile
from pathlib import Path

import pytest

from tests.fuzz import FAILURES, FAMILIES, case_for, run_case, scratch_dir

SEED = 2026
#: cases per family: 1,260 in all, about 40 s on a 2-core machine (a round-trip case runs eleven commands)
SLICE = {"headers": 110, "index": 70, "config": 80, "plans": 120, "profiles": 70, "flags": 80, "adapters": 80,
         "serving_flags": 80, "sections": 120, "architectures": 80, "paths": 90, "roundtrip": 20,
         "traces": 60, "derived": 80, "tp": 30, "trace_cli": 40, "header_checkpoint": 20, "outputs": 30,
         "cpu_plans": 60}
#: generous: a loaded CI machine must not turn a slow case into a "hang"; every refusal takes milliseconds
TIME_LIMIT_S = 5.0


def _failures(family: str) -> list:
    with tempfile.TemporaryDirectory(prefix="fuzz-slice-", dir=scratch_dir()) as root:
        results = [run_case(case_for(family, SEED, index), Path(root), index, TIME_LIMIT_S)
                   for index in range(SLICE[family])]
    return [r for r in results if r.verdict in FAILURES]


def _describe(failures: list) -> str:
    return "\n".join(f"{r.family} #{r.index} ({r.mutation}): {r.verdict}: {r.detail} | {r.message[:160]}"
                     for r in failures[:20])


def test_slice_covers_every_family():
    assert set(SLICE) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_slice_has_no_failures(family):
    failures = _failures(family)
    assert not failures, f"{len(failures)} failing case(s) under seed {SEED}:\n{_describe(failures)}"


