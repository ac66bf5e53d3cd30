"""How the runtime lays weights out in GPU memory, shared so the plan's byte counts bound the runtime's.

The runtime packs every GPU-resident param and every prefetch slot into one allocation (an arena), each
param at an offset aligned to ALIGN_BYTES. PyTorch's caching allocator rounds a request above 1 MiB up to a
multiple of 2 MiB, and a smaller one up to 512 bytes, so the arena can exceed the weights' own bytes by one
such rounding plus one alignment pad per tensor. The planner counts that slack inside the budget.
"""

ALIGN_BYTES = 256
SMALL_ALLOCATION_BYTES = 2**20
SMALL_GRANULE_BYTES = 512
LARGE_GRANULE_BYTES = 2 * 2**20


def align_up(num_bytes: int, alignment: int = ALIGN_BYTES) -> int:
    """``num_bytes`` rounded up to a multiple of ``alignment``."""
    return -(-num_bytes // alignment) * alignment


def allocation_slack_bytes(weight_bytes: int, num_tensors: int) -> int:
    """Most bytes an arena holding ``weight_bytes`` in ``num_tensors`` tensors can add to them."""
    padded_bytes = weight_bytes + ALIGN_BYTES * num_tensors
    granule = LARGE_GRANULE_BYTES if padded_bytes > SMALL_ALLOCATION_BYTES else SMALL_GRANULE_BYTES
    return align_up(padded_bytes, granule) - weight_bytes
