"""``run --prompt``: greedy generation with the plan applied, eager through transformers' generate or over a
static cache (CUDA graph and/or torch.compile) through the decode loop; with one of the plan's LoRA adapters."""

import time

import torch

from planner.errors import UsageError
from runtime.load import Loaded
from runtime.timing import model_device


def generate(loaded: Loaded, prompt: str, model_path: str, max_new_tokens: int,
             cuda_graph: bool = False, compile_backend: str | None = None, adapter: str | None = None,
             plan_path=None) -> tuple[str, float]:
    """Generate greedily with the plan applied (and, given ``adapter``, that one of the plan's LoRA adapters);
    returns (text, tokens per second)."""
    if adapter is None:
        return _generate(loaded, prompt, model_path, max_new_tokens, cuda_graph, compile_backend)
    from runtime.adapters import attach_adapter

    pool, hooks = attach_adapter(loaded.model, loaded.plan, loaded.engine.backend, adapter, plan_path)
    try:
        return _generate(loaded, prompt, model_path, max_new_tokens, cuda_graph, compile_backend)
    finally:
        hooks.remove()
        pool.close()


def _generate(loaded: Loaded, prompt: str, model_path: str, max_new_tokens: int, cuda_graph: bool,
              compile_backend: str | None) -> tuple[str, float]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        raise UsageError(
            f"{model_path} has no tokenizer; use --bench, or point --model at a checkpoint with one") from None
    device = model_device(loaded.model)
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    if cuda_graph or compile_backend:
        return _generate_static(loaded, tokenizer, inputs["input_ids"], max_new_tokens, cuda_graph, compile_backend)
    with torch.inference_mode():
        torch.cuda.synchronize()
        start = time.perf_counter()
        output = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True), new_tokens / seconds


def _generate_static(loaded: Loaded, tokenizer, prompt_ids: torch.Tensor, max_new_tokens: int, cuda_graph: bool,
                     compile_backend: str | None) -> tuple[str, float]:
    """Greedy decode over a static cache, replayed from a CUDA graph and/or compiled; the text stops at the
    first end-of-sequence token. Tokens/s counts the steps only (not compilation or capture)."""
    from runtime.graph import NUM_WARMUP_CALLS, DecodeLoop, calls_for, steps_per_call_for

    steps = steps_per_call_for(cuda_graph)
    room_tokens = max(NUM_WARMUP_CALLS, calls_for(max_new_tokens, steps)) * steps
    loop = DecodeLoop(loaded.model, batch=1, max_cache_tokens=prompt_ids.shape[1] + room_tokens,
                      device=prompt_ids.device, engine=loaded.engine, compile_backend=compile_backend,
                      steps_per_call=steps)
    loop.prefill(prompt_ids)
    if cuda_graph:
        loop.capture()
    else:
        loop.warm_up()
    torch.cuda.synchronize()
    start = time.perf_counter()
    ids, _ = loop.generate(max_new_tokens)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = ids[0].tolist()
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True), max_new_tokens / seconds
