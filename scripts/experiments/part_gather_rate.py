"""What the runtime's gather costs for an expert split by its rows (runtime.uva_gather's part) against whole experts.

    PYTHONPATH=. python3 scripts/experiments/part_gather_rate.py [--out DIR]     # on a GPU machine

For each shape (Qwen3-30B-A3B's, OLMoE's and Mixtral-8x7B's expert, bf16, in page-locked mapped host memory), the
runtime's gather (gate_up_proj and down_proj, as runtime.routed_experts calls it) of k whole experts, of k - 1, and
of k - 1 whole and one split at a CPU share f (its rows [0, f I) zero in the slot, the rest read over the link).
Were the part's bytes read at the whole experts' rate, the split gather would take t(k - 1) + (1 - f) (t(k) -
t(k - 1)); the table prints that beside what it took, and the part's own rate. Each slot is checked against the
host rows (a rate of wrong bytes measures nothing).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from runtime.backend import CudaBackend
from runtime.calibrate import median_event_ms
from runtime.uva_gather import device_view, gather_rows, part_layout

#: (name, hidden H, intermediate I, experts on the host, experts gathered a step)
SHAPES = (("qwen3-moe", 2048, 768, 128, 4), ("olmoe", 2048, 1024, 64, 4), ("mixtral", 4096, 14336, 8, 2))
CPU_SHARES = (0.25, 0.5, 0.75)
REPEATS = 20


def shape_rows(backend: CudaBackend, device: torch.device, name: str, hidden: int, intermediate: int,
               num_experts: int, gathered: int) -> list[dict]:
    host = {"gate_up_proj": torch.empty(num_experts, 2 * intermediate, hidden, dtype=torch.bfloat16),
            "down_proj": torch.empty(num_experts, hidden, intermediate, dtype=torch.bfloat16)}
    for tensor in host.values():
        backend.pin(tensor, mapped=True)
        tensor.view(torch.int16).random_()
    sources = {key: device_view(tensor, device) for key, tensor in host.items()}
    slots = {key: torch.empty(gathered, *tensor.shape[1:], dtype=torch.bfloat16, device=device)
             for key, tensor in host.items()}
    chosen = list(range(1, num_experts, max(1, num_experts // gathered)))[:gathered]
    expert_bytes = 3 * hidden * intermediate * 2

    def timed(ids: list[int], part: list[int] | None = None) -> float:
        index = torch.tensor(ids, device=device)
        part_tensor = None if part is None else torch.tensor(part, device=device)

        def gather():
            for key in host:
                gather_rows(sources[key], slots[key], index, part=part_tensor,
                            layout=None if part is None else part_layout(key, tuple(host[key].shape[1:])))

        return median_event_ms(gather, repeats=REPEATS, warmups=3)

    whole_ms = timed(chosen)
    fewer_ms = timed(chosen[:-1] + [-1])
    rows = [{"model": name, "experts": gathered, "share": 0.0, "ms": whole_ms,
             "gb_per_s": gathered * expert_bytes / whole_ms / 1e6},
            {"model": name, "experts": gathered - 1, "share": 0.0, "ms": fewer_ms,
             "gb_per_s": (gathered - 1) * expert_bytes / fewer_ms / 1e6}]
    for share in CPU_SHARES:
        cpu_rows = round(share * intermediate / 16) * 16
        ms = timed(chosen, [chosen[-1], cpu_rows, gathered - 1])
        _check(host, slots, chosen, cpu_rows, intermediate)
        kept = 1 - cpu_rows / intermediate
        part_ms = ms - fewer_ms
        rows.append({"model": name, "experts": gathered, "share": cpu_rows / intermediate, "ms": ms,
                     "ideal_ms": fewer_ms + kept * (whole_ms - fewer_ms),
                     "part_gb_per_s": kept * expert_bytes / part_ms / 1e6 if part_ms > 0 else None})
    for tensor in host.values():
        backend.unpin(tensor)
    return rows


def _check(host: dict, slots: dict, chosen: list[int], cpu_rows: int, intermediate: int) -> None:
    last = chosen[-1]
    gate_up, down = slots["gate_up_proj"][-1].cpu(), slots["down_proj"][-1].cpu()
    want_gate_up, want_down = host["gate_up_proj"][last].clone(), host["down_proj"][last].clone()
    want_gate_up[:cpu_rows] = 0
    want_gate_up[intermediate:intermediate + cpu_rows] = 0
    want_down[:, :cpu_rows] = 0
    assert torch.equal(gate_up.view(torch.int16), want_gate_up.view(torch.int16))
    assert torch.equal(down.view(torch.int16), want_down.view(torch.int16))
    for position, expert in enumerate(chosen[:-1]):
        assert torch.equal(slots["down_proj"][position].cpu().view(torch.int16), host["down_proj"][expert].view(
            torch.int16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    backend = CudaBackend(device)
    rows = [row for shape in SHAPES for row in shape_rows(backend, device, *shape)]
    print("| model | experts | CPU share of the last | ms | ideal ms | GB/s (part's own) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rate = row.get("gb_per_s") or row.get("part_gb_per_s")
        ideal = f"{row['ideal_ms']:.3f}" if "ideal_ms" in row else "-"
        print(f"| {row['model']} | {row['experts']} | {row['share']:.3f} | {row['ms']:.3f} | {ideal} | "
              f"{rate:.1f} |" if rate else f"| {row['model']} | {row['experts']} | {row['share']:.3f} | "
              f"{row['ms']:.3f} | {ideal} | - |")
    print(f"on {torch.cuda.get_device_name(device)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "part-gather-rate.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
