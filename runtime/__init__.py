"""offload-plan's runtime: PyTorch placement, slot buffers, copy streams and hooks that apply a plan."""
