"""What make accepts, as one table: make's input checks and the plan reader both read it.

A plan is what make writes from inputs inside these bounds, so the reader refuses a plan with a value make
could not have written (``offload-plan show`` of a hand-edited ``chunk_tokens: 0`` would otherwise export
``--max-num-batched-tokens 0``). Each bound is imported from the module that owns the limit, not restated.
"""

from planner.model.adapters import MAX_ADAPTERS, MAX_RANK
from planner.model.cost import MAX_CONTEXT, MAX_STEP_TOKENS
from planner.model.kv_cache import KV_DTYPE_BYTES, KV_DTYPES
from planner.search.serving import MAX_CONCURRENCY

#: a pinned G, K or P counts layers
MAX_KNOB = 100_000
#: a decode step longer than this (about 11 days) is a typo, and arithmetic on 1e308 overflows
MAX_TPOT_MS = 1e9

#: (lowest, highest) of each whole-number input of make, by Inputs field name; the plan's fields that carry them
#: (workload.tokens_per_step, serving.concurrency_low, adapters.items[].rank, ...) are read against the same
BOUNDS: dict[str, tuple[int, int]] = {
    "tokens": (1, MAX_STEP_TOKENS),
    "sequences": (1, MAX_STEP_TOKENS),
    "context": (0, MAX_CONTEXT),
    "chunk": (1, MAX_STEP_TOKENS),
    "concurrency": (1, MAX_CONCURRENCY),
    "group_size": (1, MAX_KNOB),
    "num_in_group": (1, MAX_KNOB),
    "prefetch_step": (1, MAX_KNOB),
    "adapter_slots": (1, MAX_ADAPTERS),
    "rank": (1, MAX_RANK),
}

#: --kv-dtype's choices, and the element types a plan's workload.kv_dtype may name (auto resolved)
INPUT_KV_DTYPES = KV_DTYPES
PLAN_KV_DTYPES = tuple(KV_DTYPE_BYTES)


def within(key: str, value: int) -> bool:
    """Whether ``value`` lies in BOUNDS[key]."""
    low, high = BOUNDS[key]
    return low <= value <= high
