"""GPU memory outside PyTorch's allocator against pinned host memory (question: does registering host memory, as
the runtime does for offloaded params, cost GPU memory for its mappings, and how much per GiB?).

    PYTHONPATH=. python3 scripts/experiments/outside_allocator_pinned.py

After the runtime's probe, host memory is registered with cudaHostRegister (the runtime's CudaBackend.pin, on
anonymous huge-page-advised memory as the runtime allocates it, and on plain torch memory), in growing amounts;
after each, what CUDA holds outside the allocator. Printed in MiB.
"""

import json
import sys

import torch

from runtime.backend import CudaBackend
from runtime.host_pages import huge_page_empty
from runtime.outside_memory import outside_allocator_bytes, probe_outside_allocator_bytes


def main() -> int:
    device = torch.device("cuda")
    backend = CudaBackend(device)
    rows = {"probe": probe_outside_allocator_bytes(device)}
    held = []
    for gib, how in ((4, "huge"), (16, "huge"), (4, "plain"), (16, "plain"), (8, "huge mapped")):
        tensor = torch.empty(gib * 2**30, dtype=torch.uint8) if how == "plain" else huge_page_empty(gib * 2**30)
        held.append(backend.pin(tensor, mapped=how.endswith("mapped")))
        torch.cuda.synchronize()
        rows[f"+{gib} GiB {how} registered"] = outside_allocator_bytes(device)
    pinned = torch.empty(4 * 2**30, dtype=torch.uint8).pin_memory()
    rows["+4 GiB torch pin_memory"] = outside_allocator_bytes(device)
    print(json.dumps({"device": torch.cuda.get_device_name(), "outside_mib": {k: round(v / 2**20, 1)
                                                                             for k, v in rows.items()}}))
    del pinned
    return 0


if __name__ == "__main__":
    sys.exit(main())
