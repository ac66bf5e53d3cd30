"""Greedy decode over a static KV cache, steps run eagerly or replayed from a CUDA graph of several steps.

A replay must do exactly what the eager steps do with no help from Python, so everything that changes
between steps lives on the GPU at fixed addresses: the token ids (each step writes its argmax back into
them), the KV cache and its length counter (transformers' StaticCache advances it in place; sliding-window
layers are rings indexed from that counter, runtime.static_cache), the ids and
logits of each step (output buffers) and the offloaded weights (fixed slots). The offload copies and their
event waits are captured with the forward. Inside a replay the copies wrap from step to step as eagerly;
those that wrap past its last step are joined before it ends (OffloadEngine.finish_step); the planner models
that join with ``--cuda-graph``. A replay runs planner.search.simulate.STEPS_PER_GRAPH steps (one, as the engines
capture decode: 4 measured no faster on the H100); ``steps_per_call`` takes others.

With ``compile_backend`` the step's forward runs under torch.compile (one graph, fixed shapes); the offload
hooks enter it as an opaque op (runtime.engine.layer_boundary), and a CUDA graph then captures the compiled
kernels, copies and waits alike. The prefill stays uncompiled: its shapes differ from the step's.
"""

import functools
import inspect
import time

import torch

from planner.errors import RuntimeUnavailableError, UsageError
# cache room past the context for warm-up and timed steps. transformers' static cache attends over its whole
# length (masked), so step time grows with it: measuring, planning and running use the same room.
from planner.search.serving import DECODE_ROOM_TOKENS
from planner.search.simulate import STEPS_PER_GRAPH
from runtime.experts_impl import DECODE, PREFILL, phase_implementations, switch
from runtime.quantized import compute_dtype
from runtime.timing import time_calls

NUM_WARMUP_CALLS = 2
#: prefill at most this many tokens per forward (batch x chunk), to bound activation memory
PREFILL_CHUNK_TOKENS = 16384


def cache_argument(model: torch.nn.Module, cache) -> dict:
    """The keyword that hands ``cache`` to ``model``'s forward: ``cache`` where the forward names it
    (transformers 5.2x renamed ``past_key_values``, which warns of its removal in 5.40), else
    ``past_key_values`` (older releases, e.g. 5.17 on the H100)."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    # once per class: decode steps call this every step, and a signature costs tens of microseconds
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_tokens_for(context_tokens: int) -> int:
    """The static cache length for decode steps after ``context_tokens``: the same when measured and run."""
    return context_tokens + DECODE_ROOM_TOKENS


def steps_per_call_for(graphed: bool) -> int:
    """Decode steps per DecodeLoop call: a replay's STEPS_PER_GRAPH when graphed; eagerly one, so counters that
    the engine keeps per call are per step."""
    return STEPS_PER_GRAPH if graphed else 1


def calls_for(num_steps: int, steps_per_call: int) -> int:
    """Whole calls that cover ``num_steps`` steps."""
    return -(-num_steps // steps_per_call)


def compile_forward(model, backend: str):
    """``model.forward`` under torch.compile for one fixed decode shape, in a single graph."""
    import torch._dynamo
    import torch._inductor.config

    # Dynamo does not guard on module hooks by default, so code compiled for a model without offload hooks
    # (the all-resident one, say) would be reused for a model with them and skip every wait and copy.
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    # One compiled entry per (hooks, batch) pair: a benchmark compiling several models and batches in one
    # process must not fall back to eager silently at the default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # The offload op at each offloaded layer's edges splits Inductor's fusions there. Fused, Inductor keeps
    # intermediates in fp32 where eager rounds them to bf16, so without this the numerics would depend on
    # which layers are offloaded (measured: a bf16 plan's logits off the compiled all-resident model's by up
    # to 0.18 on Qwen3-8B). Rounded where eager rounds, a bf16 plan's compiled step equals the compiled
    # resident one bit for bit (tests/runtime/test_engine.py, test_engine_gpu.py). Older torch lacks the switch.
    if hasattr(torch._inductor.config, "emulate_precision_casts"):
        torch._inductor.config.emulate_precision_casts = True
    return torch.compile(model.forward, backend=backend, dynamic=False, fullgraph=True)


_WARM_UP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warm_up_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for the warm-ups before captures. cuBLAS keeps a workspace for every stream it
    has run on until the process ends (32 MiB each with CUBLAS_WORKSPACE_CONFIG=:4096:8): a new stream per capture
    leaked 0.9 GiB over a benchmark's captures on the H100."""
    if device not in _WARM_UP_STREAMS:
        _WARM_UP_STREAMS[device] = torch.cuda.Stream(device=device)
    return _WARM_UP_STREAMS[device]


def _capture_mode() -> str:
    """CUDA's capture mode: "global" (any thread's unsafe call during the capture fails it), but "thread_local"
    among tensor-parallel ranks, whose NCCL watchdog thread polls the collectives' events while a step with
    all-reduces inside is captured."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return "thread_local" if distributed else "global"


def capture_steps(graph, steps, model_name: str, what: str = "decode step") -> None:
    """Capture ``steps()`` into ``graph``; an op the capture forbids (a host copy or synchronisation inside the
    model's own code, such as transformers 5.17's eager attention mask, which copies a CPU scalar each step; the
    loop's steps now take their eager masks from runtime.step_masks instead) is one line naming the model, not a
    traceback."""
    try:
        with torch.inference_mode(), torch.cuda.graph(graph, capture_error_mode=_capture_mode()):
            steps()
    except torch.OutOfMemoryError:
        raise  # the caller's memory handling says what to do
    except RuntimeError as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise RuntimeUnavailableError(
            f"{model_name}'s {what} cannot be captured as a CUDA graph on this stack ({reason}); run it "
            "without --cuda-graph (plan it without --cuda-graph), or with a newer transformers") from None


def chunk_graph(model, input_ids: torch.Tensor, engine=None) -> "torch.cuda.CUDAGraph":
    """One cacheless forward over ``input_ids`` (a prefill chunk of new sequences, the last token's logits) captured
    in a CUDA graph: warmed up on the side stream, the warm-up's cached blocks released (the capture reuses their
    memory rather than adding its own), then captured. With ``engine`` (whole layers offloaded) the forward runs in
    the engine's graph mode, each replay joining its copies at its end as a decode replay does; the caller turns
    graph mode off when done with the graph."""
    device = input_ids.device

    def forward() -> None:
        if engine is not None:
            engine.start_step(first=True, last=True)
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        if engine is not None:
            engine.finish_step(True)

    def warm_up() -> None:
        with torch.inference_mode():
            for _ in range(NUM_WARMUP_CALLS):
                forward()

    if engine is not None:
        engine.set_graph_mode(True)
    return warm_up_and_capture(device, warm_up, forward, type(model).__name__, "prefill chunk")[0]


def warm_up_and_capture(device: torch.device, warm_up, steps, model_name: str, what: str = "decode step"
                        ) -> tuple["torch.cuda.CUDAGraph", float]:
    """Run ``warm_up()`` on the side stream (warm_up_stream), release what it left cached, then capture ``steps()``
    (capture_steps): the graph and the capture's wall seconds. The warm-up's activations sit cached for the side
    stream, and the graph's pool cannot take blocks cached for another stream: released, the captured step reuses
    their memory rather than adding its own (a planned serving GPU holds one step's activations, not two)."""
    side = warm_up_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        warm_up()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    started = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    capture_steps(graph, steps, model_name, what)
    torch.cuda.synchronize(device)
    return graph, time.perf_counter() - started


class DecodeLoop:
    """Decode steps for ``batch`` sequences whose cache holds up to ``max_cache_tokens`` tokens each, run
    ``steps_per_call`` at a time: one call is one CUDA-graph replay once captured, or that many eager steps."""

    def __init__(self, model, *, batch: int, max_cache_tokens: int, device: torch.device, engine=None,
                 compile_backend: str | None = None, steps_per_call: int = STEPS_PER_GRAPH):
        """``compile_backend``: run the steps under torch.compile with this backend ("inductor"), or eagerly."""
        from runtime.static_cache import static_cache
        from runtime.step_masks import StepMasks

        self.model, self.engine, self.device = model, engine, device
        self.forward = model if compile_backend is None else compile_forward(model, compile_backend)
        #: a MoE model's experts run decode's implementation in the steps and prefill's in the prefill (None: dense)
        self.experts_implementations = phase_implementations(model, device)
        #: full-attention layers hold max_cache_tokens, sliding ones min(window, max_cache_tokens) (a ring)
        self.cache = static_cache(model.config, max_cache_tokens)
        self._allocate_cache(batch)
        #: a step's attention masks made from the cache's device length where transformers' own cannot be captured
        #: (eager attention on 5.17: gpt-oss); None: the model builds its masks
        self.step_masks = StepMasks.for_model(model, self.cache, batch, device)
        self.steps_per_call = steps_per_call
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [batch, 1]: the next step's input
        #: each step's input ids [batch, steps_per_call] and output logits [steps_per_call, batch, vocab] of
        #: the last call
        self.step_ids = torch.zeros(batch, steps_per_call, dtype=torch.long, device=device)
        self.step_logits: torch.Tensor | None = None
        self.prefill_logits: torch.Tensor | None = None  # [batch, vocab]
        self.graph: torch.cuda.CUDAGraph | None = None
        #: cache entries still free (counted on the host: an overflow inside a replay could not be reported)
        self.free_tokens = max_cache_tokens
        #: wall seconds of the warm-up, of its first call when compiled (torch.compile runs there), and of the
        #: capture
        self.warmup_s = self.compile_s = self.capture_s = 0.0
        self.compiled = compile_backend is not None
        #: the routed experts' CPU re-splitter (runtime.cpu_resplit), told of every call's steps; None: none
        self.resplit = getattr(getattr(engine, "routed_experts", None), "resplit", None)

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        """Fill the cache with ``prompt_ids`` [batch, tokens] in chunks; the next ids are the last argmax."""
        chunk = max(1, PREFILL_CHUNK_TOKENS // prompt_ids.shape[0])
        self._use_phase(PREFILL)
        with torch.inference_mode():
            for start in range(0, prompt_ids.shape[1], chunk):
                output = self.model(input_ids=prompt_ids[:, start:start + chunk], use_cache=True, logits_to_keep=1,
                                    **cache_argument(self.model, self.cache))
            self._check_static_cache()
            logits = output.logits[:, -1, :]
            self.prefill_logits = logits.clone()
            self.step_logits = logits.new_empty(self.steps_per_call, *logits.shape)
            self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.free_tokens -= prompt_ids.shape[1]

    def fill(self, context_tokens: int, seed: int = 0) -> None:
        """Stand the cache at ``context_tokens`` per sequence without running them: a one-token prefill sets the
        cache up and the next ids, then every layer's keys and values up to the context get seeded random values.
        A decode step costs the same over random entries as over real ones, and filling takes milliseconds where
        a prefill of batch x context tokens takes minutes; the same seed gives two models the same cache."""
        if not 1 <= context_tokens <= self.free_tokens:
            raise UsageError(f"cannot fill {context_tokens} tokens into a cache of {self.free_tokens} free tokens")
        batch = self.ids.shape[0]
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.prefill(torch.randint(0, self.model.config.get_text_config().vocab_size, (batch, 1),
                                   generator=generator, device=self.device))
        with torch.inference_mode():
            for layer in self.cache.layers:
                for tensor in (layer.keys, layer.values):  # [batch, kv heads, cache tokens, head dim]
                    # a sliding ring holds min(window, context) tokens; past the window it is full
                    tensor[:, :, :context_tokens].normal_(generator=generator)
                layer.cumulative_length.fill_(context_tokens)
        self.free_tokens -= context_tokens - 1
        self._release_cached()  # the prefill's activations: the step's own come from one pool or the other

    def _allocate_cache(self, batch: int) -> None:
        """Allocate the cache's tensors now, before any step: lazily allocated inside the first forward, they
        were carved out of freed activation blocks, and the rest of those blocks could then neither be returned
        nor taken by a graph's pool (on the H100 a planned 24 GiB serving process ran out of memory so)."""
        text = self.model.config.get_text_config()
        dtype = compute_dtype(self.model)
        if getattr(text, "kv_lora_rank", None):
            # multi-head latent attention (transformers >= 5.2, DeepSeek-V2/V3) caches one head of the compressed
            # latent as its "keys" and the shared rope key as its "values": two widths, which
            # early_initialization (one width for both) cannot allocate
            keys = torch.zeros(batch, 1, 0, text.kv_lora_rank, dtype=dtype, device=self.device)
            values = torch.zeros(batch, 1, 0, text.qk_rope_head_dim, dtype=dtype, device=self.device)
            for layer in self.cache.layers:
                layer.lazy_initialization(keys, values)
            return
        num_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # one rank of transformers' tensor parallelism holds its share of the KV heads (k/v split by column)
        num_heads = max(1, num_heads // (getattr(self.model, "tp_size", None) or 1))
        self.cache.early_initialization(batch, num_heads, head_dim, dtype, self.device)

    def _release_cached(self) -> None:
        """Return the allocator's cached free blocks to the GPU, as engines do between start-up phases."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_static_cache(self) -> None:
        from runtime.static_cache import is_graph_safe

        layers = getattr(self.cache, "layers", [])
        if not layers or not all(is_graph_safe(layer) for layer in layers):
            raise UsageError("--cuda-graph needs a static KV cache whose length lives on the GPU (full-attention "
                             "or sliding-window layers of transformers >= 5); this model's cache has another kind "
                             "(chunked attention, linear attention or state layers); run without --cuda-graph")

    def _step(self, index: int, join: bool) -> None:
        """Step ``index`` of a call; ``join``: the call's last step, which joins the copies wrapping past it."""
        self.step_ids[:, index : index + 1].copy_(self.ids)
        if self.engine is not None:
            self.engine.start_step(first=index == 0, last=join)
        masks = {} if self.step_masks is None else {"attention_mask": self.step_masks.update()}
        output = self.forward(input_ids=self.ids, use_cache=True, **masks, **cache_argument(self.model, self.cache))
        logits = output.logits[:, -1, :]
        if self.engine is not None:
            self.engine.finish_step(join)
        self.step_logits[index].copy_(logits)
        self.ids.copy_(logits.argmax(-1, keepdim=True))

    def _use_phase(self, phase: str) -> None:
        if self.experts_implementations is not None:
            switch(self.model, self.experts_implementations[phase])

    def _steps(self) -> None:
        """The body of one call (what a replay runs)."""
        self._use_phase(DECODE)
        for index in range(self.steps_per_call):
            self._step(index, join=index == self.steps_per_call - 1)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up(self) -> None:
        """Run the warm-up calls (compilation, cuBLAS handles, workspaces and lazy inits happen here), then put
        ids and cache length back as they were."""
        self._reserve(NUM_WARMUP_CALLS * self.steps_per_call)
        saved = self.save_state()
        self._synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            if self.compiled:
                self._compiled_steps()
                self._synchronize()
                self.compile_s = time.perf_counter() - started
            for _ in range(NUM_WARMUP_CALLS - self.compiled):
                self._steps()
        self._synchronize()
        self.warmup_s = time.perf_counter() - started
        self.restore_state(saved)

    def _compiled_steps(self) -> None:
        """The first compiled call, which traces and compiles: what torch.compile cannot take is a UsageError."""
        import torch._dynamo

        try:
            self._steps()
        except torch._dynamo.exc.TorchDynamoException as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"torch.compile could not compile this model's decode step as one graph ({reason}); "
                             "run without --compile") from None

    def capture_again(self) -> None:
        """Capture the steps anew, after what picks their kernels changed (a graph keeps its capture's: a
        benchmark that checks bits with deterministic kernels and then times serving's); the old graph's
        private pool goes back first, so the second capture does not hold a second pool."""
        self.graph = None
        torch.cuda.empty_cache()
        self.capture()

    def capture(self) -> None:
        """Warm up on a side stream, then capture one call's steps; the cache and ids are left as they were."""
        if self.engine is not None:
            self.engine.set_graph_mode(True)
        self.graph, self.capture_s = warm_up_and_capture(self.device, self.warm_up, self._steps,
                                                         type(self.model).__name__)

    @torch.inference_mode()
    def save_state(self) -> list:
        """What a call changes: the next ids, the cache length (the cache's tensors are inference tensors, so
        saving and restoring run in inference mode), the free-token count, and a sliding ring's entries (a step
        overwrites the oldest token of its window, which the length alone cannot give back), kept on the host so
        that saving adds nothing to the GPU's peak."""
        from runtime.static_cache import RingSlidingLayer

        rings = {index: (layer.keys.to("cpu", copy=True), layer.values.to("cpu", copy=True))
                 for index, layer in enumerate(self.cache.layers) if isinstance(layer, RingSlidingLayer)}
        return [self.ids.clone(), self.free_tokens, rings,
                *(layer.cumulative_length.clone() for layer in self.cache.layers)]

    @torch.inference_mode()
    def restore_state(self, saved: list) -> None:
        """Put ids, cache length and the rings' entries back; full-attention entries written past the length
        are masked and overwritten."""
        self.ids.copy_(saved[0])
        self.free_tokens = saved[1]
        for index, (keys, values) in saved[2].items():
            self.cache.layers[index].keys.copy_(keys)
            self.cache.layers[index].values.copy_(values)
        for layer, length in zip(self.cache.layers, saved[3:]):
            layer.cumulative_length.copy_(length)

    def step(self) -> None:
        """One call: ``steps_per_call`` decode steps (one replay once captured) into step_ids and step_logits."""
        self._reserve(self.steps_per_call)
        self.free_tokens -= self.steps_per_call
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self._steps()
        if self.resplit is not None:
            self.resplit.observe(self.steps_per_call)

    def _reserve(self, num_tokens: int) -> None:
        if self.free_tokens < num_tokens:
            raise UsageError(f"the static KV cache has {self.free_tokens} free tokens and the next steps need "
                             f"{num_tokens}; give it more room")

    def timed_steps(self, num_steps: int) -> list[float]:
        """Milliseconds per decode step of back-to-back calls covering ``num_steps`` steps (no host
        synchronisation between them): each call's time over its steps."""
        num_calls = calls_for(num_steps, self.steps_per_call)
        return [ms / self.steps_per_call for ms in time_calls(self.step, num_calls, self.device)]

    def generate(self, num_steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(input ids [batch, num_steps], output logits [batch, vocab] of each step): the first id is the
        prefill's argmax. Whole calls run; steps past ``num_steps`` are dropped."""
        ids, logits = [], []
        for _ in range(calls_for(num_steps, self.steps_per_call)):
            self.step()
            ids.append(self.step_ids.clone())
            logits.extend(self.step_logits.clone().unbind(0))
        return torch.cat(ids, dim=1)[:, :num_steps], logits[:num_steps]
