"""A seeded fuzzer of offload-plan's input boundaries, run in-process through the CLI as a user would.

One module per family of inputs (tests/fuzz/core.py runs and classifies a case; see its docstring for the
verdicts). ``case_for(family, seed, index)`` rebuilds any case; tests/contract/test_fuzz.py runs a bounded slice of
every family in CI and scripts/fuzz_campaign.py the full campaign.
"""

from tests.fuzz.adapters import gen_adapters
from tests.fuzz.architectures import gen_architectures
from tests.fuzz.checkpoint import gen_config, gen_headers, gen_index
from tests.fuzz.cpu_plans import gen_cpu_plans
from tests.fuzz.derived import gen_derived
from tests.fuzz.core import (ALIAS_BOMB, BASE_ARGS, DEEP, DEFAULT_TIME_LIMIT_S, FAILURES, GUARD_NAME, SHARDS,
                             VERDICTS, VERSION_LINE, Case, Result, framed, header_of, base, failure_summary,
                             invoke_cli, run_case, scratch_dir)
from tests.fuzz.flags import gen_flags
from tests.fuzz.paths import gen_paths
from tests.fuzz.plans import gen_plans
from tests.fuzz.profiles import gen_profiles
from tests.fuzz.roundtrip import gen_roundtrip
from tests.fuzz.serving import gen_sections, gen_serving_flags
from tests.fuzz.surfaces import gen_header_checkpoint, gen_outputs, gen_tp, gen_trace_cli
from tests.fuzz.traces import gen_traces

GENERATORS = {"headers": gen_headers, "index": gen_index, "config": gen_config, "plans": gen_plans,
              "profiles": gen_profiles, "flags": gen_flags, "adapters": gen_adapters,
              "serving_flags": gen_serving_flags, "sections": gen_sections, "architectures": gen_architectures,
              "paths": gen_paths, "roundtrip": gen_roundtrip, "traces": gen_traces, "derived": gen_derived,
              "tp": gen_tp, "trace_cli": gen_trace_cli, "header_checkpoint": gen_header_checkpoint,
              "outputs": gen_outputs, "cpu_plans": gen_cpu_plans}
FAMILIES = tuple(GENERATORS)
FAMILY_TITLES = {"headers": "safetensors headers", "index": "index JSON", "config": "config.json",
                 "plans": "plan YAML", "profiles": "profile YAML", "flags": "CLI flags", "adapters": "LoRA adapters",
                 "serving_flags": "serving flags", "sections": "plan sections by hand",
                 "architectures": "architecture configs", "paths": "special files and long paths",
                 "roundtrip": "round trip (make, then every reader)",
                 "traces": "routing traces (make --routing-trace, trace)",
                 "derived": "derived figures and experts sections",
                 "tp": "tensor parallel (make --tp, then every reader)",
                 "trace_cli": "trace's flags, output and config",
                 "header_checkpoint": "header-checkpoint configs (then make and every reader)",
                 "outputs": "outputs that are inputs",
                 "cpu_plans": "CPU experts sections by hand"}

__all__ = ["ALIAS_BOMB", "BASE_ARGS", "DEEP", "DEFAULT_TIME_LIMIT_S", "FAILURES", "FAMILIES", "FAMILY_TITLES",
           "GENERATORS", "GUARD_NAME", "SHARDS", "VERDICTS", "VERSION_LINE", "Case", "Result", "framed", "header_of",
           "base", "case_for", "failure_summary", "invoke_cli", "run_campaign", "run_case", "scratch_dir"]


def case_for(family: str, seed: int, index: int) -> Case:
    """The case ``index`` of ``family`` under ``seed``: the same three numbers give the same case."""
    import random

    rng = random.Random(f"{seed}:{family}:{index}")
    return GENERATORS[family](rng, base())


def run_campaign(seed: int, cases_per_family: dict[str, int], time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 progress=None) -> list[Result]:
    """Every case of every family under ``seed``; ``progress(result)`` is called after each."""
    import tempfile
    from pathlib import Path

    results = []
    with tempfile.TemporaryDirectory(prefix="offload-plan-fuzz-", dir=scratch_dir()) as root:
        for family, count in cases_per_family.items():
            for index in range(count):
                result = run_case(case_for(family, seed, index), Path(root), index, time_limit_s)
                results.append(result)
                if progress is not None:
                    progress(result)
    return results
