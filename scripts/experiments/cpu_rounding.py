"""Whether the CPU experts' bf16 rounding (runtime.cpu_kernel's partial_sum) gives the GPU's values at a real
expert size: one Qwen3-30B-A3B-shaped MoE layer (hidden 2048, 128 experts of 768, top-8) in bf16 on the GPU,
random weights scaled as trained ones, a few tokens routed by its own router.

Per (token, expert) pair, the share of output elements where two computations differ, and the largest difference
over the largest magnitude, for: the CPU rounded as the GPU (the C kernel, or torch's bf16 path where it is off)
against the GPU's batched_mm and grouped_mm; the CPU in fp32 throughout (the old path) against the same; the two
GPU functions against each other. Then the whole layer as the runtime finishes it (the GPU's fp32 partial sum,
the CPU experts' pairs at zero weight rows, plus the CPU's fp32 sum, rounded once) against the all-resident
layer through each function.

    PYTHONPATH=. python3 scripts/experiments/cpu_rounding.py [--tokens 1 4] [--cpu-experts 64]
"""

import argparse

import torch


def differ(actual: torch.Tensor, reference: torch.Tensor) -> str:
    """'share differing / largest difference over the largest magnitude'."""
    actual, reference = actual.float().cpu(), reference.float().cpu()
    share = float((actual != reference).float().mean())
    worst = float((actual - reference).abs().max() / reference.abs().max())
    return f"{share:.4f} / {worst:.1e}"


def layer(device: torch.device):
    """Qwen3-30B-A3B's MoE block with random weights (1 / sqrt(fan-in)) in bf16."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, param.shape[-1] ** -0.5)
    return block.to(device, torch.bfloat16).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--cpu-experts", type=int, default=64, help="experts 0..N-1 computed on the CPU")
    parser.add_argument("--device", default="cuda", help="the GPU (cpu: a smoke of this script)")
    args = parser.parse_args()
    from runtime.cpu_experts import HostExperts, compute_pairs, gpu_pair_outputs, gpu_partial_sum
    from runtime.cpu_handoff import cpu_layer, cpu_partial_sum
    from runtime.experts_impl import ExpertsProxy
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    device = torch.device(args.device)
    block = layer(device)
    experts = block.experts
    functions = {name: ALL_EXPERTS_FUNCTIONS[name] for name in ("batched_mm", "grouped_mm")}
    host = HostExperts.from_module(experts, "bf16")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "none (the CPU)"
    print(f"GPU {name}, torch {torch.__version__}, C kernel "
          f"{'on' if host.kernel is not None else 'off'}")
    cpu_ids = tuple(range(args.cpu_experts))
    gate_up, down = experts.gate_up_proj.detach().cpu(), experts.down_proj.detach().cpu()
    cpu = cpu_layer(experts, gate_up, down, cpu_ids, "bf16")
    zeroed = {name: getattr(experts, name).detach().clone() for name in ("gate_up_proj", "down_proj")}
    for tensor in zeroed.values():
        tensor[list(cpu_ids)] = 0
    for num_tokens in args.tokens:
        hidden = torch.randn(num_tokens, 2048, generator=torch.Generator().manual_seed(num_tokens)).to(
            device, torch.bfloat16)
        with torch.no_grad():
            _, weights, index = block.gate(hidden)
            ids = index.reshape(-1)
            pairs = {name: gpu_pair_outputs(experts, hidden, ids, forward) for name, forward in functions.items()}
            host_hidden = hidden.cpu()[torch.arange(num_tokens).repeat_interleave(index.shape[1])]
            rounded = compute_pairs(host, host_hidden, ids.cpu())  # bf16 hidden: rounded as the GPU
            plain = compute_pairs(host, host_hidden.float(), ids.cpu())  # fp32 throughout
            print(f"\n{num_tokens} token(s), {ids.numel()} pairs, weights {weights.dtype}; pairs differing "
                  "(share / worst):")
            print(f"  batched_mm vs grouped_mm        {differ(pairs['batched_mm'], pairs['grouped_mm'])}")
            for name in functions:
                print(f"  CPU rounded vs {name:<16} {differ(rounded, pairs[name])}")
                print(f"  CPU fp32    vs {name:<16} {differ(plain, pairs[name])}")
            out = torch.empty(num_tokens, 2048)
            cpu_partial_sum(cpu, hidden.cpu(), index.cpu(), weights.cpu(), out)
            on_cpu = sum(int(e in cpu_ids) for e in ids.tolist())
            print(f"  layer ({on_cpu} of {ids.numel()} pairs on the CPU), runtime's sum vs all-resident:")
            for name, forward in functions.items():
                reference = forward(experts, hidden, index, weights)
                partial = gpu_partial_sum(ExpertsProxy(experts, zeroed), hidden, ids, weights, forward)
                combined = (partial + out.to(device)).to(torch.bfloat16)
                alone = gpu_partial_sum(experts, hidden, ids, weights, forward).to(torch.bfloat16)
                print(f"    {name:<11} hybrid {differ(combined, reference)}; all on the GPU, summed so "
                      f"{differ(alone, reference)}")


if __name__ == "__main__":
    main()
