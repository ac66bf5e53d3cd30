"""make --measure builds its model in the dtype run loads the checkpoint in (issue 36: an fp32 checkpoint's serving
plan, measured in bf16, booked half its activations and ran out of memory at its cap on the H200)."""

import json

import torch

from planner.source.checkpoint import load_checkpoint
from runtime.measure import build_measure_model, measure_dtype, measured_config, measured_kinds
from planner.model.layout import build_layout
from tests.runtime_models import save_tiny_llama


def test_the_measured_model_takes_the_checkpoints_dtype(tmp_path):
    folder = save_tiny_llama(tmp_path / "fp32", num_layers=2)  # fp32 weights
    checkpoint = load_checkpoint(str(folder))
    assert measure_dtype(measured_config(checkpoint)) == torch.float32
    layout = build_layout(checkpoint)
    config = measured_config(checkpoint)
    model = build_measure_model(config, measured_kinds(layout, config), layout.stack, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_config_silent_on_its_dtype_is_measured_in_its_weights_dtype(tmp_path):
    """transformers' config classes write configs that name no dtype: the headers' dtype, as run loads them."""
    folder = save_tiny_llama(tmp_path / "silent", num_layers=2, dtype=torch.float16)
    config = json.loads((folder / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    assert measure_dtype(measured_config(load_checkpoint(str(folder)))) == torch.float16
    assert measure_dtype({}) == torch.bfloat16 and measure_dtype({"dtype": "auto"}) == torch.bfloat16
