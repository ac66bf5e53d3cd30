"""scripts/bench_experts.py --skew-trace on the tiny CPU model: skewed routers recorded into a trace file by the
project's trace code, the plan made with --routing-trace through make_plan and run bitwise, against its
prediction, uniform residency at the same memory and the plan made without the trace."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_against_prediction_states_issue_22s_targets():
    from scripts.bench_experts import against_prediction

    row = {"measured_hit_rate": 0.70, "predicted_hit_rate": 0.74, "tokens_per_s": 90.0, "predicted_tokens_per_s": 100.0}
    out = against_prediction(row)
    assert round(out["hit_rate_points_off"], 6) == -4.0 and out["hit_rate_within_5_points"]
    assert out["tokens_per_s_over_predicted"] == 0.9 and out["tokens_per_s_within_10_percent"]
    out = against_prediction(row | {"measured_hit_rate": 0.60, "tokens_per_s": 85.0})
    assert not out["hit_rate_within_5_points"] and not out["tokens_per_s_within_10_percent"]
    assert against_prediction({"tokens_per_s": 1.0}) == {}
    accuracy = against_prediction({"prediction_accuracy": 0.724, "predicted_prediction_accuracy": 0.78})
    assert round(accuracy["prediction_accuracy_points_off"], 6) == -5.6


def test_tiny_skew_trace_arm_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(REPO / "scripts" / "bench_experts.py"), "--tiny", "--skew-trace", "--no-uniform",
               "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["arm"]: row for row in json.loads((tmp_path / "bench_experts.json").read_text())["rows"]}
    assert list(rows) == ["all-resident, skewed (trace)", "traced plan (--routing-trace)",
                          "uniform residency, same memory", "plan without the trace (uniform)"]
    traced, uniform = rows["traced plan (--routing-trace)"], rows["uniform residency, same memory"]
    # the plan names the recorded file by its hash, and routes every MoE layer from it
    from planner.source.routing_trace import content_hash, read_trace

    trace_path = Path(rows["all-resident, skewed (trace)"]["trace"])
    trace = read_trace(trace_path)
    assert traced["routing"] == "trace " + content_hash(trace_path.read_bytes()) and traced["routed_layers"] == 4
    # the skew is in the recorded counts: the hottest fifth of the experts take most assignments
    hot = [sum(sorted(counts)[-3:]) / sum(counts) for _, counts in trace.layers]
    assert min(hot) > 0.5
    # the biased experts themselves take them: the bias is the router linear's own (no hook)
    assert rows["all-resident, skewed (trace)"]["hot_assignment_share"] > 0.5
    # the runtime's next-layer prediction recorded per expert and rank (the trace validated it), so the plan
    # prices its prefetch over its own non-resident experts
    assert [index for index, *_ in trace.expert_prediction] == [index for index, _ in trace.layers][1:]
    assert traced["accuracy_source"] == "trace_per_expert"
    assert rows["plan without the trace (uniform)"]["accuracy_source"] == "assumed"
    for row in (traced, uniform, rows["plan without the trace (uniform)"]):
        assert row["greedy_logits_bitwise"] and row["greedy_ids_equal"]
    # the trace's residency hits more than the same memory held by uniform ids, and predicts more than uniform
    assert traced["resident_experts"] == uniform["resident_experts"] > 0
    assert traced["measured_hit_rate"] > uniform["measured_hit_rate"] + 0.3
    assert traced["predicted_hit_rate"] > rows["plan without the trace (uniform)"]["predicted_hit_rate"] + 0.3
    # the measured hit rate near the plan's (8 steps of a random token stream x 4 layers x top-2: 64 pairs, a few
    # points of noise; the H100 run's 64 steps x 48 layers x top-8 are held to issue 22's 5 points)
    assert abs(traced["hit_rate_points_off"]) < 15
    assert "tokens_per_s_over_predicted" in traced  # the CPU stand-in's rate is not the H100's: not compared
