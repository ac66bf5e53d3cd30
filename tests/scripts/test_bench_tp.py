"""scripts/bench_tp.py: its plan of transformers-saved checkpoints on the CPU, its one-line refusal without two GPUs,
and (two GPUs) the measured rank against the plan."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from scripts import bench_tp
from tests.conftest import REPO_ROOT
from tests.helpers import tiny_bench_tp_config
from tests.vllm_shards import llama_rank_bytes, qwen3_moe_rank_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _save(config_values: dict, folder) -> None:
    config = transformers.AutoConfig.for_model(**{k: v for k, v in config_values.items() if k != "architectures"})
    config.architectures = config_values["architectures"]
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)


@pytest.mark.parametrize("name, expected", [("llama", llama_rank_bytes), ("qwen3_moe", qwen3_moe_rank_bytes)])
def test_plan_rank_of_a_transformers_checkpoint_is_vllms_sharding(tmp_path, name, expected):
    values = tiny_bench_tp_config(name)
    _save(values, tmp_path / name)
    planned = bench_tp.plan_rank(tmp_path / name, "h100-sxm", 512)
    assert planned["num_offloaded"] == 0 and planned["step_ms"] > 0
    assert planned["weights_bytes"] == expected(values, 2)
    assert planned["transformers_extra_bytes"] == 1024 * 256 * 2 // 2  # the half of embed_tokens vLLM would not hold


def test_the_line_states_the_all_reduce_the_plan_priced():
    row = {"shape": "llama", "rank": 1, "gpu": "h100-sxm", "tokens": 2048, "measured_weights_bytes": 2 * 2**30,
           "planned_weights_bytes": 2 * 2**30, "planned_plus_whole_embedding_bytes": 2 * 2**30, "memory_error": 0.0,
           "measured_step_ms": 13.0, "predicted_step_ms": 12.5, "step_error": 0.04, "all_reduce_latency_us": 17.25,
           "all_reduce_bus_bytes_per_s": 361e9, "all_reduce_measured": True}
    line = bench_tp.report_line(row)
    assert "step 13.00 ms measured against 12.50 ms predicted (+4.0%, within 10%)" in line
    assert line.endswith("all-reduce measured: 17.2 us + bytes at 361 GB/s")
    assumed = bench_tp.report_line(dict(row, all_reduce_measured=False, step_error=0.2))
    assert "all-reduce ASSUMED" in assumed and "OFF by more than 10%" in assumed
    assert "--estimate" in bench_tp.report_line(dict(row, all_reduce_latency_us=None))


def _cpu_run(tmp_path, *extra: str) -> list[dict]:
    """bench_tp on two gloo ranks on the CPU, tiny shapes; both ranks' JSON rows."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "scripts/bench_tp.py", "--device", "cpu", "--tiny", "--tokens", "32", "--steps", "2",
                             "--folder", str(tmp_path / "ck"), *extra],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ms a layer (median forward / layers)" in result.stdout
    assert "collectives a forward (2 layers)" in result.stdout
    return [row for rank in (0, 1) for row in json.loads((tmp_path / f"bench_tp_rank{rank}.json").read_text())]


def test_on_two_cpu_ranks_transformers_tp_moe_is_vllms_split_and_collectives(tmp_path):
    """transformers' tp_plan="auto" of the Qwen3-MoE shape, run on two gloo ranks: each rank holds exactly vLLM's
    shards (plus the whole input embedding, in 5.17), its forward all-reduces the hidden states twice a layer (after
    o_proj, after the experts) and gathers the kept token's logits once, and its experts run the same kernels as
    the rank's config alone."""
    rows = _cpu_run(tmp_path, "--shape", "qwen3_moe")
    assert [row["rank"] for row in rows] == [0, 1]
    hidden_bytes = 32 * 256 * 2  # 32 tokens x hidden 256, bf16
    logits_bytes = 1024 // 2 * 2  # the kept token's logits on one rank: half the vocabulary of 1024, bf16
    for row in rows:
        assert row["measured_weights_bytes"] == row["planned_plus_whole_embedding_bytes"]
        tp, alone = row["breakdown"]["tp"], row["breakdown"]["alone"]
        # c10d.allreduce_ (dist.all_reduce) and _c10d_functional.all_reduce (a DTensor's redistribute) alike
        collectives = Counter((c["part"], c["op"].split(".")[-2].replace("_", ""), c["bytes"])
                              for c in tp["ops"]["collectives"])
        embedding = {("other", "allreduce", hidden_bytes): 1} if row["embedding_sharded"] else {}  # 5.24, not 5.17
        assert collectives == {("self_attn", "allreduce", hidden_bytes): 2, ("mlp", "allreduce", hidden_bytes): 2,
                               ("other", "allgatherintotensor", logits_bytes): 1, **embedding}
        assert alone["ops"]["collectives"] == []
        skipped = row["breakdown"]["tp_skipped"]["ops"]["collectives"]  # dist.all_reduce skipped: the layers' go
        assert [c for c in skipped if c["part"] in bench_tp.PARTS] == [] and len(skipped) == len(embedding) + 1
        assert all(run["top_ops"] and run["top_ops"][0]["ms"] > 0 for run in (tp, alone))
        for routing in (tp["routing"], alone["routing"]):  # 32 tokens x top-2 over 4 experts
            assert 1 <= routing["num_experts_hit"] <= 4 and 1.0 <= routing["busiest_over_mean"] <= 4.0
        assert tp["experts_implementation"] == alone["experts_implementation"] is not None
        assert bench_tp.experts_kernels(tp["ops"]["ops"]["mlp"]) == bench_tp.experts_kernels(alone["ops"]["ops"]["mlp"])
        assert tp["ops"]["num_ops"]["mlp"] > alone["ops"]["num_ops"]["mlp"]  # the TP wrappers' own ops, counted
        assert row["breakdown"]["all_reduce_bytes"] == hidden_bytes and row["breakdown"]["all_reduce_alone_ms"] > 0
        for figures in (tp, alone):
            assert all(figures["per_layer"][part]["host_ms"] > 0 for part in bench_tp.PARTS)


def test_the_breakdown_table_attributes_per_layer():
    def run(attention_ms: float, moe_ms: float, collectives: list[dict], extra_kernels: tuple = ()) -> dict:
        ops = {"num_ops": {"self_attn": 10, "mlp": 20, "other": 5},
               "num_dtensor_ops": {"self_attn": 0, "mlp": 0, "other": 0}, "collectives": collectives,
               "ops": {"self_attn": {}, "mlp": {"aten._grouped_mm.default": 4, "aten.sort.default": 2}, "other": {}}}
        return {"step": {"wall_ms": 8 * (attention_ms + moe_ms), "host_ms": 4.0},
                "experts_implementation": "grouped_mm", "ops": ops,
                "routing": {"num_experts_hit": 32, "busiest_over_mean": 1.5},
                "per_layer": {"self_attn": {"host_ms": 0.1, "device_ms": attention_ms},
                              "mlp": {"host_ms": 0.2, "device_ms": moe_ms}},
                "top_ops": [{"name": "nvjet_gemm", "ms": 3.5, "num_calls": 16}, *extra_kernels]}

    reduce = {"op": "c10d.allreduce_.default", "bytes": 8 * 2**20}
    nccl = {"name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ms": 0.8, "num_calls": 16}
    tp = run(0.5, 2.5, [dict(reduce, part="self_attn"), dict(reduce, part="mlp")] * 2, (nccl,))
    row = {"shape": "qwen3_moe", "rank": 0, "device": "cuda",
           "breakdown": {"tp": tp, "tp_skipped": run(0.45, 2.0, []), "alone": run(0.4, 1.0, []),
                         "all_reduce_alone_ms": 0.06, "all_reduce_bytes": 8 * 2**20}}
    table = bench_tp.breakdown_table(row)
    assert "  MLP/MoE block device     2.500      2.000    1.000    +0.500   +1.000" in table
    assert "  step wall (hooked)      24.000     19.600   11.200    +4.400   +8.400" in table
    assert "collectives a forward (2 layers): 2 x c10d.allreduce_.default of 8192.0 KiB in mlp, " in table
    assert "one all-reduce of a layer's 8.00 MiB alone: 0.060 ms" in table
    assert "experts: grouped_mm in the TP model (4 x aten._grouped_mm.default), grouped_mm alone" in table
    assert "routing, median MoE layer: 32 experts hit, the busiest 1.50 x the mean in the TP model" in table
    assert ("kernels that differ most, ms a step (calls): TP, alone, TP - alone\n"
            "       0.800 (  16)    0.000 (   0)   +0.800  ncclDevKernel_AllReduce_Sum_bf16_RING_LL\n"
            "       3.500 (  16)    3.500 (  16)   +0.000  nvjet_gemm") in table
    dense = {**row["breakdown"], **{key: dict(row["breakdown"][key], experts_implementation=None)
                                    for key in ("tp", "alone")}}
    assert "experts:" not in bench_tp.breakdown_table({**row, "breakdown": dense})


def test_without_two_gpus_it_says_so_in_one_line():
    result = subprocess.run([sys.executable, "scripts/bench_tp.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": ""},
                            timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun --nproc-per-node 2" in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_measure_the_rank_within_10_percent_of_the_plan(tmp_path):
    result = subprocess.run(["torchrun", "--nproc-per-node", "2", "scripts/bench_tp.py", "--folder", str(tmp_path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "all resident" in line]
    assert len(lines) == 4, result.stdout
    assert all(line.count("within 10%") == 2 and "all-reduce measured" in line for line in lines), result.stdout
