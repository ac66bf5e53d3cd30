"""Fuzz regressions, class: a flag out of range or against the model (pinned knobs below 1, implausible
workloads, a tensor-parallel size the heads do not divide by, a device that is not there) and torchrun's
variables set by hand. Each is a usage error of one line.
"""

import pytest

from tests.fuzz import BASE_ARGS
from tests.fuzz.regression import Refusal, assert_refused, config_file, linked_profile, run_regression

SERVING = ("--context", "64", "--concurrency", "8")
TRACE = ["trace", "--model", "ckpt", "--prompts", "prompts.txt"]
PROMPTS = {"prompts.txt": b"hello world\n"}

# name -> the refusal
CASES = {
    # issue 16: pinned knobs below 1, sizes no GPU has
    "prefetch-step-zero": Refusal([*BASE_ARGS, "--prefetch-step", "0"], {}, "--prefetch-step 0"),
    "group-size-huge": Refusal([*BASE_ARGS, "--group-size", "9" * 30], {}, "--group-size"),
    "context-huge": Refusal([*BASE_ARGS, "--context", "9" * 30], {}, "context at most"),
    "export-tp-huge": Refusal(["export", "plan.yaml", "--to", "vllm", "--tp", "9" * 30], {}, "--tp"),
    # issue 25: serving flags
    "host-memory-0B": Refusal([*BASE_ARGS, *SERVING, "--host-memory", "0B"], {}, "--host-memory"),
    "max-tpot-1e308": Refusal([*BASE_ARGS, *SERVING, "--max-tpot-ms", "1e308"], {}, "--max-tpot-ms"),
    "tokens-0-with-concurrency": Refusal([*BASE_ARGS, *SERVING, "--tokens", "0"], {}, "workload"),
    "sequences-negative-with-concurrency": Refusal([*BASE_ARGS, *SERVING, "--sequences", "-1"], {}, "workload"),
    "tokens-7-of-3-with-concurrency": Refusal([*BASE_ARGS, *SERVING, "--tokens", "7", "--sequences", "3"], {},
                                              "multiple"),
    # issue 39: make --tp at a size the heads refuse: the refusal asked which sizes work, and that asked again
    # (RecursionError)
    "tp-8-of-4-heads": Refusal([*BASE_ARGS, "--tp", "8"], linked_profile(), "use --tp 2 or 4"),
    "tp-3": Refusal([*BASE_ARGS, "--tp", "3"], linked_profile(), "use --tp 2 or 4"),
    "tp-of-1-head": Refusal([*BASE_ARGS, "--tp", "2"], {**linked_profile(), **config_file(
        lambda c: c.update(num_attention_heads=1, num_key_value_heads=1, head_dim=16))}, "use --tp 1"),
    # issue 39: trace's --device, checked before the model loads
    "trace-device-cuda-absent": Refusal([*TRACE, "--device", "cuda:7"], PROMPTS, "CUDA GPU(s)", moe=True),
    "trace-device-meta": Refusal([*TRACE, "--device", "meta"], PROMPTS, "--device", moe=True),
    "trace-device-upper": Refusal([*TRACE, "--device", "CPU"], PROMPTS, "--device", moe=True),
    "trace-device-negative": Refusal([*TRACE, "--device", "-1"], PROMPTS, "--device", moe=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flag_refused(name):
    assert_refused(name, CASES[name])


@pytest.mark.parametrize("value", ["x", "-3", "2.5", ""])
def test_world_size_not_a_number_is_one_line(monkeypatch, value):
    """torchrun's variables set by hand: int() of them was a bug line (exit 70)."""
    monkeypatch.setenv("WORLD_SIZE", value or " ")
    monkeypatch.setenv("RANK", "0")
    result = run_regression("world-size", ["run", "plan.yaml", "--bench"])
    assert result.verdict == "error", f"{result.verdict}: {result.detail} | {result.message}"
    assert "WORLD_SIZE" in result.message or "plan" in result.message, result.message
