"""Timed steps: the random token ids, the forward step and the CUDA-event timing of back-to-back calls that
``run --bench``, serving, generation, the decode loop and the benchmark scripts share.

They sit apart from runtime.bench so the decode loop (runtime.graph) times its calls without importing the
bench that drives it.
"""

import statistics

import torch

#: decode steps timed for a plan that fetches routed experts (one sequence's misses differ step to step: on the
#: H100 a Mixtral-shaped routed plan's steps came in 10.0, 16.9, 23.9, 30.9 and 37.7 ms, one 352 MB expert apart,
#: and the median of 10 read -15.6% and +8.0% of one prediction), against NUM_TIMED_STEPS of a plan without
NUM_TIMED_ROUTED_STEPS = 60


def random_ids(model, shape: tuple[int, int], device: torch.device, seed: int = 0) -> torch.Tensor:
    """Reproducible random token ids of ``shape`` within the model's vocabulary."""
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=generator).to(device)


def forward_step(model, input_ids: torch.Tensor) -> torch.Tensor:
    """One forward step without KV cache, logits for the last token of each sequence (as servers do)."""
    return model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits


def time_calls(step, num_steps: int, device: torch.device | None = None) -> list[float]:
    """Milliseconds of each of ``num_steps`` back-to-back calls of ``step()``, from CUDA events between them.

    No synchronisation between calls: prefetches that wrap into the next step overlap as in serving.
    """
    events = [torch.cuda.Event(enable_timing=True) for _ in range(num_steps + 1)]
    events[0].record()
    for index in range(num_steps):
        step()
        events[index + 1].record()
    torch.cuda.synchronize(device)
    return [events[i].elapsed_time(events[i + 1]) for i in range(num_steps)]


def time_steps(model, input_ids: torch.Tensor, num_steps: int) -> list[float]:
    """Milliseconds of each of ``num_steps`` back-to-back forward steps (time_calls)."""
    return time_calls(lambda: forward_step(model, input_ids), num_steps)


def model_device(model) -> torch.device:
    """The CUDA device the model's resident weights are on."""
    return next(p.device for p in model.parameters() if p.device.type == "cuda")


def fetches_routed_experts(plan) -> bool:
    """Whether the plan's decode steps fetch routed experts (a layer in the routed regime)."""
    return plan.experts is not None and any(row.routed for row in plan.experts.layers)


def step_figure(plan, step_ms: list[float]) -> tuple[float, str]:
    """The timed steps' figure to hold against the plan's prediction, and its name: the mean where the plan
    fetches routed experts (it predicts the expected step over the routing), else the median."""
    if fetches_routed_experts(plan):
        return statistics.fmean(step_ms), "mean"
    return statistics.median(step_ms), "median"


def timed_step_count(plan, default: int) -> int:
    """How many decode steps to time: NUM_TIMED_ROUTED_STEPS where the plan fetches routed experts."""
    return max(default, NUM_TIMED_ROUTED_STEPS) if fetches_routed_experts(plan) else default
