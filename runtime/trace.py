"""Record a routing trace: per MoE layer, how many of the user's prompt tokens each expert takes.

The model runs its prompts (one prompt at a time, no padding) on the local GPU or the CPU, and a
forward pre-hook on each MoE layer's ``mlp.experts`` module counts the expert ids it is called with. The hook
sits on the experts rather than the router because transformers 5's experts interface takes the routing the
same way in every architecture (``experts(hidden_states, top_k_index, top_k_weights)``: [tokens, top_k] ids),
where routers return it in different shapes (Qwen3-MoE's gate returns logits, scores and indices; DeepSeek-V3's
returns indices and weights). planner.source.routing_trace validates and writes the result.

What is counted: the prompts' own tokens (prefill), or, with ``decode_tokens`` N > 0, only the N tokens greedily
generated after each prompt, one decode step at a time: the steps a decode plan serves. Decode steps can route
differently from prompt tokens (a token's hidden state there holds its attention over everything before it), and
the residency a plan chooses from a trace serves decode steps.
"""

import re
from pathlib import Path

import torch
from torch import nn

from planner.source.checkpoint import load_checkpoint
from planner.errors import ModelInputError, UsageError, brief
from planner.model.experts import moe_geometry
from planner.model.layout import build_layout
from planner.source.routing_trace import RoutingTrace
from planner.source.untrusted import read_capped

#: the experts module of a MoE layer in transformers 5: ``<stack>.<index>.mlp.experts``
_EXPERTS_MODULE = re.compile(r"^(?P<stack>.+)\.(?P<index>\d+)\.mlp\.experts$")
#: the longest prompt file read (a trace needs thousands of tokens, not gigabytes)
MAX_PROMPT_FILE_BYTES = 64 * 2**20


class RoutingCounter:
    """Forward pre-hooks on every ``<stack>.N.mlp.experts`` module that count the expert ids routed to it."""

    def __init__(self, model: nn.Module, stack: str, num_experts: int, predict: bool = False):
        """``predict``: also count, per rank, how often each MoE layer routes a token to the expert that the
        runtime's next-layer prediction (runtime.routed_experts.next_layer_predictor: the layer's router on the
        previous MoE layer's router input, rescaled by the norms) puts at that rank."""
        self.num_experts = num_experts
        #: whether calls are counted now (off while a decode trace runs its prompt)
        self.active = True
        self.counts: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, int] = {}
        #: predicted layer index -> [top_k] tokens routed to the expert predicted at each rank
        self.prefetch_hits: dict[int, torch.Tensor] = {}
        #: predicted layer index -> ([E, top_k] tokens predicted at each rank on each expert, [E, top_k] of those
        #: routed to it): the per-expert figures the planner prices a prefetch of non-resident experts from
        self.expert_prediction: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._predictors: dict[int, tuple[int, object]] = {}  # MoE layer -> (the next one, its predictor)
        self._predicted: dict[int, torch.Tensor] = {}  # predicted layer -> this prompt's prediction [T, k]
        self._handles = []
        for name, module in model.named_modules():
            match = _EXPERTS_MODULE.match(name)
            if match and match["stack"] == stack:
                index = int(match["index"])
                self.counts[index] = torch.zeros(num_experts, dtype=torch.int64)
                self.tokens[index] = 0
                self._handles.append(module.register_forward_pre_hook(self._hook(index), with_kwargs=True))
        if predict:
            self._start_prediction(list(model.get_submodule(stack)))

    def _start_prediction(self, layers: list[nn.Module]) -> None:
        from runtime.router_prediction import next_layer_predictor

        moe = sorted(self.counts)
        for index, following in zip(moe, moe[1:]):
            device = next(layers[following].parameters()).device
            predictor = next_layer_predictor(layers[index], layers[following], self.num_experts, device)
            if not isinstance(predictor, str):
                self._predictors[index] = (following, predictor)

    def _hook(self, index: int):
        def count(_module, args, kwargs):
            if not self.active:
                return
            ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if ids is None:
                raise ModelInputError(f"layer {index}'s experts were called without routed expert ids: the model "
                                      "does not use transformers 5's experts interface, so its routing cannot be "
                                      "traced")
            ids = ids.detach().reshape(ids.shape[0], -1)  # [tokens, top_k]
            self.counts[index] += torch.bincount(ids.flatten().to("cpu", torch.int64), minlength=self.num_experts)
            self.tokens[index] += ids.shape[0]
            predicted = self._predicted.pop(index, None)
            if predicted is not None:  # per rank: the predicted expert among the token's routed ones
                rank_hits, made, hits = prediction_counts(predicted, ids, self.num_experts)
                self.prefetch_hits[index] = self.prefetch_hits.get(index, 0) + rank_hits.cpu()
                before = self.expert_prediction.get(index, (0, 0))
                self.expert_prediction[index] = (before[0] + made.cpu(), before[1] + hits.cpu())
            if index in self._predictors:
                hidden = args[0] if args else kwargs.get("hidden_states")
                following, predictor = self._predictors[index]
                self._predicted[following] = predictor.top_k_index(hidden.reshape(ids.shape[0], -1)).detach()
        return count

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()


def prediction_counts(predicted: torch.Tensor, ids: torch.Tensor, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's prediction figures from the predicted and the routed expert ids ([tokens, top_k] each), on
    their device with no host synchronisation (a captured step may call it): per rank the tokens whose
    prediction there was routed [top_k]; per expert and rank the tokens predicted there [E, top_k], and of those
    the ones routed to it [E, top_k]."""
    hit = (predicted.unsqueeze(-1) == ids.unsqueeze(1)).any(-1).to(torch.int64)  # [T, k]
    made = torch.zeros(num_experts, predicted.shape[1], dtype=torch.int64, device=predicted.device)
    hits = torch.zeros_like(made)
    index = predicted.to(torch.int64)
    made.scatter_add_(0, index, torch.ones_like(hit))
    hits.scatter_add_(0, index, hit)
    return hit.sum(0), made, hits


def count_routing(model: nn.Module, prompts: list[torch.Tensor], stack: str, num_experts: int,
                  decode_tokens: int = 0, prefetch_hits: dict | None = None, expert_prediction: dict | None = None
                  ) -> tuple[int, dict[int, tuple[int, ...]]]:
    """(tokens routed per layer, per MoE layer index the assignments per expert) of running ``prompts`` ([1, T]
    token ids each, on the model's device) through ``model``: their own tokens, or with ``decode_tokens`` > 0
    only the tokens greedily generated after each (module docstring). ``prefetch_hits``: a dict filled with, per
    MoE layer the one before it predicts, the counted tokens routed to the expert predicted at each rank
    (RoutingCounter); ``expert_prediction``: with it, a dict filled with, per such layer, (per expert per rank the
    tokens predicted there, per expert per rank those routed to it)."""
    counter = RoutingCounter(model, stack, num_experts, predict=prefetch_hits is not None)
    if not counter.counts:
        raise ModelInputError(f"the model has no {stack}.N.mlp.experts modules: its MoE block is not transformers "
                              "5's experts interface, so its routing cannot be traced")
    try:
        with torch.inference_mode():
            for ids in prompts:
                if decode_tokens:
                    _count_decode(model, ids, counter, decode_tokens)
                else:
                    model(input_ids=ids, use_cache=False)
    finally:
        counter.remove()
    tokens = set(counter.tokens.values())
    if len(tokens) != 1:
        raise ModelInputError(f"MoE layers routed different numbers of tokens ({sorted(tokens)}): some layer skips "
                              "tokens, which a routing trace cannot describe")
    if prefetch_hits is not None:
        prefetch_hits.update({index: tuple(int(h) for h in hits)
                              for index, hits in sorted(counter.prefetch_hits.items())})
    if expert_prediction is not None:
        expert_prediction.update({index: (_rows(made), _rows(hits))
                                  for index, (made, hits) in sorted(counter.expert_prediction.items())})
    return tokens.pop(), {index: tuple(int(c) for c in counts) for index, counts in sorted(counter.counts.items())}


def _rows(table: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """An [E, top_k] count table as a trace holds it."""
    return tuple(tuple(int(c) for c in row) for row in table.tolist())


def _count_decode(model: nn.Module, ids: torch.Tensor, counter: RoutingCounter, decode_tokens: int) -> None:
    """The prompt uncounted, then ``decode_tokens`` greedy steps counted, each one token over the cache."""
    from transformers import DynamicCache

    from runtime.graph import cache_argument

    cache = DynamicCache()  # grows in place: each call appends its tokens' keys and values
    counter.active = False
    out = model(input_ids=ids, use_cache=True, **cache_argument(model, cache))
    counter.active = True
    for _ in range(decode_tokens):
        following = out.logits[:, -1:].argmax(dim=-1)
        out = model(input_ids=following, use_cache=True, **cache_argument(model, cache))


def read_prompts(path) -> list[str]:
    """One prompt a line; blank lines skipped; a one-line error when the file is missing, unreadable or empty."""
    # a regular file only, its size checked before reading: a FIFO or /dev/urandom would block or never end
    raw = read_capped(Path(path), MAX_PROMPT_FILE_BYTES, UsageError, "a --prompts file (one prompt a line)")
    try:
        prompts = [line.strip() for line in raw.decode("utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise UsageError(f"--prompts {path} is not UTF-8 text; give a text file with one prompt a line") from None
    if not prompts:
        raise UsageError(f"--prompts {path} holds no prompt; give a text file with one prompt a line")
    return prompts


#: the devices a trace runs on: the CPU, or a CUDA GPU (cuda, cuda:N)
_DEVICE = re.compile(r"^(cpu|cuda(:\d{1,4})?)$")
#: quantization methods whose transformers loaders need accelerate
_NEEDS_ACCELERATE = ("fp8", "mxfp4")


def trace_device(device: str | None) -> str:
    """The device a trace runs on, checked before any loading: --device as given (cpu, cuda, cuda:N on a GPU
    this machine has), else CUDA when present, else the CPU. Anything else is one line."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not _DEVICE.match(device):
        raise UsageError(f"--device {device[:40]!r} is not a device a trace runs on; give cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            raise UsageError(f"--device {device}: this machine has {count} CUDA GPU(s); give --device cpu"
                             + (f" or cuda:0 to cuda:{count - 1}" if count else ""))
    return device


def check_loadable(config: dict | None, model_path: str) -> None:
    """What transformers needs to load the model, checked before it loads (its own errors are pages, some after
    a load report): a config.json with a model_type, and accelerate for FP8 and MXFP4 checkpoints."""
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise ModelInputError(f"{model_path}/config.json has no model_type, which transformers needs to load the "
                              "model for a trace; add the model_type of its architecture (e.g. qwen3_moe)")
    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method in _NEEDS_ACCELERATE:
        try:
            import accelerate  # noqa: F401 (only whether it is there)
        except ImportError:
            raise UsageError(f"{model_path} is {method}-quantized and transformers loads such checkpoints through "
                             "accelerate; pip install accelerate, then trace again") from None


def _load_model(model_path: str, device: str) -> nn.Module:
    """The model on ``device``, in eval mode; transformers' refusal (an architecture it does not know, tensors
    that contradict the config) is one line, and its load report is not printed."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype="auto").to(device).eval()
    except (ValueError, KeyError, OSError, RuntimeError, ImportError, TypeError) as error:
        raise ModelInputError(f"transformers could not load {model_path} for a trace ({type(error).__name__}: "
                              f"{brief(error, 100)}); check its config.json against its tensors") from None
    finally:
        transformers_logging.set_verbosity(verbosity)


def _tokenized(tokenizer, prompts: list[str], model_path: str) -> list[torch.Tensor]:
    """Each prompt's token ids ([1, T], T >= 1); a prompt the tokenizer turns into nothing is one line."""
    tokenized = [tokenizer(prompt, return_tensors="pt")["input_ids"] for prompt in prompts]
    empty = next((number for number, ids in enumerate(tokenized, start=1) if ids.numel() == 0), None)
    if empty is not None:
        raise UsageError(f"the tokenizer of {model_path} turns prompt {empty} into no tokens: its tokenizer files "
                         "are missing or empty; point --model at a folder with the model's own tokenizer")
    return tokenized


def _check_vocabulary(tokenized: list[torch.Tensor], model: nn.Module, model_path: str) -> None:
    """Every token id within the model's embedding: a tokenizer of another model indexes past it."""
    rows = model.get_input_embeddings().num_embeddings
    largest = max(int(ids.max()) for ids in tokenized)
    if largest >= rows:
        raise UsageError(f"the tokenizer of {model_path} gives token id {largest} but the model embeds {rows} "
                         "tokens: the tokenizer is another model's; use the model's own")


def record_trace(model_path: str, prompts: list[str], device: str | None = None,
                 decode_tokens: int = 0) -> RoutingTrace:
    """Load the checkpoint at ``model_path`` with transformers on ``device`` (default: CUDA when present, else
    the CPU), run ``prompts`` and count the routing of every MoE layer (of ``decode_tokens`` greedy tokens
    after each prompt when > 0)."""
    from transformers import AutoTokenizer

    device = trace_device(device)
    checkpoint = load_checkpoint(model_path)
    layout = build_layout(checkpoint, None)
    geometry = moe_geometry(checkpoint.config, layout)
    if geometry is None:
        raise UsageError(f"{model_path} has no routed experts: a routing trace is for MoE models")
    check_loadable(checkpoint.config, model_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        raise UsageError(f"{model_path} has no tokenizer; point --model at a checkpoint folder with one") from None
    tokenized = _tokenized(tokenizer, prompts, model_path)  # before the model loads: a tokenizer without its
    # files still loads (transformers 5 builds an empty one) and turns every prompt into no tokens
    model = _load_model(model_path, device)
    _check_vocabulary(tokenized, model, model_path)
    ids = [prompt_ids.to(device) for prompt_ids in tokenized]
    hits: dict[int, tuple[int, ...]] = {}
    experts: dict[int, tuple] = {}
    num_tokens, counts = count_routing(model, ids, layout.stack, geometry.num_experts, decode_tokens,
                                       prefetch_hits=hits, expert_prediction=experts)
    return RoutingTrace(model_fingerprint=checkpoint.fingerprint(), num_experts=geometry.num_experts,
                        top_k=geometry.top_k, num_tokens=num_tokens, layers=tuple(counts.items()),
                        prefetch_hits=tuple(sorted(hits.items())),
                        expert_prediction=tuple((index, made, expert_hits)
                                                for index, (made, expert_hits) in sorted(experts.items())))
