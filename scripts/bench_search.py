"""Time the plan search: ``make`` end to end, ``search()`` alone, and a serving sweep of many searches.

Builds header-only checkpoints (sparse shards, a few MB on disk) of a Llama-3.1-405B-shaped model (126 layers)
and a 300-layer small model under ``--workdir``, then times on this machine's CPU:

- ``make``: the whole command (headers, layout, compute estimate, search, plan), at a few budgets, eager and
  ``--cuda-graph``;
- ``search``: the search alone, at a tight budget (just above the least any plan needs), a medium one and one
  where nearly everything fits, eager and graphed (``join_every_steps=1``);
- ``sweep``: what a serving ``make`` does (issue 13): one search per candidate decode concurrency B (powers
  of two and their midpoints up to 512), each with B's compute times and the GPU memory left after B's KV
  cache as its budget; infeasible budgets are skipped.

    PYTHONPATH=. python3 scripts/bench_search.py              # the table (a minute; before Searcher, hours)
    PYTHONPATH=. python3 scripts/bench_search.py --profile sweep-small300-graph   # cProfile of one row, stderr

The table goes to stdout (wall seconds of the row's work, and the CPU seconds of the whole row, which also
counts building the compute times: on a shared machine the CPU column is the steadier one); progress to
stderr.
"""

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

from planner.source.header_checkpoint import write_sparse_shards

from planner.search import groups as search_module
from planner.source.checkpoint import load_checkpoint
from planner.model.cost import Workload, estimate_compute, geometry_from_config
from planner.errors import InfeasibleError
from planner.model.layout import build_layout
from planner.make.make_plan import make_plan
from planner.plan.schema import Inputs
from planner.source.profile import load_profile
from planner.search.groups import LayerBytes, gpu_bytes_of, minimum_gpu_bytes, search
from planner.search.simulate import join_every_steps_for

GPU = "h100-sxm"
#: name -> llama-style shape
MODELS = {
    "405b": dict(num_layers=126, hidden=16384, heads=128, kv_heads=8, intermediate=53248, vocab=128256),
    "small300": dict(num_layers=300, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32000),
}
#: budget name -> share of the way from the least GPU bytes any plan needs to all resident
BUDGET_SHARES = {"tight": 0.05, "medium": 0.5, "nearly": 0.98}
#: decode concurrencies a serving make tries: powers of two and their midpoints up to 512
CONCURRENCIES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
SWEEP_CONTEXT_TOKENS = 4096
KV_ELEMENT_BYTES = 2


def llama_specs(shape: dict) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every bf16 tensor of a llama checkpoint with untied embeddings."""
    hidden, inter = shape["hidden"], shape["intermediate"]
    kv = shape["kv_heads"] * hidden // shape["heads"]
    specs = [("model.embed_tokens.weight", [shape["vocab"], hidden]), ("model.norm.weight", [hidden]),
             ("lm_head.weight", [shape["vocab"], hidden])]
    for i in range(shape["num_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden]),
                  (p + "self_attn.q_proj.weight", [hidden, hidden]), (p + "self_attn.k_proj.weight", [kv, hidden]),
                  (p + "self_attn.v_proj.weight", [kv, hidden]), (p + "self_attn.o_proj.weight", [hidden, hidden]),
                  (p + "mlp.gate_proj.weight", [inter, hidden]), (p + "mlp.up_proj.weight", [inter, hidden]),
                  (p + "mlp.down_proj.weight", [hidden, inter])]
    return sorted((name, "BF16", dims) for name, dims in specs)


def build_checkpoint(folder: Path, shape: dict) -> Path:
    """Write config.json and sparse shards once; later runs reuse them."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
              "intermediate_size": shape["intermediate"], "num_attention_heads": shape["heads"],
              "num_key_value_heads": shape["kv_heads"], "head_dim": shape["hidden"] // shape["heads"],
              "num_hidden_layers": shape["num_layers"], "vocab_size": shape["vocab"],
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if (folder / "config.json").exists() and json.loads((folder / "config.json").read_text()) == config:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    write_sparse_shards(llama_specs(shape), folder, 5 * 2**30)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


class Model:
    """What make reads from a checkpoint, kept to call the search directly."""

    def __init__(self, path: Path, shape: dict):
        self.path, self.shape = path, shape
        self.profile = load_profile(GPU)
        self.checkpoint = load_checkpoint(str(path), None)
        self.layout = build_layout(self.checkpoint, None)
        self.layers = LayerBytes(total=tuple(layer.nbytes for layer in self.layout.layers),
                                 selected=tuple(layer.matching_bytes(()) for layer in self.layout.layers),
                                 num_tensors=len(self.checkpoint.tensors))
        self.fixed_bytes = self.layout.non_layer_bytes
        self.least_bytes = minimum_gpu_bytes(self.fixed_bytes, self.layers)
        self.resident_bytes = gpu_bytes_of(self.fixed_bytes, self.layers, (), 0)

    def compute(self, batch: int, context_tokens: int):
        workload = Workload(tokens_per_step=batch, sequences_per_step=batch, context_tokens=context_tokens)
        geometry = geometry_from_config(self.checkpoint.config, self.layout)
        shapes = {t.name: t.shape for t in self.checkpoint.tensors}
        return estimate_compute(self.layout, geometry, workload, self.profile, shapes)

    def budget(self, share: float) -> int:
        return int(self.least_bytes + share * (self.resident_bytes - self.least_bytes))

    def kv_bytes(self, batch: int, context_tokens: int) -> int:
        head_dim = self.shape["hidden"] // self.shape["heads"]
        per_token = self.shape["num_layers"] * 2 * self.shape["kv_heads"] * head_dim * KV_ELEMENT_BYTES
        return batch * context_tokens * per_token

    def search_args(self) -> dict:
        return dict(layers=self.layers, fixed_bytes=self.fixed_bytes,
                    h2d_bytes_per_s=self.profile.h2d_bytes_per_s.value,
                    copy_overhead_us=self.profile.copy_overhead_us.value)


def time_make(model: Model, budget: int, graphed: bool) -> float:
    inputs = Inputs(model=str(model.path), revision=None, gpu=GPU, budget=str(budget), trigger=None,
                    tokens=64 if graphed else 2048, sequences=64 if graphed else 1, context=1024 if graphed else 0,
                    params=(), stack=None, group_size=None, num_in_group=None, prefetch_step=None,
                    cuda_graph=graphed)
    start = time.perf_counter()
    make_plan(inputs)
    return time.perf_counter() - start


def time_search(model: Model, budget: int, graphed: bool) -> tuple[float, str]:
    compute = model.compute(64, 1024) if graphed else model.compute(2048, 0)
    start = time.perf_counter()
    choice = search(**model.search_args(), compute=compute, budget_bytes=budget,
                    join_every_steps=join_every_steps_for(graphed))
    return time.perf_counter() - start, _describe(choice)


def sweep_cases(model: Model, spread: bool) -> list[tuple[int, object, int]]:
    """(batch, compute, budget) per concurrency: the budget is the GPU memory less B's KV cache.

    spread=False: the profile's weight limit (80 GB less its reserve) at a 4096-token context, as a serving
    make on an H100 would search. spread=True: a GPU and context chosen so that the budgets run from everything
    resident at B=1 to nearly the least any plan needs at B=512, every search a feasible one.
    """
    if spread:
        per_sequence = model.kv_bytes(1, 1)
        context = int(0.95 * (model.resident_bytes - model.least_bytes) / (per_sequence * (CONCURRENCIES[-1] - 1)))
        memory = model.resident_bytes + model.kv_bytes(1, context)
    else:
        context, memory = SWEEP_CONTEXT_TOKENS, model.profile.weight_limit_bytes
    return [(b, model.compute(b, context), memory - model.kv_bytes(b, context)) for b in CONCURRENCIES]


def time_sweep(model: Model, graphed: bool, spread: bool) -> tuple[float, str]:
    """One search per concurrency, with the repeated-search API where this version of the planner has one."""
    cases = sweep_cases(model, spread)
    join = join_every_steps_for(graphed)
    start = time.perf_counter()
    feasible = 0
    searcher_class = getattr(search_module, "Searcher", None)
    if searcher_class is not None:
        searcher = searcher_class(**model.search_args(), join_every_steps=join)
        for _, compute, budget in cases:
            if searcher.fits(budget):
                searcher.search(compute=compute, budget_bytes=budget)
                feasible += 1
    else:
        for _, compute, budget in cases:
            try:
                search(**model.search_args(), compute=compute, budget_bytes=budget, join_every_steps=join)
                feasible += 1
            except InfeasibleError:
                pass
    return time.perf_counter() - start, f"{feasible} of {len(cases)} concurrencies feasible"


def _describe(choice) -> str:
    if not choice.offloaded:
        return "all resident"
    return (f"{len(choice.offloaded)} offloaded (G={choice.group_size} K={choice.num_in_group} "
            f"P={choice.prefetch_step}) {choice.simulation.step_ms:.2f} ms")


def rows(models: dict[str, Model], quick: bool):
    """(row name, callable returning (seconds, what it found))."""
    for name, model in models.items():
        for graphed in (False, True):
            mode = "graph" if graphed else "eager"
            yield f"sweep-{name}-{mode}", lambda m=model, g=graphed: time_sweep(m, g, spread=True)
            if name == "405b":
                yield f"sweep-{name}-h100-{mode}", lambda m=model, g=graphed: time_sweep(m, g, spread=False)
            for budget_name, share in BUDGET_SHARES.items():
                yield (f"search-{name}-{budget_name}-{mode}",
                       lambda m=model, g=graphed, s=share: time_search(m, m.budget(s), g))
            if quick:
                continue
            for budget_name in ("tight", "medium"):
                budget = min(model.budget(BUDGET_SHARES[budget_name]), model.profile.weight_limit_bytes)
                yield (f"make-{name}-{budget_name}-{mode}",
                       lambda m=model, g=graphed, b=budget: (time_make(m, b, g), f"budget {b / 2**30:.1f} GiB"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".cache/bench_search"))
    parser.add_argument("--only", default="", help="run rows whose name contains this")
    parser.add_argument("--quick", action="store_true", help="skip the make rows")
    parser.add_argument("--profile", metavar="ROW", help="cProfile the named row (exact name) to stderr")
    args = parser.parse_args()
    models = {name: Model(build_checkpoint(args.workdir / name, shape), shape) for name, shape in MODELS.items()}
    table = []
    for name, run in rows(models, args.quick):
        if args.profile:
            if name == args.profile:
                profiler = cProfile.Profile()
                profiler.runcall(run)
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
            continue
        if args.only not in name:
            continue
        cpu_start = time.process_time()
        seconds, found = run()
        cpu_seconds = time.process_time() - cpu_start
        print(f"{name}: {seconds:.3f} s ({cpu_seconds:.3f} s CPU)  {found}", file=sys.stderr)
        table.append((name, seconds, cpu_seconds, found))
    if table:
        width = max(len(row[0]) for row in table)
        print(f"{'row':<{width}}  {'seconds':>8}  {'cpu s':>8}  found")
        for name, seconds, cpu_seconds, found in table:
            print(f"{name:<{width}}  {seconds:8.3f}  {cpu_seconds:8.3f}  {found}")


if __name__ == "__main__":
    main()
