"""planner.source.untrusted: the strict YAML reader refuses what would hang and reads good plans as safe_load does."""

import time
from pathlib import Path

import pytest
import yaml

from tests.fuzz import ALIAS_BOMB, DEEP


def test_yaml_alias_bomb_and_deep_document_refused_in_well_under_a_second():
    from planner.errors import PlanError
    from planner.source.untrusted import load_yaml

    for text in (ALIAS_BOMB, "x: " + DEEP, "- " * 10_000 + "x"):
        start = time.perf_counter()
        with pytest.raises(PlanError):
            load_yaml(text.encode(), "f.yaml", PlanError, "fix it")
        assert time.perf_counter() - start < 0.25


def test_strict_yaml_reads_checked_in_plans_as_safe_load_does():
    from planner.errors import PlanError
    from planner.source.untrusted import load_yaml

    for path in sorted(Path(__file__).resolve().parents[2].glob("plans/*.yaml"))[:4]:
        raw = path.read_bytes()
        assert load_yaml(raw, str(path), PlanError, "") == yaml.safe_load(raw)
