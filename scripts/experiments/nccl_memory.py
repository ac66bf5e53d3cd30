"""GPU memory NCCL holds outside PyTorch's allocator on each rank, phase by phase (question: how much a TP rank's
plan must set aside for it; the engines' export counts planner.search.serving.NCCL_BYTES_PER_RANK).

    PYTHONPATH=. torchrun --nproc-per-node 2 scripts/experiments/nccl_memory.py

Each rank prints, after each phase, what CUDA holds beyond torch's caching allocator (mem_get_info's used bytes
less memory_reserved): the CUDA context alone, the process group bound to the GPU (its communicator created), an
all-reduce of a layer's hidden states, an all-gather of logits (DTensor's functional collective, as transformers'
LM head gathers), and the same all-reduce captured in a CUDA graph and replayed.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def outside_bytes(device) -> int:
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return total_bytes - free_bytes - torch.cuda.memory_reserved(device)


def main() -> int:
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    phases = {"cuda context": outside_bytes(device)}
    dist.init_process_group("nccl", device_id=device)
    phases["process group"] = outside_bytes(device)
    hidden = torch.ones(2048, 4096, dtype=torch.bfloat16, device=device)
    dist.all_reduce(hidden)
    torch.cuda.synchronize(device)
    phases["all-reduce"] = outside_bytes(device)
    logits = torch.ones(16, 16000, dtype=torch.bfloat16, device=device)
    funcol.all_gather_tensor(logits, 0, dist.group.WORLD).wait()
    torch.cuda.synchronize(device)
    phases["all-gather"] = outside_bytes(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        dist.all_reduce(hidden)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        dist.all_reduce(hidden)
    graph.replay()
    torch.cuda.synchronize(device)
    phases["captured all-reduce"] = outside_bytes(device)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"rank": dist.get_rank(), "device": torch.cuda.get_device_name(device),
                                  "outside_mib": {k: round(v / 2**20, 1) for k, v in phases.items()}})
    if dist.get_rank() == 0:
        print(json.dumps(rows, indent=1))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "nccl_memory.json"), "w") as file:
                json.dump(rows, file, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
