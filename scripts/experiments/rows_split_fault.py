"""What read as a fault of make --cpu-experts rows (an expert split by its rows between the CPU and the link): a
router's near tie, on a GPU.

    PYTHONPATH=. python3 scripts/experiments/rows_split_fault.py --gpu PROFILE [--layers | --routing]

scripts/conformance.py's phimoe model (PhiMoE widths, 3 layers, release format) at its serving-4 tight cap, made
estimated as the sweep makes it, once with --cpu-experts rows and once with auto (whole CPU experts), then each
decoded greedily at one sequence (the graphed static-cache decode run --prompt uses) against the all-resident plan,
by both handoffs: the worst logit difference per step as a share of the step's largest (conformance.first_split).

On the H200 on 2026-11-29 the rows plan's step 2 was 0.554 and step 7 0.204 of the largest logit off, by either
handoff alike (deterministic), where auto's steps stayed within 0.008; the same tables on the CPU stand-in at the
full PhiMoE widths (2 layers, the torch twins of the fused plan and the gather, the C kernel) stayed within 0.0045.
That first pointed at a GPU-only piece (the fused fetch plan's part, the gather's part tiles, or the routed layer
around them); tests/runtime's GPU tests of those pieces pass on a small model.

--layers narrows it: the rows plan decoded eagerly with each routed layer step's output checked against the
step's experts computed in fp32 from the host copy (the worst steps printed with their fetch plan), decoded again
with the C kernel off (torch's CPU path), and the compiled fetch plan and gather at this shape against their
torch twins. On the H200 on 2026-11-29: every one of the 102 layer steps (95 with a part) within 0.0065 of its
fp32 experts, the fused plan equal to its twin in 900 random steps and the gather in 18 parts; yet the eager
decode's logits were 0.554 off at step 2 and back to 0.012 at step 3, and with the C kernel off the jump came at
step 10 instead. A one-step jump with correct experts: a router's choice, which no expert check sees.

--routing: both plans and the all-resident one decoded eagerly with every routed call's routing recorded
(conformance.routing_against): the first call whose routing differs, its step and layer, and its input against
the all-resident decode's. On the H200 on 2026-11-29 the rows plan's first differing call was step 2, layer 1:
the same two experts, the second's weight 0.504 where all-resident's was 1.0, on an input within 0.39% of
all-resident's: PhiMoE's sparsemixer keeps a second score in the softmax only within 2 x jitter_eps (0.01) of
the first, relative, and the CPU's fp32 sums had moved one across that threshold. The whole-experts plan's
decode first differed at step 8 (after its tokens had split at 7). So the "fault" is the router's discontinuity
at a near tie, which conformance's tokens verdict now tells from a fault (routing_against).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from runtime.cpu_experts import BF16_TOLERANCE
from scripts import conformance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", required=True, help="a calibrated profile with a cpu_experts section")
    parser.add_argument("--work", type=Path, default=Path("/tmp/rows-split-fault"))
    parser.add_argument("--layers", action="store_true", help="check each layer step and the kernels (docstring)")
    parser.add_argument("--routing", action="store_true", help="compare the routing with all-resident's (docstring)")
    args = parser.parse_args()
    start = time.time()
    model = conformance.MODELS["phimoe"]
    folder, _ = conformance.ensure_checkpoint(model, args.work / "checkpoints", False, "cuda")
    caps = conformance.caps_for(folder, args.gpu, moe=True, graphed=model.graphed)
    arm = conformance.Arm(model="phimoe", mode="serving-4", cap="tight", measure=False)
    args.work.mkdir(parents=True, exist_ok=True)
    reference = conformance.reference_path(args.work, False)
    resident = ["--tokens", 1, "--sequences", 1, "--context", conformance.DECODE_CONTEXT, *model.graph_flags,
                "--budget", conformance.mib(caps["all_resident_budget"])]
    conformance.cli(["make", "--model", folder, "--gpu", args.gpu, *resident, "-o", reference])
    reference_logits = conformance.reference_logits(reference)
    if args.layers:
        probe(args.work, folder, args.gpu, caps, arm, reference_logits)
        return
    if args.routing:
        for choice in ("rows", "auto"):
            path = args.work / f"{choice}.yaml"
            made = conformance.cli([*conformance.make_args(arm, folder, args.gpu, caps, path), "--cpu-experts",
                                    choice])
            assert not made.code, made.error
            routing = conformance.routing_against(path, reference, BF16_TOLERANCE)
            print(f"{choice} eager: split at {routing['split_at']}, worst {routing['worst_share']:.4f}, beyond the "
                  f"tolerance at {routing['beyond_tolerance_at']}, router tie {routing['router_tie']}, first flip "
                  f"{routing['flip']} ({time.time() - start:.0f} s)", flush=True)
        return
    for choice in ("rows", "auto"):
        path = args.work / f"{choice}.yaml"
        made = conformance.cli([*conformance.make_args(arm, folder, args.gpu, caps, path), "--cpu-experts", choice])
        if made.code:
            print(f"{choice}: make failed: {made.error}")
            continue
        for handoff in ("doorbell", "host-node"):
            os.environ["OFFLOAD_PLAN_CPU_HANDOFF"] = handoff
            logits = conformance.greedy_logits(path, conformance.MAX_NEW_TOKENS)[1]
            split = conformance.first_split(logits, reference_logits, BF16_TOLERANCE)
            print(f"{choice} {handoff}: split at {split['split_at']}, worst {split['worst_share']:.4f}, per step "
                  f"{split['shares'][:10]} ({time.time() - start:.0f} s)", flush=True)


def probe(work: Path, folder: Path, gpu: str, caps: dict, arm, reference_logits: list) -> None:
    """The rows plan eagerly with every routed layer step checked, with the C kernel off, and the compiled kernels
    at this shape against their twins (the module docstring)."""
    from runtime import cpu_kernel

    path = work / "rows.yaml"
    made = conformance.cli([*conformance.make_args(arm, folder, gpu, caps, path), "--cpu-experts", "rows"])
    assert not made.code, made.error
    records, kernels = [], []
    with _checked_steps(records, kernels):
        logits = conformance.greedy_logits(path, conformance.MAX_NEW_TOKENS, graphed=False)[1]
    split = conformance.first_split(logits, reference_logits, BF16_TOLERANCE)
    print(f"rows eager: split at {split['split_at']}, worst {split['worst_share']:.4f}, per step "
          f"{split['shares'][:10]}", flush=True)
    records.sort(key=lambda record: -record["share"])
    for record in records[:8]:
        print("  worst layer step:", record, flush=True)
    print(f"  layer steps {len(records)}, over 0.02: {sum(r['share'] > 0.02 for r in records)}; with a part: "
          f"{sum(r['part'] is not None and r['part'][0] >= 0 for r in records)}, of those over 0.02: "
          f"{sum(r['share'] > 0.02 and r['part'] is not None and r['part'][0] >= 0 for r in records)}", flush=True)
    for line in kernels:
        print(" ", line, flush=True)
    os.environ["OFFLOAD_PLAN_CPU_KERNEL"] = "0"
    cpu_kernel.reset_kernel()
    logits = conformance.greedy_logits(path, conformance.MAX_NEW_TOKENS)[1]
    split = conformance.first_split(logits, reference_logits, BF16_TOLERANCE)
    print(f"rows graphed, C kernel off: split at {split['split_at']}, worst {split['worst_share']:.4f}, per step "
          f"{split['shares'][:10]}", flush=True)
    del os.environ["OFFLOAD_PLAN_CPU_KERNEL"]
    cpu_kernel.reset_kernel()


class _checked_steps:
    """While entered, each eager routed decode step's output is compared with its experts in fp32 from the host
    copy (``records``), and after the first step of each layer the compiled fetch plan and gather at its shape
    are compared with their torch twins (``kernels``: one line each)."""

    def __init__(self, records: list, kernels: list):
        self.records, self.kernels = records, kernels

    def __enter__(self):
        from runtime.routed_experts import RoutedExperts

        self.original = RoutedExperts.decode, RoutedExperts._fetch_plan
        decode, fetch_plan = self.original
        records, kernels, checked = self.records, self.kernels, set()

        def planned(routed, *args):
            routed.probe_planned = fetch_plan(routed, *args)
            return routed.probe_planned

        def checked_decode(routed, module, index, hidden, top_k_index, top_k_weights):
            out = decode(routed, module, index, hidden, top_k_index, top_k_weights)
            records.append(_step_record(routed, index, hidden, top_k_index, top_k_weights, out))
            if index not in checked and routed.tables[index].cpu_split is not None:
                checked.add(index)
                kernels.extend(_kernels_against_twins(routed, index, top_k_index.shape))
            return out

        RoutedExperts.decode, RoutedExperts._fetch_plan = checked_decode, planned
        return self

    def __exit__(self, *exc):
        from runtime.routed_experts import RoutedExperts

        RoutedExperts.decode, RoutedExperts._fetch_plan = self.original


def _step_record(routed, index: int, hidden, top_k_index, top_k_weights, out) -> dict:
    """One routed layer step's output against its experts computed in fp32 from the host copy, with its plan."""
    import torch

    torch.cuda.synchronize()
    reference = conformance.experts_fp32(routed, index, hidden, top_k_index, top_k_weights)
    share = float((out.reshape(reference.shape).float() - reference).abs().max() / reference.abs().max())
    pair_rows, sources, cpu_index, part = routed.probe_planned
    ids = top_k_index.reshape(-1).tolist()
    return {"layer": index, "share": round(share, 4), "ids": ids,
            "resident": [int(routed.tables[index].resident_row[e]) for e in ids], "pair_rows": pair_rows.tolist(),
            "sources": sources.tolist(), "cpu": None if cpu_index is None else cpu_index.tolist(),
            "part": None if part is None else part.tolist()}


def _kernels_against_twins(routed, index: int, shape) -> list[str]:
    """The compiled fetch plan over 300 random steps of the layer's split (its own tables, fetch_slots, no
    prefetch) against its torch twin (torch_fetch_plan), and the compiled gather of a part at the layer's shape against
    the torch gather: one line each."""
    import torch

    from runtime.fetch_planning import fused_fetch_plan, torch_fetch_plan
    from runtime.uva_gather import gather_rows

    split, resident_row = routed.tables[index].cpu_split, routed.tables[index].resident_row
    generator = torch.Generator().manual_seed(index)
    num_experts, device = resident_row.numel(), resident_row.device
    differ, parts = 0, 0
    for _ in range(300):
        ids = torch.stack([torch.randperm(num_experts, generator=generator)[:shape[1]] for _ in range(shape[0])])
        ids = ids.to(device)
        planned = [plan(ids, resident_row, routed.fetch_slots, 0, torch.zeros(4, dtype=torch.int64, device=device),
                        cpu_split=split) for plan in (fused_fetch_plan, torch_fetch_plan)]
        (rows, sources, cpu_index, part), (want_rows, want_sources, want_cpu, want_part) = planned
        same = (torch.equal(rows, want_rows) and torch.equal(sources, want_sources)
                and torch.equal(cpu_index, want_cpu) and (part is None) == (want_part is None)
                and (part is None or torch.equal(part, want_part)))
        expert = -1 if want_part is None else int(want_part[0])
        differ += not same
        parts += expert >= 0
    lines = [f"layer {index}: fused plan against its twin, 300 steps ({parts} with a part): {differ} differ"]
    for name in routed.param_names:
        host, host_device = routed.host[index, name], routed.host_device[index, name]
        layout = routed.part_layouts.get(name)
        for expert_rows in sorted({int(r) for r in split.rows.tolist() if int(r) > 0})[:3] if split.rows is not None \
                else ():
            sources = torch.tensor([3, 5, -1], device=device)
            part = torch.tensor([5, expert_rows, 1], device=device)
            got = torch.full((3, *host.shape[1:]), 7.0, dtype=host.dtype, device=device)
            gather_rows(host_device, got, sources, part=part, layout=layout)
            want = torch.full((3, *host.shape[1:]), 7.0, dtype=host.dtype)
            gather_rows(host, want, sources.cpu(), part=part.cpu(), layout=layout)
            torch.cuda.synchronize()
            lines.append(f"layer {index} {name} rows {expert_rows}: gather equal to its twin: "
                         f"{torch.equal(got.cpu(), want)}")
    return lines


if __name__ == "__main__":
    main()
