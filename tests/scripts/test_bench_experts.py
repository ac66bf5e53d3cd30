"""scripts/bench_experts.py --tiny: the H100 benchmark's logic end to end on the CPU stand-in (all-resident
reference, routed uniform with next-layer prefetch off and on, the planner's pick, today's whole-layer plan,
skewed routing with recorded and uniform residency)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_tiny_bench_runs_every_arm_bitwise(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_experts.py"), "--tiny", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["arm"]: row for row in json.loads((tmp_path / "bench_experts.json").read_text())["rows"]}
    assert list(rows) == ["all-resident", "routed, uniform, prefetch off", "routed, uniform, prefetch on",
                          "planner's pick", "whole-layer plan", "all-resident, skewed",
                          "routed, skewed, resident most frequent", "routed, skewed, resident uniform ids"]
    routed, prefetched = rows["routed, uniform, prefetch off"], rows["routed, uniform, prefetch on"]
    assert routed["prediction_accuracy"] is None and routed["predicted_layers"] == 0
    assert routed["unpredicted_bytes_per_step"] == routed["fetched_bytes_per_step"] == routed["routed_bytes_per_step"]
    assert prefetched["predicted_layers"] == 3 and 0 <= prefetched["prediction_accuracy"] <= 1
    assert prefetched["greedy_logits_bitwise"] and prefetched["greedy_ids_equal"]
    assert prefetched["routed_bytes_per_step"] == pytest.approx(
        prefetched["prefetched_bytes_per_step"] + prefetched["missed_bytes_per_step"]
        + prefetched["unpredicted_bytes_per_step"])
    assert prefetched["fetched_bytes_per_step"] == pytest.approx(
        prefetched["routed_bytes_per_step"] + prefetched["wasted_bytes_per_step"])
    # the same tokens route the same experts: the routed bytes do not depend on prefetch
    assert prefetched["routed_bytes_per_step"] == routed["routed_bytes_per_step"]
    assert routed["predicted_tokens_per_s"] > 0 and prefetched["floor_tokens_per_s"] > 0
    assert 0 < routed["resident_per_layer"] < 16  # some experts resident, some fetched
    assert routed["greedy_logits_bitwise"] and routed["greedy_ids_equal"] and routed["first_step_bitwise"]
    # random routers are near uniform: the fetched bytes within a third of k (E - R) / E per layer
    assert abs(routed["fetched_bytes_per_step"] / routed["expected_fetched_bytes_per_step"] - 1) < 1 / 3
    assert rows["whole-layer plan"]["offloaded_layers"] == 2 and rows["whole-layer plan"]["greedy_logits_bitwise"]
    frequent, uniform = rows["routed, skewed, resident most frequent"], rows["routed, skewed, resident uniform ids"]
    assert rows["all-resident, skewed"]["hot_assignment_share"] > 0.6
    assert frequent["greedy_logits_bitwise"] and uniform["greedy_logits_bitwise"]
    assert frequent["measured_hit_rate"] > uniform["measured_hit_rate"]
    assert abs(frequent["measured_hit_rate"] - frequent["recorded_hit_rate"]) < 0.1
    assert "routed, uniform, prefetch on" in proc.stdout and "accuracy" in proc.stdout  # the table


def test_tiny_depth_sweep_reuses_one_model_and_splits_the_link_by_depth(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_experts.py"), "--tiny", "--no-plans",
                           "--prefetch-depth", "0", "1", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "bench_experts.json").read_text())
    rows = {row["arm"]: row for row in data["rows"]}
    assert list(rows) == ["all-resident", "prefetch depth 0", "prefetch depth 1", "prefetch depth 2"]
    depths = [rows[f"prefetch depth {m}"] for m in (0, 1, 2)]
    assert all(row["greedy_logits_bitwise"] and row["greedy_ids_equal"] for row in depths)
    assert depths[0]["prefetched_bytes_per_step"] == depths[0]["wasted_bytes_per_step"] == 0
    # the same routing at every depth: the routed bytes are the same, and deeper gathers more ahead
    assert len({row["routed_bytes_per_step"] for row in depths}) == 1
    ahead = [row["prefetched_bytes_per_step"] + row["wasted_bytes_per_step"] for row in depths]
    assert ahead[0] < ahead[1] < ahead[2]
    assert all(len(row["rank_accuracy"]) == 2 and all(0 <= a <= 1 for a in row["rank_accuracy"]) for row in depths)
    assert sum(row["model_pick"] for row in depths) <= 1 and 0 <= data["model_pick_depth"] <= 2
    assert "accuracy by rank" in proc.stdout and "picks depth" in proc.stdout
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_experts.py"), "--tiny", "--prefetch-depth",
                          "-1", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "--prefetch-depth takes numbers of ranks" in bad.stderr


def test_tiny_step_variants_decode_bitwise_with_the_same_routing(tmp_path):
    """--prefetch-order after (the next layer's prefetch after this layer's misses) and a prefetch-programs
    setting are decoded as arms of their own, named by what differs, with the same routing and link split as
    the default order, and the logits still bitwise."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_experts.py"), "--tiny", "--no-plans",
                           "--prefetch-depth", "1", "--prefetch-order", "before", "after",
                           "--step-prefetch-programs", "8", "--out", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["arm"]: row for row in json.loads((tmp_path / "bench_experts.json").read_text())["rows"]}
    before = rows["prefetch depth 1 (8 prefetch programs)"]
    after = rows["prefetch depth 1 (prefetch after misses, 8 prefetch programs)"]
    assert before["greedy_logits_bitwise"] and after["greedy_logits_bitwise"]
    assert after["prefetch_after_misses"] and not before["prefetch_after_misses"]
    kinds = ("routed", "prefetched", "wasted", "missed", "unpredicted")
    assert [before[f"{k}_bytes_per_step"] for k in kinds] == [after[f"{k}_bytes_per_step"] for k in kinds]
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_experts.py"), "--tiny", "--prefetch-depth",
                          "1", "--step-prefetch-programs", "0", "--out", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "--step-prefetch-programs takes counts" in bad.stderr
