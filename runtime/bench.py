"""``run --bench``: time the plan's workload on the GPU, back to back, and compare with the prediction."""

import statistics
from dataclasses import asdict, dataclass

import torch

from planner.errors import UsageError
from runtime.load import Loaded

NUM_WARMUP_STEPS = 3
NUM_TIMED_STEPS = 10


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """Measured against predicted, for one plan."""

    step_ms: float
    predicted_step_ms: float
    resident_step_ms_predicted: float
    #: all step times, for spread
    step_ms_all: tuple[float, ...]
    weights_gpu_bytes: int
    planned_gpu_bytes: int
    peak_gpu_bytes: int
    budget_bytes: int
    stall_ms: float
    copy_gb_per_s: float
    bytes_copied_per_step: int
    host_pinned_bytes: int

    def as_dict(self) -> dict:
        """Plain data for --json."""
        return asdict(self)


def bench_inputs(loaded: Loaded, device: torch.device) -> torch.Tensor:
    """Random token ids of the plan's workload shape: [sequences, tokens per sequence]."""
    workload = loaded.plan.workload
    if workload.context_tokens:
        raise UsageError("run --bench times prefill steps (context 0); make the plan with --context 0")
    vocab = loaded.model.config.get_text_config().vocab_size
    shape = (workload.sequences_per_step, workload.tokens_per_step // workload.sequences_per_step)
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(0, vocab, shape, generator=generator).to(device)


def forward_step(model, input_ids: torch.Tensor) -> torch.Tensor:
    """One forward step without KV cache, logits for the last token of each sequence (as servers do)."""
    return model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits


def time_steps(model, input_ids: torch.Tensor, num_steps: int) -> list[float]:
    """Milliseconds of each of ``num_steps`` back-to-back steps, from events between them.

    No synchronisation between steps: prefetches that wrap into the next step overlap as in serving.
    """
    events = [torch.cuda.Event(enable_timing=True) for _ in range(num_steps + 1)]
    events[0].record()
    for step in range(num_steps):
        forward_step(model, input_ids)
        events[step + 1].record()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(num_steps)]


def run_bench(loaded: Loaded, num_steps: int = NUM_TIMED_STEPS) -> BenchResult:
    """Warm up, then time the plan's workload; read the offload counters over the timed steps."""
    device = next(p.device for p in loaded.model.parameters() if p.device.type == "cuda")
    plan, engine = loaded.plan, loaded.engine
    input_ids = bench_inputs(loaded, device)
    with torch.inference_mode():
        for _ in range(NUM_WARMUP_STEPS):
            forward_step(loaded.model, input_ids)
        engine.take_stats()
        torch.cuda.reset_peak_memory_stats(device)
        engine.timing = True
        step_ms = time_steps(loaded.model, input_ids, num_steps)
        engine.timing = False
    stats = engine.take_stats()
    return BenchResult(
        step_ms=statistics.median(step_ms),
        predicted_step_ms=plan.prediction.step_ms,
        resident_step_ms_predicted=plan.prediction.resident_step_ms,
        step_ms_all=tuple(step_ms),
        weights_gpu_bytes=loaded.weights_gpu_bytes,
        planned_gpu_bytes=plan.memory.gpu_bytes,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device),
        budget_bytes=plan.memory.budget_bytes,
        stall_ms=stats.stall_ms / num_steps,
        copy_gb_per_s=stats.bytes_copied / stats.copy_ms / 1e6 if stats.copy_ms else 0.0,
        bytes_copied_per_step=stats.bytes_copied // num_steps,
        host_pinned_bytes=engine.host_bytes,
    )


def generate(loaded: Loaded, prompt: str, model_path: str, max_new_tokens: int) -> tuple[str, float]:
    """Generate with the plan applied; returns (text, tokens per second)."""
    import time

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        raise UsageError(f"{model_path} has no tokenizer; use --bench, or point --model at a checkpoint with one") from None
    device = next(p.device for p in loaded.model.parameters() if p.device.type == "cuda")
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    with torch.inference_mode():
        torch.cuda.synchronize()
        start = time.perf_counter()
        output = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True), new_tokens / seconds
