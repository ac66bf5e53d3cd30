"""Does timing aliased layers under-measure an MoE decode step? Distinct layers against aliases of one.

    PYTHONPATH=. python3 scripts/experiments/measure_aliasing.py [--config PATH] [--context N] [--out DIR]

`make --measure` builds one layer of each kind with random weights and lets every other layer alias it
(runtime.measure.build_measure_model), so a model larger than the GPU can be timed. On an H200 it timed a
Qwen3-30B-A3B decode layer (1 sequence, 4k context, graphed) at 0.34 ms, where the all-resident model of 48
distinct random layers decodes at 28.5 ms a step (0.59 ms a layer). This times the same graphed decode step of
one model three ways: every layer distinct; every layer an alias of layer 0 (what measure does); and 8 distinct
layers cycled. It also records how many distinct experts the router picks over the step's layers, since aliased
layers share one router and may keep routing to the same few experts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

import torch

from runtime.graph import DecodeLoop, cache_tokens_for
from runtime.measure import set_layers, alias_module


def step_ms(model, context: int, **loop_options) -> float:
    loop = DecodeLoop(model, batch=1, max_cache_tokens=cache_tokens_for(context), device=torch.device("cuda"),
                      **loop_options)
    loop.fill(context)
    loop.capture()
    loop.timed_steps(5)
    return statistics.median(loop.timed_steps(20))


def routed_experts(model, stack: list) -> dict:
    """Distinct experts routed per layer and over all layers in one eager decode step (the routers' top-k)."""
    picks = []

    def hook(module, args, output):
        indices = next((t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point()), None) \
            if isinstance(output, tuple) else None
        if indices is None:  # a router that returns its logits: their top-k
            logits = output[0] if isinstance(output, tuple) else output
            indices = torch.topk(logits.float(), model.config.num_experts_per_tok, dim=-1).indices
        picks.append(indices.flatten().tolist())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in stack if hasattr(layer.mlp, "gate")]
    with torch.inference_mode():
        model(input_ids=torch.tensor([[11]], device="cuda"))
    for handle in handles:
        handle.remove()
    return {"layers": len(picks), "distinct_over_step": len({e for p in picks for e in p}),
            "first_layers": picks[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/qwen3-30b-a3b/config.json")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(pathlib.Path(args.config).parent)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    layers = list(model.model.layers)
    rows = {}
    for name, stack in (("distinct", layers),
                        ("aliases of layer 0", [layers[0]] + [alias_module(layers[0], i)
                                                              for i in range(1, len(layers))]),
                        ("8 distinct, cycled", [layers[i] if i < 8 else alias_module(layers[i % 8], i)
                                                for i in range(len(layers))])):
        set_layers(model, "model.layers", stack)
        ms = step_ms(model, args.context)
        rows[name] = {"step_ms": ms, "per_layer_ms": ms / len(layers), **routed_experts(model, stack)}
        print(name, json.dumps(rows[name]))
    # what else differs from scripts/bench_experts.py's all-resident arm (28 ms a step on the same GPU): one step
    # per replay, and deterministic algorithms (its bitwise checks turn them on for the whole process)
    set_layers(model, "model.layers", layers)
    rows["distinct, one step per replay"] = {"step_ms": step_ms(model, args.context, steps_per_call=1)}
    from scripts.benchmarking import deterministic_decode

    deterministic_decode()
    rows["distinct, deterministic algorithms"] = {"step_ms": step_ms(model, args.context)}
    for name in ("distinct, one step per replay", "distinct, deterministic algorithms"):
        print(name, json.dumps(rows[name]))
    result = {"device": torch.cuda.get_device_name(), "config": args.config, "context": args.context, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "measure_aliasing.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
