"""GPU memory a process holds outside PyTorch's caching allocator: the CUDA context, the kernels CUDA loads as they
are first launched (lazy module loading), library handles, CUDA graphs' executables.

torch's allocator counts none of it, yet it shares the GPU with the plan's weights, KV cache and activations: a
plan that books too little for it runs out of memory at its own cap (issue 36: 1.45-1.49 GB measured on the lent
H100 and H200, torch 2.11 + CUDA 13, where plans booked 1 GiB). What it holds depends on the driver, the CUDA
and torch builds and the kernels a model launches, so it is measured on the local stack: by ``calibrate`` (the
probe below), by ``make --measure`` (the model's own layers, eager and graphed) and by ``run`` (the probe before
loading, against what the plan booked).
"""

import torch

#: tokens of the probe's prefill-shaped work and sequences of its decode-shaped work
PROBE_TOKENS = 512
PROBE_SEQUENCES = 4


def outside_allocator_bytes(device: torch.device) -> int:
    """GPU memory this process holds beyond the caching allocator's reserve, now."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return total_bytes - free_bytes - torch.cuda.memory_reserved(device)


def probe_outside_allocator_bytes(device: torch.device) -> int:
    """What the process holds outside the allocator once the kernel families a decoder step launches have run:
    bf16 matrix products of prefill and decode shapes (cuBLAS/cuBLASLt), attention through SDPA with and without
    a mask, the norms, activations, softmax and top-k of a router, the index and scatter work of MoE experts, an
    embedding, host-to-device copies on a side stream, and a CUDA graph captured and replayed. A lower bound of
    what a model's run holds (its own kernels come on top), measured the same way every time."""
    with torch.inference_mode(), torch.cuda.device(device):
        _run_kernel_families(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # a cuBLAS handle and workspace per stream, as the offload copies' stream
            _run_kernel_families(device)
        torch.cuda.current_stream(device).wait_stream(side)
        _capture_and_replay(device)
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the probe's blocks would otherwise sit cached beside what the plan allocates
    return outside_allocator_bytes(device)


def _run_kernel_families(device: torch.device) -> torch.Tensor:
    """One pass of a decoder step's kernel families on small random tensors; returns a scalar to keep it live."""
    hidden = torch.randn(PROBE_TOKENS, 1024, device=device, dtype=torch.bfloat16)  # [tokens, hidden]
    weight = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    prefill = hidden @ weight  # [tokens, hidden]: a GEMM
    decode = hidden[:PROBE_SEQUENCES] @ weight  # [sequences, hidden]: a skinny GEMM, another kernel family
    normed = prefill * torch.rsqrt(prefill.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(prefill.dtype)
    activated = torch.nn.functional.silu(normed) * torch.nn.functional.gelu(normed, approximate="tanh")
    queries = activated.view(1, PROBE_TOKENS, 16, 64).transpose(1, 2)  # [1, heads, tokens, head dim]
    causal = torch.nn.functional.scaled_dot_product_attention(queries, queries, queries, is_causal=True)
    mask = torch.ones(PROBE_TOKENS, PROBE_TOKENS, device=device, dtype=torch.bool).tril()
    masked = torch.nn.functional.scaled_dot_product_attention(queries, queries, queries, attn_mask=mask)
    router = torch.softmax(prefill[:, :64].float(), dim=-1)  # [tokens, experts]
    weights, experts = torch.topk(router, 4, dim=-1)
    order = experts.flatten().argsort()
    counts = torch.bincount(experts.flatten(), minlength=64)
    gathered = hidden.index_select(0, order // 4)
    combined = torch.zeros_like(hidden).index_add_(0, order // 4, gathered)
    ids = torch.randint(0, 1024, (PROBE_TOKENS,), device=device)
    embedded = torch.nn.functional.embedding(ids, weight)
    host = torch.randn(1024, 1024, dtype=torch.bfloat16).pin_memory()
    copied = torch.empty_like(host, device=device).copy_(host, non_blocking=True)
    return (decode.sum() + causal.sum() + masked.sum() + weights.sum() + counts.sum() + combined.sum()
            + embedded.sum() + copied.sum()).float()


def _capture_and_replay(device: torch.device) -> None:
    """A small step captured in a CUDA graph and replayed: graph executables live outside the allocator."""
    static_input = torch.randn(PROBE_SEQUENCES, 1024, device=device, dtype=torch.bfloat16)
    weight = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    warm = torch.cuda.Stream(device)
    warm.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(warm):
        torch.nn.functional.silu(static_input @ weight)
    torch.cuda.current_stream(device).wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = torch.nn.functional.silu(static_input @ weight)
    graph.replay()
    torch.cuda.synchronize(device)
    del output, graph


def check_stack_fits(plan, device: torch.device, every_rank: bool = False) -> int:
    """What this stack holds outside the allocator once the probe ran (returned), against what ``plan`` booked
    for it; refused in one line, before anything is loaded, where the plan cannot keep its promise here
    (stack_overrun). ``every_rank``: a rank of a tensor-parallel group, whose ranks refuse together (one rank
    loading on alone would wait for the others in its first collective)."""
    from planner.errors import RuntimeUnavailableError

    probe_bytes = probe_outside_allocator_bytes(device)
    refusal = stack_overrun(plan.memory, probe_bytes, torch.cuda.get_device_properties(device).total_memory)
    if every_rank:
        refusal = _any_rank_refusal(refusal, device)
    if refusal is not None:
        raise RuntimeUnavailableError(refusal)
    return probe_bytes


def _any_rank_refusal(refusal: str | None, device: torch.device) -> str | None:
    """This rank's refusal, or another rank's word for it, where any rank of the group refuses."""
    import torch.distributed as dist

    refused = torch.tensor([0 if refusal is None else 1], device=device)
    dist.all_reduce(refused, op=dist.ReduceOp.MAX)
    if refusal is None and refused.item():
        return ("another rank's stack holds more outside torch's allocator than the plan booked: make the plan on "
                "this machine with --measure, or with a profile from offload-plan calibrate")
    return refusal


def stack_overrun(memory, probe_bytes: int, device_total_bytes: int) -> str | None:
    """Why a plan whose ``memory`` section booked memory.cuda_context_bytes outside the allocator cannot run on a
    stack whose probe found ``probe_bytes`` there: more than booked, and the plan's total would then pass the GPU
    memory it is made for (or this GPU's). The probe is a lower bound of what the run will hold. None: it fits."""
    from planner.units import format_bytes

    booked_bytes = memory.cuda_context_bytes
    limit_bytes = min(memory.gpu_memory_bytes, device_total_bytes)
    if probe_bytes <= booked_bytes or memory.total_gpu_bytes - booked_bytes + probe_bytes <= limit_bytes:
        return None
    return (f"this GPU's stack holds {format_bytes(probe_bytes)} outside torch's allocator before loading (CUDA "
            f"context, kernels) and the plan booked {format_bytes(booked_bytes)}, so its "
            f"{format_bytes(memory.total_gpu_bytes)} would pass {format_bytes(limit_bytes)} (other processes on this "
            "GPU count too): make the plan on this machine with --measure, or with a profile from offload-plan "
            "calibrate")
