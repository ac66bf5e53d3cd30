"""GPU memory a process holds outside PyTorch's caching allocator, phase by phase, per architecture (question: what
a plan must book for it, and whether one figure per stack serves every model; issue 36 measured 1.45-1.49 GB
where plans booked 1 GiB).

    PYTHONPATH=. python3 scripts/experiments/outside_allocator.py [--json OUT.json]

Each architecture runs in a fresh process (kernels load lazily, so what one model loaded would count for the
next): the CUDA context alone, a bf16 matmul (cuBLAS), scaled-dot-product attention, the runtime's probe
(runtime.outside_memory), then a tiny model of the family built on the GPU: an eager prefill of 512 tokens and
decode steps captured in a CUDA graph and replayed (runtime.graph.DecodeLoop). Printed in MiB.
"""

import argparse
import json
import subprocess
import sys

import torch

#: tiny configs of the families the conformance sweep runs: small dims, the families' own modules and kernels
FAMILIES = {
    "llama": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 1024,
                  "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "num_experts": 16, "num_experts_per_tok": 4, "vocab_size": 32000,
                  "head_dim": 64},
    "mixtral": {"model_type": "mixtral", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 512, "intermediate_size": 1024,
                    "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                    "sliding_window": 128, "vocab_size": 32000},
}


def outside_bytes() -> int:
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    return total_bytes - free_bytes - torch.cuda.memory_reserved()


def one_family(name: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.graph import DecodeLoop, cache_tokens_for
    from runtime.outside_memory import probe_outside_allocator_bytes

    phases = {}
    torch.zeros(1, device="cuda")
    phases["context"] = outside_bytes()
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    phases["matmul"] = outside_bytes()
    q = torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
    phases["sdpa"] = outside_bytes()
    phases["probe"] = probe_outside_allocator_bytes(torch.device("cuda"))
    config = dict(FAMILIES[name])
    model_type = config.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 32000, (1, 512), device="cuda"), logits_to_keep=1)
    torch.cuda.synchronize()
    phases["eager prefill"] = outside_bytes()
    loop = DecodeLoop(model, batch=4, max_cache_tokens=cache_tokens_for(256), device=torch.device("cuda"))
    loop.fill(256)
    loop.capture()
    loop.timed_steps(3)
    torch.cuda.synchronize()
    phases["graphed decode"] = outside_bytes()
    return {"family": name, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "outside_mib": {k: round(v / 2**20, 1) for k, v in phases.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", help="run one family in this process (the parent runs each in a child)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.family:
        print(json.dumps(one_family(args.family)))
        return 0
    rows = []
    for name in FAMILIES:
        done = subprocess.run([sys.executable, __file__, "--family", name], capture_output=True, text=True)
        if done.returncode:
            rows.append({"family": name, "error": done.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
