"""Can a CUDA graph move data-dependent experts with the copy engine? Conditional copies against the SM gather.

    PYTHONPATH=. python3 scripts/experiments/graph_conditional_copy.py [--out DIR]    # on a machine with a GPU

The routed-experts runtime gathers the experts a step routes to with GPU threads reading mapped host memory
(a Triton kernel), because the copy must live inside the captured step and a captured cudaMemcpy has fixed
addresses. On the H100 that gather reads at ~47 GB/s where the copy engine reaches ~55 GB/s. CUDA 12.4+ graphs
have conditional (IF) nodes whose body may hold memcpy nodes; torch exposes them as
``CUDAGraph.begin_capture_to_if_node(pred)`` / ``end_capture_to_conditional_node()``. One IF node per
non-resident expert, whose body copies that expert into its own slot, is a data-dependent copy done by the copy
engine inside the graph. This measures, for a Qwen3-30B-A3B-shaped step (48 layers, 128 experts of 9.4 MB,
39 resident, top-8 uniform routing, one sequence):

- eager copy-engine copies of the routed, non-resident experts (the floor's rate);
- the same copies captured unconditionally (a graph that knows the routing: an upper bound);
- IF nodes over every non-resident expert, a random routing per replay (the candidate);
- the same IF nodes all false (the nodes' own cost);
- the Triton gather of the same experts in a graph (what the runtime does today).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from runtime.calibrate import median_event_ms
from runtime.uva_gather import gather_rows

NUM_LAYERS = 48
NUM_EXPERTS = 128
TOP_K = 8
NUM_RESIDENT = 39
HIDDEN = 2048
INTERMEDIATE = 768
#: distinct host layers the step cycles through (the link's rate does not depend on which bytes it reads)
HOST_LAYERS = 2
REPEATS = 5


def routing(generator: torch.Generator) -> torch.Tensor:
    """[layers, E] bool: the experts one token routes to at each layer, uniform top-8."""
    picks = torch.rand(NUM_LAYERS, NUM_EXPERTS, generator=generator).argsort(dim=1)[:, :TOP_K]
    routed = torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.bool)
    routed.scatter_(1, picks, True)
    routed[:, :NUM_RESIDENT] = False  # resident experts never cross
    return routed


def host_store() -> dict[str, torch.Tensor]:
    """Pinned host experts: gate_up [HOST_LAYERS, E, 2I, H] and down [HOST_LAYERS, E, H, I], bf16."""
    return {"gate_up": torch.empty(HOST_LAYERS, NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, dtype=torch.bfloat16,
                                   pin_memory=True),
            "down": torch.empty(HOST_LAYERS, NUM_EXPERTS, HIDDEN, INTERMEDIATE, dtype=torch.bfloat16,
                                pin_memory=True)}


def slots(num_rows: int) -> dict[str, torch.Tensor]:
    """Device slot rows, one per non-resident expert."""
    return {"gate_up": torch.empty(num_rows, 2 * INTERMEDIATE, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            "down": torch.empty(num_rows, HIDDEN, INTERMEDIATE, dtype=torch.bfloat16, device="cuda")}


def expert_bytes(host) -> int:
    return sum(t[0, 0].numel() * t.element_size() for t in host.values())


def copy_expert(host, device, layer: int, expert: int, row: int) -> None:
    for name in host:
        device[name][row].copy_(host[name][layer % HOST_LAYERS, expert], non_blocking=True)


def static_copies(host, device, routed: torch.Tensor) -> None:
    for layer in range(NUM_LAYERS):
        for expert in routed[layer].nonzero().flatten().tolist():
            copy_expert(host, device, layer, expert, expert - NUM_RESIDENT)


def conditional_copies(graph: torch.cuda.CUDAGraph, host, device, predicates: torch.Tensor) -> None:
    """Captured: per layer, per non-resident expert, IF predicates[layer, expert] copy it into its slot."""
    for layer in range(NUM_LAYERS):
        for expert in range(NUM_RESIDENT, NUM_EXPERTS):
            graph.begin_capture_to_if_node(predicates[layer, expert])
            copy_expert(host, device, layer, expert, expert - NUM_RESIDENT)
            graph.end_capture_to_conditional_node()


def gather_step(host_views, device, ids: torch.Tensor) -> None:
    """The runtime's gather: per layer, the routed non-resident experts (ids, -1 padded) into slots."""
    for layer in range(NUM_LAYERS):
        for name in host_views:
            gather_rows(host_views[name][layer % HOST_LAYERS], device[name], ids[layer])


def captured(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(None)  # warm-up outside capture (compiles Triton, allocates)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(graph)
    torch.cuda.synchronize()
    return graph


def arm(name: str, fn, bytes_per_step: int, results: list) -> None:
    try:
        ms = fn()
        results.append({"arm": name, "ms": round(ms, 3), "gb_per_s": round(bytes_per_step / ms / 1e6, 2)})
    except Exception as error:  # an experiment: report what failed and go on
        results.append({"arm": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
    print(results[-1], file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    host = host_store()
    device = slots(NUM_EXPERTS - NUM_RESIDENT)
    routed = routing(generator)
    step_bytes = int(routed.sum()) * expert_bytes(host)
    print(f"routed non-resident experts per step: {int(routed.sum())} ({step_bytes / 1e6:.0f} MB)", file=sys.stderr)
    results: list[dict] = []

    arm("copy engine, eager", lambda: median_event_ms(lambda: static_copies(host, device, routed), repeats=REPEATS),
        step_bytes, results)

    def static_graph():
        graph = captured(lambda g: static_copies(host, device, routed))
        return median_event_ms(graph.replay, repeats=REPEATS)
    arm("copy engine, graph, routing known at capture", static_graph, step_bytes, results)

    predicates = torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.bool, device="cuda")

    def conditional(fill: torch.Tensor):
        def run():
            predicates.copy_(fill)
            graph = captured(lambda g: conditional_copies(g, host, device, predicates) if g is not None
                             else static_copies(host, device, fill.cpu()))
            predicates.copy_(fill)
            return median_event_ms(graph.replay, repeats=REPEATS)
        return run
    arm("IF node per non-resident expert, routed", conditional(routed.cuda()), step_bytes, results)
    arm("IF node per non-resident expert, all false (node cost)",
        conditional(torch.zeros_like(routed).cuda()), step_bytes, results)

    ids = torch.full((NUM_LAYERS, TOP_K), -1, dtype=torch.int64)
    for layer in range(NUM_LAYERS):
        chosen = routed[layer].nonzero().flatten()
        ids[layer, :chosen.numel()] = chosen
    ids = ids.cuda()
    from runtime.uva_gather import device_view
    host_views = {name: device_view(t, torch.device("cuda")) for name, t in host.items()}
    # the gather writes slot k; give it TOP_K rows
    gather_slots = slots(TOP_K)

    def gather_graph():
        graph = captured(lambda g: gather_step(host_views, gather_slots, ids))
        return median_event_ms(graph.replay, repeats=REPEATS)
    arm("Triton gather (SM reads of mapped host memory), graph", gather_graph, step_bytes, results)

    print("| arm | ms per step | GB/s of routed bytes |\n|---|---|---|")
    for row in results:
        print(f"| {row['arm']} | {row.get('ms', row.get('error'))} | {row.get('gb_per_s', '')} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "graph-conditional-copy.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "step_bytes": step_bytes,
             "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
