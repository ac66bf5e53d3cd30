"""Golden plans: make on hand-written checkpoints must reproduce tests/golden/*.yaml byte for byte.

Regenerate after an intended change with:  UPDATE_GOLDEN=1 python -m pytest tests/contract/test_golden.py
then review the diff of tests/golden/ like any other code change.
"""

import pytest
import yaml

from tests.conftest import check_golden, invoke, make_adapter, make_checkpoint
from tests.helpers import GOLDEN_CASES, make_golden_plan


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_plan(workdir, test_gpu, case):
    text = make_golden_plan(workdir, test_gpu, case)
    check_golden(f"{case}.yaml", text)


def test_golden_cases_are_what_they_claim(workdir, test_gpu):
    """Sanity of the golden scenarios themselves, so a regenerated golden file cannot silently lose its point."""
    fits = yaml.safe_load(make_golden_plan(workdir, test_gpu, "dense-fits", "fits.yaml"))
    assert fits["offload"]["layers"] == [] and fits["memory"]["num_slots"] == 0
    assert fits["prediction"]["step_ms"] == fits["prediction"]["resident_step_ms"]

    forced = yaml.safe_load(make_golden_plan(workdir, test_gpu, "dense-budget", "forced.yaml"))
    assert forced["offload"]["layers"], "a 500KB budget must force offload"
    assert forced["memory"]["gpu_bytes"] <= forced["memory"]["budget_bytes"] == 500_000
    assert forced["prediction"]["step_ms"] >= forced["prediction"]["link_floor_ms"]
    # test-gpu: h2d 1e9 B/s and 10 us per copy, so a copy takes 0.01 + bytes / 1e6 ms
    for row in forced["layers"]:
        assert row["copy_ms"] == round(0.01 + row["bytes"] / 1e6, 4)
    assert forced["prediction"]["link_floor_ms"] == round(forced["prediction"]["copy_bytes_per_step"] / 1e6, 4)

    pinned = yaml.safe_load(make_golden_plan(workdir, test_gpu, "dense-pinned", "pinned.yaml"))
    assert pinned["offload"]["layers"] == [2, 3, 6, 7]  # i % 4 >= 4 - 2
    assert (pinned["offload"]["group_size"], pinned["offload"]["num_in_group"], pinned["offload"]["prefetch_step"]) \
        == (4, 2, 1)


def test_golden_moe_moves_only_experts(workdir, test_gpu):
    written = make_checkpoint(workdir / "ckpt", **GOLDEN_CASES["moe-experts"][0])
    plan = yaml.safe_load(make_golden_plan(workdir, test_gpu, "moe-experts"))
    assert plan["offload"]["params"] == ["experts"]
    assert plan["offload"]["layers"]
    for row in plan["layers"]:
        assert row["bytes"] == written.layer_bytes(row["index"])
        moved = written.expert_bytes(row["index"]) if row["index"] in plan["offload"]["layers"] else 0
        assert row["offloaded_bytes"] == moved
    assert plan["memory"]["slot_bytes"] == written.expert_bytes(0)
    assert plan["memory"]["host_pinned_bytes"] == written.expert_bytes(0) * len(plan["offload"]["layers"])


def test_make_twice_gives_identical_bytes(workdir, test_gpu):
    first = make_golden_plan(workdir, test_gpu, "dense-budget", "plan.yaml")
    second = make_golden_plan(workdir, test_gpu, "dense-budget", "plan.yaml")
    assert first.encode() == second.encode()
    # stdout gets the same bytes as the file, except the regenerate command has no -o
    result = invoke(["make", "--model", "ckpt", "--gpu", test_gpu, "--budget", "500KB"])
    assert result.exit_code == 0
    assert result.stdout.replace("--tokens 2048\n", "--tokens 2048 -o plan.yaml\n", 1) == first


def test_plan_round_trips_through_show(workdir, test_gpu):
    """show --json reads the plan back with exactly the values make wrote."""
    import json

    text = make_golden_plan(workdir, test_gpu, "dense-budget")
    result = invoke(["show", "plan.yaml", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == yaml.safe_load(text)
    result = invoke(["show", "plan.yaml"])
    assert result.exit_code == 0, result.stderr
    assert "Plan" in result.stdout and "compute |" in result.stdout and result.stderr == ""


SCHEMA = {
    "schema_version": None,
    "inputs": ["model", "revision", "gpu", "budget", "trigger", "tokens", "sequences", "context", "params", "stack",
               "group_size", "num_in_group", "prefetch_step", "measure", "measured_on", "cuda_graph", "host_memory",
               "concurrency", "chunk", "kv_dtype", "max_tpot_ms", "gpu_memory"],
    "model": ["source", "revision", "fingerprint", "architecture", "stack", "num_layers", "num_tensors",
              "total_bytes", "layer_bytes", "non_layer_bytes", "unused_layers", "unused_bytes", "dtype_bytes"],
    "hardware": ["profile", "gpu_memory_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s",
                 "h2d_bytes_per_s", "copy_overhead_us", "trigger", "reserve_bytes", "compute_efficiency",
                 "host_memory_bytes", "cuda_context_bytes"],
    "workload": ["tokens_per_step", "sequences_per_step", "context_tokens", "compute_source", "cuda_graph",
                 "concurrency", "chunk_tokens", "kv_dtype"],
    "offload": ["group_size", "num_in_group", "prefetch_step", "params", "layers", "replay_start_copies"],
    "memory": ["budget_bytes", "gpu_bytes", "resident_layer_bytes", "non_layer_bytes", "allocation_slack_bytes",
               "num_slots", "slot_bytes", "host_pinned_bytes", "gpu_memory_bytes", "kv_cache_bytes", "activation_bytes",
               "cuda_graph_pool_bytes", "cuda_context_bytes", "total_gpu_bytes"],
    "prediction": ["step_ms", "resident_step_ms", "head_ms", "stall_ms", "link_floor_ms", "copy_bytes_per_step",
                   "link_busy_share", "decode_step_ms", "decode_tokens_per_s", "prefill_chunk_ms"],
    "layers": ["index", "bytes", "selected_bytes", "offloaded_bytes", "compute_ms", "copy_ms"],
}
#: a serving plan (make --concurrency) adds this section after the layers
SERVING_SCHEMA = {
    "serving": ["concurrency_low", "concurrency_high", "max_tpot_ms", "no_offload_concurrency", "no_offload_step_ms",
                "no_offload_tokens_per_s", "points"],
    "points": ["concurrency", "num_offloaded", "group_size", "num_in_group", "prefetch_step", "weights_gpu_bytes",
               "kv_cache_bytes", "total_gpu_bytes", "step_ms", "tokens_per_s"],
}


def test_plan_schema_keys_are_pinned(workdir, test_gpu):
    """A schema change must be deliberate: update SCHEMA here, SCHEMA_VERSION, and the golden files together."""
    from planner.plan.schema import SCHEMA_VERSION

    plan = yaml.safe_load(make_golden_plan(workdir, test_gpu, "dense-budget"))
    assert SCHEMA_VERSION == 2 and plan["schema_version"] == 2
    assert list(plan) == list(SCHEMA)  # top-level keys, in file order
    for section, keys in SCHEMA.items():
        if section == "schema_version":
            continue
        if section == "layers":
            assert all(list(row) == keys for row in plan["layers"])
        else:
            assert list(plan[section]) == keys, section


def test_serving_plan_schema_keys_are_pinned(workdir, test_gpu):
    """A serving plan is the weights-only schema plus its serving section, keys pinned the same way."""
    make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2)
    result = invoke(["make", "--model", "ckpt", "--gpu", test_gpu, "--context", "256", "--concurrency", "auto",
                     "--chunk", "64"])
    assert result.exit_code == 0, result.stderr
    plan = yaml.safe_load(result.stdout)
    assert list(plan) == [*SCHEMA, "serving"]
    assert list(plan["serving"]) == SERVING_SCHEMA["serving"]
    assert plan["serving"]["points"] and all(list(row) == SERVING_SCHEMA["points"] for row in plan["serving"]["points"])


#: a plan with adapters (make --adapter) adds these inputs keys (only then) and this section after the layers
ADAPTERS_SCHEMA = {
    "inputs": ["adapters", "adapter_slots"],
    "adapters": ["num_slots", "slot_bytes", "gpu_bytes", "host_pinned_bytes", "max_rank", "num_missing", "copy_ms",
                 "shared_copy_ms", "blocking_wait_ms", "pipelined_first_wait_ms", "pipelined_last_wait_ms",
                 "pipelined_step_ms", "mode", "stream_requests_per_batch", "stream_num_batches", "blocking_stream_ms",
                 "pipelined_stream_ms", "mode_margin", "items"],
    "items": ["name", "source", "revision", "fingerprint", "rank", "alpha", "target_modules", "num_tensors", "bytes",
              "copy_ms"],
}


def test_adapters_plan_schema_keys_are_pinned(workdir, test_gpu):
    """Adapters add their inputs keys and a section after the serving one, keys pinned the same way."""
    checkpoint = make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2)
    make_adapter(workdir / "ad" / "a", checkpoint.tensors)
    result = invoke(["make", "--model", "ckpt", "--gpu", test_gpu, "--context", "256", "--concurrency", "4",
                     "--chunk", "64", "--adapter", "a=ad/a", "--adapter-slots", "1"])
    assert result.exit_code == 0, result.stderr
    plan = yaml.safe_load(result.stdout)
    assert list(plan) == [*SCHEMA, "serving", "adapters"]
    assert list(plan["inputs"]) == [*SCHEMA["inputs"], *ADAPTERS_SCHEMA["inputs"]]
    assert list(plan["adapters"]) == ADAPTERS_SCHEMA["adapters"]
    assert [list(row) for row in plan["adapters"]["items"]] == [ADAPTERS_SCHEMA["items"]]


def test_selected_bytes_are_recorded_for_every_layer(workdir, test_gpu):
    moe = yaml.safe_load(make_golden_plan(workdir, test_gpu, "moe-experts"))
    assert all(0 < row["selected_bytes"] < row["bytes"] for row in moe["layers"])  # the experts of each layer
    assert all(row["offloaded_bytes"] in (0, row["selected_bytes"]) for row in moe["layers"])
