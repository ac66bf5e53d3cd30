"""How much a hybrid layer's wait grows from the spread of a step's routing: E[max(link, CPU)] against the
planner's max(E[link], E[CPU]), by Monte Carlo over one sequence's top-k draw (no GPU; the inputs are the H200 runs
of 2026-11-28, benchmarks/2026-11-28-cpu-experts-grid-h200.md, section 4).

    PYTHONPATH=. python3 scripts/experiments/cpu_split_spread.py

Per layer, one token draws top_k distinct experts of num_experts uniformly: those among the CPU's ids cost the
CPU a pair each after the handoff, those among the fetched ids cost the link an expert each, resident ones
nothing; the layer waits for the later path. The prefetch is left out (it takes part of the link's share).
"""

import random

#: name: (experts, top-k, resident, on the CPU, CPU ms a pair inside the step, link ms an expert, handoff ms)
LAYERS = {
    "Mixtral-8x7B, the fitted CPU price": (8, 2, 1, 3, 7.57, 7.18, 0.015),
    "Mixtral-8x7B, the shipped 2.0x": (8, 2, 1, 3, 11.15, 7.18, 0.015),
    "Qwen3-30B-A3B, the fitted CPU price": (128, 8, 31, 34, 0.282, 0.2006, 0.015),
}
NUM_LAYERS = 8
NUM_DRAWS = 100_000


def waits_ms(num_experts: int, top_k: int, resident: int, on_cpu: int, cpu_ms: float, link_ms: float,
             handoff_ms: float, draws: int = NUM_DRAWS, seed: int = 0) -> tuple[float, float]:
    """(E[max], max of the expectations) of one layer's wait, ms: ids below ``resident`` resident, the next
    ``on_cpu`` on the CPU, the rest fetched."""
    rng = random.Random(seed)
    total = cpu_pairs = fetched = 0.0
    for _ in range(draws):
        picks = rng.sample(range(num_experts), top_k)
        cpu = sum(resident <= e < resident + on_cpu for e in picks)
        link = sum(e >= resident + on_cpu for e in picks)
        cpu_pairs, fetched = cpu_pairs + cpu, fetched + link
        total += max(link * link_ms, handoff_ms + cpu * cpu_ms if cpu else 0.0)
    return total / draws, max(fetched / draws * link_ms, handoff_ms + cpu_pairs / draws * cpu_ms)


def main() -> None:
    print(f"| layer | E[max] a step ({NUM_LAYERS} layers), ms | max of expectations, ms |")
    print("|---|---|---|")
    for name, layer in LAYERS.items():
        spread, means = waits_ms(*layer)
        print(f"| {name} | {NUM_LAYERS * spread:.2f} | {NUM_LAYERS * means:.2f} |")


if __name__ == "__main__":
    main()
