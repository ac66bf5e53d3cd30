"""scripts/bench_serving.py's sliding-window points, planned on the CPU (the run itself needs the H100)."""

import json
from pathlib import Path

import pytest

from planner.kv_cache import kv_cache_model
from scripts import bench_serving


@pytest.mark.parametrize("name, window, num_sliding, num_full", [("gemma3-16g-8k", 1024, 20, 4),
                                                                 ("gpt-oss-16g-8k", 128, 6, 6)])
def test_sliding_points_cut_the_release_and_plan(name, window, num_sliding, num_full, tmp_path, monkeypatch):
    """The point's config is the release's language model cut to its layers (bf16, no MXFP4), its KV model
    slides where the release's does, and every arm is planned from its header checkpoint."""
    point = bench_serving.POINTS[name]
    config = json.loads(bench_serving.point_config(point, tmp_path / "config").read_text())
    assert "quantization_config" not in config and "text_config" not in config
    kinds = [layer.kind for layer in kv_cache_model(config).layers]
    assert (kinds.count("sliding"), kinds.count("full")) == (num_sliding, num_full)
    assert {layer.window_tokens for layer in kv_cache_model(config).layers if layer.kind == "sliding"} == {window}
    monkeypatch.setitem(bench_serving.MEASURE, "on", False)
    rows = bench_serving.run_point(name, point, Path("profiles/h100-sxm.yaml"), tmp_path, plan_only=True)
    pick = rows[0]
    assert pick["arm"] == "pick" and "error" not in pick and pick["offloaded"] > 0
    assert pick["predicted_activation_bytes"] > 0 and len(rows) >= 4
    assert any(line.startswith("| " + name) for line in bench_serving.table(rows))
