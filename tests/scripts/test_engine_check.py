"""scripts/engine_check.py: every export of the checked-in plans and of generated plans, against the pinned
engine versions' accepted flags (static, always) and against the engines' own parsers and validation (where a
python with the pinned release is given: ENGINE_CHECK_VLLM_PYTHON, ENGINE_CHECK_SGLANG_PYTHON, or this
interpreter when it imports the engine)."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from planner.engines.versions import engine_version
from scripts import engine_check


def test_static_check_of_every_checked_in_plan(tmp_path):
    tally = engine_check.collect(tmp_path, generated=False)
    assert tally.num_plans == len(list((engine_check.REPO_ROOT / "plans").glob("*.yaml")))
    exported = [case for case in tally.cases if case.refused is None]
    assert len(exported) >= tally.num_plans  # every plan exports to vLLM at least
    assert engine_check.static_failures(tally.cases) == []
    assert not any("--offload-param-names" in case.flags for case in exported)


def test_static_check_of_generated_plans_of_one_model(tmp_path):
    """qwen3-8b's generated plans (weights, CUDA graphs, serving, FP8 KV, make --tp, adapters) export within the
    pinned flag sets; the static check does fail on a flag a version does not have."""
    from planner.make.make_plan import make_plan
    from scripts import real_checkpoints

    if not (real_checkpoints.OUTPUT_DIR / "qwen3-8b").is_dir():
        real_checkpoints.write_checkpoint("qwen3-8b")
    inputs = engine_check.plan_inputs("qwen3-8b", real_checkpoints.OUTPUT_DIR / "qwen3-8b", tmp_path)
    assert any(i.adapters for i in inputs) and any(i.tp > 1 for i in inputs) and any(i.concurrency for i in inputs)
    from planner.errors import InfeasibleError

    cases, read_at_use = [], set()
    for number, one in enumerate(inputs):
        try:
            plan = make_plan(one).plan
        except InfeasibleError:  # the smallest budget shares hold less than the resident weights: counted, skipped
            continue
        cases += engine_check.export_cases(f"qwen3-8b#{number}", plan)
        if plan.offload.mechanism == "read_at_use" and plan.offload.layers:
            read_at_use.add(f"qwen3-8b#{number}")
    exported = [case for case in cases if case.refused is None]
    assert {case.engine for case in exported} == {"vllm", "sglang"} and len(exported) > len(inputs)
    assert engine_check.static_failures(cases) == []
    assert any("--lora-modules" in case.flags for case in exported)
    assert any("--cpu-offload-gb" in case.flags for case in exported if case.engine == "sglang")
    # make --for sglang plans for --cpu-offload-gb itself: exported as planned, refused for vLLM and another TP
    planned = [case for case in cases if case.plan in read_at_use]
    assert planned and all(("--cpu-offload-gb" in case.flags) == (case.engine == "sglang" and case.tp_size == 1)
                           for case in planned)
    bad = replace(exported[0], flags=("--offload-param-names", "experts"), engine="sglang")
    (failure,) = engine_check.static_failures([bad])
    assert "SGLang 0.5.23 has no flag '--offload-param-names'" in failure


def _engine_python(engine: str) -> str | None:
    """A python that imports the pinned release of ``engine``, or None."""
    given = os.environ.get(f"ENGINE_CHECK_{engine.upper()}_PYTHON")
    candidates = [given] if given else ([sys.executable] if importlib.util.find_spec(engine) else [])
    for python in candidates:
        version = subprocess.run([python, "-c", f"import {engine}; print({engine}.__version__)"],
                                 capture_output=True, text=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
        if version.returncode == 0 and version.stdout.strip().splitlines()[-1] == engine_version(engine).version:
            return python
    return None


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engine_parses_and_validates_every_export_of_the_checked_in_plans(engine, tmp_path):
    python = _engine_python(engine)
    if python is None:
        pytest.skip(f"{engine}=={engine_version(engine).version} is not importable here: set "
                    f"ENGINE_CHECK_{engine.upper()}_PYTHON to a venv's python with it installed from PyPI")
    tally = engine_check.collect(tmp_path, generated=False)
    good = next(case for case in tally.cases if case.engine == engine and case.refused is None)
    # a flag the release does not take: the engine's own parser must refuse it, and the check must fail on it
    bad_flag = {"vllm": ("--max-lora-rank", "7"), "sglang": ("--offload-param-names", "experts")}[engine]
    bad = replace(good, plan="the bad case", flags=(*good.flags, *bad_flag))
    failures, counts = engine_check.engine_failures([*tally.cases, bad], engine, python, tmp_path)
    assert len(failures) == 1 and failures[0].startswith("the bad case") and "parser refused" in failures[0], failures
    counts["exports"] -= 1
    assert counts["parsed"] == counts["exports"] > 0
    assert counts["validated"] + counts["baseline_refused"] == counts["parsed"]
    print(json.dumps(counts))
