"""Smoke test and timing of CPU experts inside the captured decode step, on one CUDA GPU in under two minutes.

    PYTHONPATH=. python3 scripts/smoke_cpu_experts_graph.py [--replays 200] [--threads N]

Prints one PASS/FAIL line per check, then TIME lines, and exits 1 if any check failed:

1. a host node alone: a ctypes callback (runtime.cpu_handoff.launch_host_func) that counts, captured in a CUDA
   graph on a side stream and replayed 3 times: count 3 (it would hang here if a replay could not take the GIL;
   a watchdog then dumps every thread's stack and exits);
2. a tiny bf16 Qwen3-MoE (tests.runtime_models.routed_moe_model) with routed layers and CPU experts: graphed greedy
   16 tokens equal to the all-resident model's, logits within runtime.cpu_experts.BF16_TOLERANCE, eager within the
   same of graphed, the CPU counters non-zero;
3. one Qwen3-30B-A3B-shaped routed layer (hidden 2048, moe_intermediate 768, 128 experts top-8, bf16, random
   weights; router and experts, 32 experts resident), graphed at one token: ms per layer step all-resident,
   fetch-only, and hybrid with k of the non-resident experts on the CPU (fp32 host copy at k in 8, 32, 64; bf16
   read in place at 16, 32, 48, 64), by each handoff of ``--handoffs`` (runtime.cpu_handoff.HANDOFFS), with the
   CPU's share of the pairs, the host step's own ms per step and the experts fetched per step. The hybrid step
   minus max(the GPU's part, the host step) is what the handoff costs.
"""

import argparse
import copy
import faulthandler
import os
import sys
import time

import torch
from torch import nn

CUDA = torch.device("cuda")
WATCHDOG_S = 170
HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 2048, 768, 128, 8
NUM_RESIDENT = 32
results: list[bool] = []


def report(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
    results.append(ok)
    return ok


def check_host_node() -> None:
    from runtime.cpu_handoff import HOST_FN, launch_host_func

    calls = []
    callback = HOST_FN(lambda _user_data: calls.append(1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # fork onto a side stream and join back, as the decode step does
        capture = torch.cuda.current_stream()
        side.wait_stream(capture)
        with torch.cuda.stream(side):
            launch_host_func(side, callback)
        capture.wait_stream(side)
    torch.cuda.synchronize()
    captured_ran = len(calls)
    start = time.perf_counter()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / 3
    report("host node captured and replayed 3 times", captured_ran == 0 and len(calls) == 3,
           f"count {len(calls)} (0 at capture: {captured_ran == 0}), {ms:.3f} ms per replay")


def _tiny_decode(model, graphed: bool, after_capture=None, num_steps: int = 16):
    from runtime.graph import DecodeLoop

    loop = DecodeLoop(model, batch=1, max_cache_tokens=40 + num_steps + 16, device=CUDA, steps_per_call=1)
    loop.prefill(torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1)).to(CUDA))
    if graphed:
        loop.capture()
    if after_capture is not None:
        after_capture()
    ids, logits = loop.generate(num_steps)
    return ids.cpu(), [out.cpu().float() for out in logits]


def _worst(actual, reference) -> float:
    """The largest |difference| over the steps, as a share of the reference's largest magnitude."""
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(actual, reference))


def check_tiny_model() -> None:
    from runtime.backend import CudaBackend
    from runtime.cpu_experts import BF16_TOLERANCE
    from runtime.routed_layers import apply_routed_experts
    from tests.runtime_models import routed_moe_model

    routed_layers = {0: (1, 5, 9, 30), 1: (), 2: tuple(range(24))}
    cpu = {0: (0, 2, 4, 6, 8, 10), 1: tuple(range(0, 32, 3)), 2: (24, 27)}
    model = routed_moe_model(hidden=256, num_experts=32, top_k=4, dtype=torch.bfloat16)
    expected_ids, expected = _tiny_decode(copy.deepcopy(model).to(CUDA), graphed=False)
    routed_model = copy.deepcopy(model)
    routed = apply_routed_experts(routed_model, routed_layers, 4, CudaBackend(CUDA), cpu=cpu)
    routed_model.to(CUDA)
    try:
        ids, logits = _tiny_decode(routed_model, graphed=True, after_capture=routed.reset_counters)
        stats = routed.cpu_stats()
        print(f"  (the handoff: {routed.cpu_experts.handoff})", flush=True)
        report("tiny model: graphed greedy 16 tokens equal all-resident", torch.equal(ids, expected_ids),
               f"{ids.flatten().tolist()} vs {expected_ids.flatten().tolist()}")
        worst = _worst(logits, expected)
        report("tiny model: graphed logits within BF16_TOLERANCE of all-resident", worst <= BF16_TOLERANCE,
               f"worst {worst:.2e} of max |logit| (tolerance {BF16_TOLERANCE:.2e})")
        report("tiny model: CPU counters non-zero", stats["calls"] == 3 * 16 and stats["pairs_cpu"] > 0,
               f"{stats['calls']} layer steps, {stats['pairs_cpu']} of {stats['pairs_total']} pairs on the CPU, "
               f"callback {stats['callback_ms_per_call']:.3f} ms per layer step")
        eager_ids, eager = _tiny_decode(routed_model, graphed=False)
        worst = _worst(eager, logits)
        report("tiny model: eager within BF16_TOLERANCE of graphed",
               torch.equal(eager_ids, ids) and worst <= BF16_TOLERANCE, f"worst {worst:.2e}, bitwise "
               f"{all(torch.equal(a, b) for a, b in zip(eager, logits))}")
    finally:
        routed.close()


# ---- timing one Qwen3-30B-A3B-shaped routed layer -----------------------------------------------------------------


def layer_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Host bf16 weights of one layer: 8 random experts (scaled as trained ones) repeated to 128, router on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    repeats = NUM_EXPERTS // 8
    gate_up = torch.randn(8, 2 * INTERMEDIATE, HIDDEN, generator=generator).mul_(HIDDEN ** -0.5).bfloat16()
    down = torch.randn(8, HIDDEN, INTERMEDIATE, generator=generator).mul_(INTERMEDIATE ** -0.5).bfloat16()
    router = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator).mul_(HIDDEN ** -0.5).bfloat16()
    return {"gate_up_proj": gate_up.repeat(repeats, 1, 1), "down_proj": down.repeat(repeats, 1, 1),
            "router": router.to(CUDA)}


def layer_stack(weights: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose ``layers[0].mlp`` is a Qwen3-MoE sparse block over ``weights`` (params shared, not copied)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS,
                            num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=128, vocab_size=256)
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(config)
    for name in ("gate_up_proj", "down_proj"):
        setattr(block.experts, name, nn.Parameter(weights[name], requires_grad=False))
    block.gate.weight = nn.Parameter(weights["router"], requires_grad=False)
    layer = nn.Module()
    layer.mlp = block
    stack = nn.Module()
    stack.layers = nn.ModuleList([layer])
    return stack


def time_layer(weights, resident: tuple[int, ...], cpu_ids: tuple[int, ...], cpu_dtype: str, threads: int | None,
               replays: int) -> dict:
    """ms per graphed step of the routed layer at one token (inputs cycled over 64 random tokens), and its counts."""
    from runtime.backend import CudaBackend
    from runtime.routed_layers import apply_routed_experts

    stack = layer_stack(weights)
    routed = apply_routed_experts(stack, {0: resident}, TOP_K, CudaBackend(CUDA), stack="layers",
                                  cpu={0: cpu_ids}, cpu_dtype=cpu_dtype, cpu_threads=threads)
    block = stack.layers[0].mlp
    try:
        inputs = torch.randn(64, 1, 1, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16().to(CUDA)
        x = inputs[0].clone()
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm), torch.inference_mode():
            for _ in range(3):  # Triton compiles, cuBLAS and the host node's thread wake up here
                block(x)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            block(x)
        for step in range(5):
            x.copy_(inputs[step])
            graph.replay()
        torch.cuda.synchronize()
        routed.reset_counters()
        start = time.perf_counter()
        for step in range(replays):
            x.copy_(inputs[step % len(inputs)])
            graph.replay()
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - start) / replays
        stats = routed.cpu_stats() or {}
        return {"ms": ms, "fetched": routed.fetched_bytes() / routed.expert_bytes / replays,
                "share": stats.get("pairs_share", 0.0), "callback_ms": stats.get("callback_ms_per_call", 0.0),
                "cpu_host_bytes": routed.cpu_host_bytes}
    finally:
        routed.close()


def time_qwen3_layer(replays: int, threads: int | None, handoffs: list[str]) -> None:
    weights = layer_weights()
    resident = tuple(range(NUM_RESIDENT))
    non_resident = tuple(range(NUM_RESIDENT, NUM_EXPERTS))
    arms = [("all resident", tuple(range(NUM_EXPERTS)), (), "fp32", None),
            ("fetch-only", resident, (), "fp32", None)]
    for handoff in handoffs:
        arms += [(f"{handoff} k={k} fp32", resident, non_resident[:k], "fp32", handoff) for k in (8, 32, 64)]
        arms += [(f"{handoff} k={k} bf16", resident, non_resident[:k], "bf16", handoff) for k in (16, 32, 48, 64)]
    print(f"Qwen3-30B-A3B-shaped routed layer, 1 token, graphed, {NUM_RESIDENT} resident, "
          f"{threads or torch.get_num_threads()} CPU threads, {replays} replays", flush=True)
    for name, resident_ids, cpu_ids, dtype, handoff in arms:
        if handoff:
            os.environ["OFFLOAD_PLAN_CPU_HANDOFF"] = handoff
        try:
            row = time_layer(weights, resident_ids, cpu_ids, dtype, threads, replays)
        except Exception as error:  # noqa: BLE001 - one line per arm, the others still run
            report(f"timing {name}", False, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        print(f"TIME {name:24s} {row['ms']:7.3f} ms/layer step; fetched {row['fetched']:5.2f} experts/step; CPU "
              f"share of pairs {row['share']:.3f}; callback {row['callback_ms']:.3f} ms/step; CPU host copy "
              f"{row['cpu_host_bytes'] / 2**20:.1f} MiB", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's count)")
    parser.add_argument("--handoffs", nargs="+", default=["doorbell", "host-node"],
                        help="the handoffs to time (runtime.cpu_handoff.HANDOFFS)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL needs a CUDA GPU")
        return 1
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang (GIL, host node) shows where, then exits
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for check in (check_host_node, check_tiny_model):
        started = time.perf_counter()
        try:
            check()
        except Exception as error:  # noqa: BLE001 - report and go on to the next check
            report(check.__name__, False, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        print(f"  ({check.__name__}: {time.perf_counter() - started:.1f} s)", flush=True)
    started = time.perf_counter()
    time_qwen3_layer(args.replays, args.threads, args.handoffs)
    print(f"  (timing: {time.perf_counter() - started:.1f} s)", flush=True)
    print("ALL PASS" if all(results) else "SOME FAILED", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
