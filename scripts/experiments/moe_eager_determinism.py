"""Is the tiny MoE test model's eager forward bitwise repeatable on this GPU? (tests/runtime/test_engine_gpu.py's
MoE cases compare an offloaded model with a resident one bit for bit.)

    PYTHONPATH=. python3 scripts/experiments/moe_eager_determinism.py
"""

import tempfile
from pathlib import Path

import torch

from runtime.backend import CudaBackend
from runtime.load import build_model
from runtime.placement import apply_plan
from tests.runtime_models import plan_with, save_tiny_moe


def run(model):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.inference_mode():
        return model(ids).logits.cpu()


def main() -> None:
    folder = save_tiny_moe(Path(tempfile.mkdtemp()), hidden=256, num_layers=7)
    resident = build_model(str(folder), None).cuda()
    first, second = run(resident), run(resident)
    print("resident twice bitwise:", torch.equal(first, second), "max diff", (first - second).abs().max().item())
    other = run(build_model(str(folder), None).cuda())
    print("a second resident build bitwise:", torch.equal(first, other))
    model = build_model(str(folder), None)
    apply_plan(model, plan_with(folder, 1, 1, 2), CudaBackend(torch.device("cuda")))
    offloaded = run(model)
    print("offloaded (1,1,2) bitwise:", torch.equal(first, offloaded), "max diff",
          (first - offloaded).abs().max().item())
    torch.use_deterministic_algorithms(True, warn_only=True)
    det = [run(resident) for _ in range(2)]
    print("deterministic algorithms, twice bitwise:", torch.equal(*det))


if __name__ == "__main__":
    main()
