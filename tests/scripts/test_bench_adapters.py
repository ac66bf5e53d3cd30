"""scripts/bench_adapters.py --tiny: the H100 benchmark's logic end to end on the CPU stand-in (make with
adapters, load, serve blocking and pipelined, compare with PEFT)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]


def test_tiny_bench_serves_both_modes_equal_to_peft(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(tmp_path / "out"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_adapters.py"), "--tiny", "--work-dir",
                           str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "bench_adapters.json").read_text())
    assert [row["label"] for row in results["plans"]] == ["resident", "half offloaded"]
    assert results["plans"][1]["num_offloaded"] == 2
    for row in results["plans"]:
        assert {mode["mode"] for mode in row["bench"]["modes"]} == {"blocking", "pipelined"}
        assert all(check["bitwise_equal"] for check in row["peft"].values())
        assert all(mode["num_copies"] >= 8 for mode in row["bench"]["modes"])  # more adapters than slots
        # run --prompt --adapter's path against PEFT's generation, 64 greedy tokens
        assert row["generation"]["equal"] and row["generation"]["num_tokens"] == 64
    checks = results["checks"]
    assert [check["label"] for check in checks] == ["resident", "half offloaded"]
    for check in checks:
        assert check["plan_mode"] in ("blocking", "pipelined") and check["chosen_over_faster"] >= 1.0
        assert len(check["figures"]) == 6  # first start, TTFT mean and idle, each mode
    assert "issue 27 targets" in proc.stdout and "greedy tokens equal to PEFT's" in proc.stdout
    # every phase timed, the second placement's PEFT logits taken from the first's
    phases = results["phase_seconds"]
    assert phases["total"] >= sum(v for k, v in phases.items() if k != "total") > 0
    assert "phase seconds:" in proc.stdout


def test_streamed_checkpoint_is_what_from_pretrained_loads(tmp_path):
    """The bench's checkpoint, written tensor by tensor without building the model, in shards with an index:
    transformers loads every weight from it (none missing, none left over), norms around 1, the rest small."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from scripts import bench_adapters

    folder = tmp_path / "checkpoint"
    bench_adapters.write_base(bench_adapters.TINY, folder, "cpu")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    names = set()
    for file in set(index["weight_map"].values()):
        with safe_open(folder / file, "pt") as opened:
            names |= set(opened.keys())
            assert all(opened.get_tensor(name).dtype == torch.bfloat16 for name in opened.keys())
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert names == set(index["weight_map"]) == set(model.state_dict())
    assert not info["missing_keys"] and not info["unexpected_keys"]
    norm = model.model.norm.weight.float()
    assert (norm - 1).abs().max() < 0.2 and model.lm_head.weight.float().abs().mean() < 0.05
    assert model.config.architectures == ["Qwen3ForCausalLM"] and model.dtype == torch.bfloat16


def test_adapters_written_without_peft_are_peft_s_format(tmp_path):
    """The bench's PEFT-free writer (for a GPU host without PEFT) writes what PEFT itself loads, with the same
    outputs as PEFT's adapter over the same weights."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Qwen3Config

    from scripts.bench_adapters import write_random_adapters

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    base = AutoModelForCausalLM.from_config(config).eval()
    folders = write_random_adapters(base, tmp_path, ["x"], rank=4)
    wrapped = PeftModel.from_pretrained(base, folders["x"], autocast_adapter_dtype=False)
    lora = {name for name, _ in wrapped.named_parameters() if "lora_" in name}
    assert len(lora) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 layers
    ids = torch.arange(8).reshape(1, 8)
    with torch.inference_mode():
        adapted = wrapped(input_ids=ids).logits
        with wrapped.disable_adapter():
            plain = wrapped(input_ids=ids).logits
    assert not torch.equal(adapted, plain)  # the adapter was loaded and applies
