"""scripts/bench_serving.py's sliding-window points, planned on the CPU (the run itself needs the H100)."""

import json
from pathlib import Path

import pytest
import torch

from planner.model.kv_cache import kv_cache_model
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


#: the point's config cut in width only (layers, layer types, windows and heads' grouping kept), so its decode
#: runs on the CPU at the point's context
NARROW = {"hidden_size": 64, "intermediate_size": 64, "head_dim": 16, "vocab_size": 512, "pad_token_id": 0}


@pytest.mark.parametrize("name, batch", [("gemma3-16g-8k", 2), ("gpt-oss-16g-8k", 2)])
def test_sliding_points_decode_at_their_context_on_the_cpu(name, batch, tmp_path, monkeypatch):
    """What an arm's graphed decode runs, on the point's config narrowed to run on the CPU: the model as
    host_model builds it (bf16, the installed transformers' default attention), a cache filled to the point's
    8k context (rings past their windows), steps that build no mask on the host where transformers' own masks
    would not capture (gpt-oss: eager attention) and give the logits of the model's own masks bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.graph import DecodeLoop, cache_tokens_for
    from tests.runtime.test_step_masks import guard_host_tensors

    point = bench_serving.POINTS[name]
    config = AutoConfig.from_pretrained(bench_serving.point_config(point, tmp_path / "config").parent)
    heads = config.num_attention_heads // config.num_key_value_heads
    config.update(NARROW | {"num_key_value_heads": 1, "num_attention_heads": heads})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    eager = name.startswith("gpt-oss")
    results = []
    for own_masks in (False, True):
        loop = DecodeLoop(model, batch=batch, max_cache_tokens=cache_tokens_for(point.context_tokens),
                          device=torch.device("cpu"), steps_per_call=1)
        assert (loop.step_masks is not None) == eager
        loop.fill(point.context_tokens)
        if own_masks:
            loop.step_masks = None
            results.append(loop.generate(2))
            continue
        with monkeypatch.context() as guarded:
            if eager:
                guard_host_tensors(guarded)
            results.append(loop.generate(2))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
