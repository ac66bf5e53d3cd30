"""Every class of failure issue 25's campaign found, kept fixed: each a clean one-line error of the right class
(or, for the round trip, a plan every reader accepts), fast, never a hang.

Cases are built from the fuzzer's base inputs (tests/fuzz/) with one edit and run through the CLI in-process.
"""

import json
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.fuzz import BASE_ARGS, GUARD_NAME, Case, base, run_case
from tests.fuzz.adapters import _adapter_files, _adapter_plan_text, _adapter_tensors
from tests.fuzz.core import _json, _safetensors, _yaml
from tests.fuzz.roundtrip import READERS

MODEL, PROFILE, PLAN, USAGE = 2, 3, 4, 6
LONG = "x" * 300


def _run(args, files=None, special=None, then=(), invalid=True):
    case = Case(family="regression", mutation="r", args=list(args), invalid=invalid, files=dict(files or {}),
                special=dict(special or {}), then=tuple(then))
    with tempfile.TemporaryDirectory(prefix="fuzz-round2-") as root:
        return run_case(case, Path(root), time_limit_s=5.0)


def _make(*extra, output=GUARD_NAME):
    return [*BASE_ARGS, "--budget", base().budget, *extra, "-o", output]


def _profile(key, value):
    profile = json.loads(json.dumps(base().profile))
    profile[key]["value"] = value
    return {"gpu.yaml": _yaml(profile).encode()}


def _serving_plan(edit):
    plan = json.loads(json.dumps(base().serving_plan))
    edit(plan)
    return {"plan.yaml": _yaml(plan).encode()}


def _adapter_plan(edit):
    plan = yaml.safe_load(_adapter_plan_text())
    edit(plan)
    return {**_adapter_files(), "plan.yaml": _yaml(plan).encode()}


def _config(edit, moe=False):
    config = dict((base().moe if moe else base().dense).config)
    edit(config)
    return {"ckpt/config.json": _json(config)}


SERVING = ("--context", "64", "--concurrency", "8")
CASES = {
    # extreme finite hardware rates: cost, search and its overflow guard divided by them
    "rate-denormal": (_make(), _profile("h2d_bytes_per_s", 5e-324), None, "below any GPU"),
    "rate-1e-300": (_make(), _profile("hbm_bytes_per_s", 1e-300), None, "below any GPU"),
    "flops-1e-300-serving": ([*BASE_ARGS, *SERVING], _profile("bf16_flops_per_s", 1e-300), None, "below any GPU"),
    # paths longer than the file system allows
    "long-output": (_make(output=f"{LONG}/{LONG}.yaml"), {}, None, "longer than the file system allows"),
    "long-model": ([BASE_ARGS[0], "-m", LONG, "-g", "gpu.yaml"], {}, None, "longer than the file system allows"),
    "long-gpu": ([BASE_ARGS[0], "-m", "ckpt", "-g", LONG], {}, None, "longer than the file system allows"),
    "long-adapter": (_make("--adapter", f"a={LONG}"), {}, None, "longer than the file system allows"),
    "long-plan": (["show", LONG + ".yaml"], {}, None, "longer than the file system allows"),
    # special files: a FIFO blocked make and check forever
    "fifo-gpu": (_make(), {}, {"gpu.yaml": "fifo"}, "not a pipe (FIFO)"),
    "fifo-plan-check": (["check", "plan.yaml"], {}, {"plan.yaml": "fifo"}, "plan(s) fail check"),
    "fifo-shard": (_make(), {}, {"ckpt/model-00001-of-00002.safetensors": "fifo"}, "must be a regular file"),
    "fifo-config": (_make(), {}, {"ckpt/config.json": "fifo"}, "must be a regular file"),
    "device-plan": (["show", "plan.yaml"], {}, {"plan.yaml": "dev-zero"}, "a device file"),
    "folder-adapter-config": (_make("--adapter", "a=ad"), _adapter_files(), {"ad/adapter_config.json": "folder"},
                              "adapter_config.json"),
    # config fields of the wrong JSON type
    "model-type-list": ([*BASE_ARGS, *SERVING], _config(lambda c: c.update(model_type=["llama"])), None,
                        "model_type is"),
    "shared-expert-string": ([*BASE_ARGS, *SERVING], _config(lambda c: c.update(shared_expert_intermediate_size="8"),
                                                               moe=True), None, "shared_expert_intermediate_size"),
    "shared-expert-negative": ([*BASE_ARGS, *SERVING], _config(lambda c: c.update(n_shared_experts=-1), moe=True),
                               None, "n_shared_experts"),
    # flags
    "host-memory-0B": ([*BASE_ARGS, *SERVING, "--host-memory", "0B"], {}, None, "--host-memory"),
    "max-tpot-1e308": ([*BASE_ARGS, *SERVING, "--max-tpot-ms", "1e308"], {}, None, "--max-tpot-ms"),
    "tokens-0-with-concurrency": ([*BASE_ARGS, *SERVING, "--tokens", "0"], {}, None, "workload"),
    "sequences-negative-with-concurrency": ([*BASE_ARGS, *SERVING, "--sequences", "-1"], {}, None, "workload"),
    "tokens-7-of-3-with-concurrency": ([*BASE_ARGS, *SERVING, "--tokens", "7", "--sequences", "3"], {}, None,
                                       "multiple"),
    # adapters: a layer index that is a digit but not an ASCII one
    "adapter-layer-superscript": (_make("--adapter", "a=ad"), {**_adapter_files(), "ad/adapter_model.safetensors":
                                  _safetensors({n.replace("layers.0.", "layers.\u00b2."): s
                                                for n, s in _adapter_tensors().items()})}, None, "layer"),
    # hand-edited serving sections: null fields crashed show and export
    "memory-kv-null": (["show", "plan.yaml"], _serving_plan(lambda p: p["memory"].update(kv_cache_bytes=None)), None,
                       "memory.kv_cache_bytes"),
    "decode-null-export": (["export", "plan.yaml", "--to", "vllm"],
                           _serving_plan(lambda p: p["prediction"].update(decode_step_ms=None)), None, "prediction."),
    "chunk-0": (["export", "plan.yaml", "--to", "vllm"],
                _serving_plan(lambda p: (p["workload"].update(chunk_tokens=0), p["inputs"].update(chunk=0))), None,
                "chunk"),
    "range-low-above-high": (["show", "plan.yaml"], _serving_plan(lambda p: p["serving"].update(
        concurrency_low=64, concurrency_high=8)), None, "serving.concurrency_low..high"),
    "chosen-outside-range": (["show", "plan.yaml"], _serving_plan(lambda p: p["workload"].update(
        concurrency=5000, sequences_per_step=5000, tokens_per_step=5000)), None, "outside"),
    "kv-dtype-junk": (["export", "plan.yaml", "--to", "sglang"], _serving_plan(
        lambda p: p["workload"].update(kv_dtype="int3")), None, "workload.kv_dtype"),
    "gpu-over-budget-export-tp": (["export", "plan.yaml", "--to", "sglang", "--tp", "3"], _serving_plan(
        lambda p: p["memory"].update(budget_bytes=0)), None, "budget_bytes"),
    # hand-edited adapters sections, which export turned into engine flags
    "adapter-rank-0": (["export", "plan.yaml", "--to", "vllm"], _adapter_plan(
        lambda p: p["adapters"]["items"][0].update(rank=0)), None, "rank 0"),
    "adapter-max-rank": (["export", "plan.yaml", "--to", "vllm"], _adapter_plan(
        lambda p: p["adapters"].update(max_rank=1)), None, "max_rank"),
    "adapter-slots-above-adapters": (["show", "plan.yaml"], _adapter_plan(lambda p: p["adapters"].update(
        num_slots=2, gpu_bytes=2 * p["adapters"]["slot_bytes"])), None, "num_slots"),
    "adapter-slot-small": (["show", "plan.yaml"], _adapter_plan(lambda p: p["adapters"].update(
        slot_bytes=1, gpu_bytes=1)), None, "slot_bytes"),
    "adapter-pinned": (["show", "plan.yaml"], _adapter_plan(lambda p: p["adapters"].update(host_pinned_bytes=1)),
                       None, "host_pinned_bytes"),
    "adapter-name-make-refuses": (["export", "plan.yaml", "--to", "vllm"], _adapter_plan(
        lambda p: (p["adapters"]["items"][0].update(name="a=b"), p["inputs"].update(adapters=["a=b=ad"]))), None,
        "inputs.adapters"),
    "adapter-name-unlike-inputs": (["show", "plan.yaml"], _adapter_plan(
        lambda p: p["adapters"]["items"][0].update(name="b")), None, "not in inputs.adapters"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_round2_refusal(name):
    args, files, special, fragment = CASES[name]
    result = _run(args, files, special)
    assert result.verdict == "error", f"{result.verdict}: {result.detail} | {result.message}"
    assert fragment in result.message, result.message
    assert result.elapsed_ms < 1000, f"refused, but only after {result.elapsed_ms:.0f} ms"


def test_serving_rows_where_nothing_fits_read_back():
    """make marks a concurrency where no placement fits with num_offloaded -1 (planner.make.assemble.serving_row): a
    plan
    holding such a row is read by every reader, not refused as "negative"."""
    def mark(plan):
        chosen = plan["workload"]["concurrency"]
        row = next(r for r in reversed(plan["serving"]["points"]) if r["concurrency"] != chosen)
        row.update(num_offloaded=-1, group_size=0, num_in_group=0, prefetch_step=0, weights_gpu_bytes=0, step_ms=None,
                   tokens_per_s=0.0)

    readers = [[part.replace("new.yaml", "plan.yaml") for part in r] for r in READERS if r[0] != "check"]
    result = _run(readers[0], _serving_plan(mark), then=readers[1:], invalid=False)
    assert result.verdict == "accepted", f"{result.verdict}: {result.detail} | {result.message}"


def test_fifo_never_hangs():
    for args, special in ((["show", "plan.yaml"], {"plan.yaml": "fifo"}), (_make(), {"gpu.yaml": "link-to-fifo"}),
                          (["diff", "plan.yaml", "graph-plan.yaml"], {"graph-plan.yaml": "fifo"})):
        result = _run(args, special=special)
        assert result.verdict == "error" and result.elapsed_ms < 1000, (args, result)
