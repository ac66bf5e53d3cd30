"""Planning for an engine's read-at-use offloader: SGLang's ``--cpu-offload-gb`` (OffloaderV1), as its source runs it.

SGLang 0.5.23, ``sglang/srt/utils/offloader.py``:

- ``create_offloader`` builds ``OffloaderV1(cpu_offload_max_bytes=int(cpu_offload_gb * 1024**3))`` when
  ``--cpu-offload-gb`` is above 0 (an int: ``arg_groups/fields/exec_.py`` ``ExecOffload.cpu_offload_gb``).
- ``make_layers`` (``sglang/srt/utils/common.py``) passes every decoder layer it builds, layer 0 onward, to
  ``wrap_modules``, which calls ``maybe_offload_to_cpu`` on each: a layer is skipped once the running total has
  reached the limit; otherwise its params, in ``module.parameters()`` order (the order the model's ``__init__``
  registers them), move to pinned host memory one by one, checking the total before each: the param that
  reaches the limit moves whole. Embeddings, the final norm and the head are not layers: they stay.
- A layer with offloaded params gets a forward that copies its state (``_get_offloaded_device_state``:
  ``.to(device, non_blocking=True)`` on the current stream) and runs ``functional_call`` on the copies, which are
  freed after it: every offloaded byte crosses the link at every step, before the layer's compute on the same
  stream, and one layer's offloaded bytes are on the GPU at a time.

So a plan for it is one number, the GiB, and its step is each layer's compute plus the copy of its offloaded
bytes, behind no compute. The fewest GiB whose GPU weights fit is the fastest plan (compute does not change).
"""

import math
from dataclasses import dataclass

from planner.engines.versions import GIB, engine_version
from planner.errors import InfeasibleError
from planner.model.cost import ComputeTimes
from planner.model.layout import ModelLayout
from planner.model.placement import allocation_slack_bytes
from planner.search.groups import Choice, LayerBytes, copy_ms_of
from planner.search.simulate import Interval, Simulation
from planner.units import format_bytes

#: OffloadSection.mechanism of a plan for a read-at-use offloader
READ_AT_USE = "read_at_use"
#: the first part of a param name (relative to its layer) in the attention block and in the MLP or MoE block
ATTENTION_PARTS = ("self_attn", "attn", "attention")
MLP_PARTS = ("mlp", "block_sparse_moe", "feed_forward")
#: architectures whose MoE block registers its router before its experts (SGLang's MixtralMoE: gate, then
#: experts; Qwen3MoeSparseMoeBlock and GptOssSparseMoeBlock register the experts first)
ROUTER_FIRST = ("MixtralForCausalLM",)
#: checkpoint parts SGLang fuses into one param with their siblings, by block: (part, fused name)
_ATTENTION_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_MLP_FUSED = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
#: an expert tensor's part -> SGLang's FusedMoE param (w13: gate and up of every expert; w2: down)
_EXPERT_FUSED = (("w13", "w13"), ("gate_up_proj", "w13"), ("gate_proj", "w13"), ("up_proj", "w13"),
                 ("w1", "w13"), ("w3", "w13"), ("down_proj", "w2"), ("w2", "w2"))
#: registration rank inside each block: attention (qkv, o, then norms and sinks), MLP (gate_up, down), MoE
#: (experts' w13, w2; the router before them or after them), anything else last
_RANKS = {"qkv_proj": 1, "o_proj": 2, "gate_up_proj": 1, "down_proj": 2, "w13": 10, "w2": 11}
_ROUTER_FIRST_RANK, _ROUTER_LAST_RANK, _OTHER_RANK = 0, 20, 30


def planned_read_at_use(engine: str | None, config: dict | None) -> bool:
    """make --for ENGINE plans for the engine's read-at-use offloader: the newest pinned version does not wire its
    prefetch offloader for the model's architecture, and reads params at use there."""
    if engine is None:
        return False
    architecture = architecture_of(config)
    release = engine_version(engine)
    return not release.prefetch_wired(architecture) and release.read_at_use_wired(architecture)


def architecture_of(config: dict | None) -> str | None:
    """config.json's first architecture, None where it names none."""
    return ((config or {}).get("architectures") or [None])[0]


def read_at_use_searcher(layout: ModelLayout, config: dict | None, profile, num_tensors: int) -> "ReadAtUseSearcher":
    """The read-at-use placements of the model ``layout`` holds, on ``profile``'s link."""
    return ReadAtUseSearcher(layer_params=layer_param_bytes(layout, architecture_of(config)),
                             fixed_bytes=layout.non_layer_bytes, h2d_bytes_per_s=profile.h2d_bytes_per_s.value,
                             copy_overhead_us=profile.copy_overhead_us.value, num_tensors=num_tensors)


def engine_param_unit(relative_name: str, architecture: str | None) -> tuple[int, int, str]:
    """(block, rank, the engine's param) of a checkpoint param: attention 0, MLP or MoE 1, norms and the rest 2,
    in the order the engine's layer registers them; parts the engine fuses share one param."""
    parts = relative_name.split(".")
    block = 0 if parts[0] in ATTENTION_PARTS else 1 if parts[0] in MLP_PARTS else 2
    if "experts" in parts:
        at = parts.index("experts")
        rest = [p for p in parts[at + 1:] if not p.isdigit()]  # every expert's tensor is one fused param
        head = rest[0] if rest else ""
        prefix, fused = next(((p, f) for p, f in _EXPERT_FUSED if head.startswith(p)), (head, head))
        unit = ".".join(parts[:at + 1] + [fused + head[len(prefix):]] + rest[1:])
        return block, _RANKS.get(fused, _OTHER_RANK), unit
    if block == 1 and len(parts) > 1 and parts[1] in ("gate", "router"):
        return block, _ROUTER_FIRST_RANK if architecture in ROUTER_FIRST else _ROUTER_LAST_RANK, relative_name
    fused_map = _ATTENTION_FUSED if block == 0 else _MLP_FUSED if block == 1 else {}
    named = [fused_map.get(part, part) for part in parts]
    rank = next((_RANKS[part] for part in named[1:2] if part in _RANKS), _OTHER_RANK)
    return block, rank, ".".join(named)


def layer_param_bytes(layout: ModelLayout, architecture: str | None) -> tuple[tuple[int, ...], ...]:
    """Each layer's params as the engine holds them (fused), in the order it offloads them: their bytes."""
    layers = []
    for layer in layout.layers:
        units: dict[tuple[int, int, str], int] = {}
        for name, _dtype, _shape, nbytes in layer.params:
            key = engine_param_unit(name, architecture)
            units[key] = units.get(key, 0) + nbytes
        layers.append(tuple(units[key] for key in sorted(units)))
    return tuple(layers)


def moved_bytes(layer_params: tuple[tuple[int, ...], ...], limit_bytes: int) -> tuple[int, ...]:
    """Each layer's offloaded bytes under OffloaderV1's loop: layers in order, params in order, each param moved
    whole while the running total is below ``limit_bytes``."""
    moved, total = [], 0
    for params in layer_params:
        taken = 0
        for nbytes in params:
            if total >= limit_bytes:
                break
            taken += nbytes
            total += nbytes
        moved.append(taken)
    return tuple(moved)


def read_at_use_simulation(layer_ms: tuple[float, ...], head_ms: float, copy_ms: dict[int, float]) -> Simulation:
    """One step when each layer in ``copy_ms`` first copies its offloaded bytes on the compute stream: the head,
    then every layer's copy (if any) and compute, one after the other. The copies are drawn on the link's row."""
    now = head_ms
    compute, copies, stalls = [Interval(layer=-1, start_ms=0.0, end_ms=head_ms)], [], []
    for layer, duration in enumerate(layer_ms):
        wait = copy_ms.get(layer, 0.0)
        if wait:
            copies.append(Interval(layer=layer, start_ms=now, end_ms=now + wait))
        stalls.append(wait)
        now += wait
        compute.append(Interval(layer=layer, start_ms=now, end_ms=now + duration))
        now += duration
    return Simulation(step_ms=now, stall_ms=sum(stalls), compute=tuple(compute), copies=tuple(copies),
                      layer_stall_ms=tuple(stalls))


def plan_simulation(plan) -> Simulation:
    """A read-at-use plan's step from its own rows (show's timeline, the reader's step rule)."""
    return read_at_use_simulation(tuple(row.compute_ms for row in plan.layers), plan.prediction.head_ms,
                                  {i: plan.layers[i].copy_ms for i in plan.offload.layers})


@dataclass(frozen=True, kw_only=True)
class ReadAtUseChoice(Choice):
    """A placement of the read-at-use offloader: its GiB limit and what it moves of each layer."""

    #: the engine's limit in GiB (--cpu-offload-gb)
    gib: int
    #: each layer's offloaded bytes
    moved: tuple[int, ...]

    def layer_bytes(self, layers: LayerBytes) -> LayerBytes:
        """``layers`` with what this placement moves of each layer as its selected bytes: the engine selects
        params by the order it offloads them in, not by name."""
        return LayerBytes(total=layers.total, selected=self.moved, num_tensors=layers.num_tensors)


@dataclass(frozen=True)
class _Option:
    gib: int
    moved: tuple[int, ...]
    gpu_bytes: int


class ReadAtUseSearcher:
    """The read-at-use offloader's placements of one model: one per whole GiB, from nothing to every layer; the
    fastest within a budget is the one with the fewest GiB (every offloaded byte adds its copy to the step)."""

    def __init__(self, *, layer_params: tuple[tuple[int, ...], ...], fixed_bytes: int, h2d_bytes_per_s: float,
                 copy_overhead_us: float, num_tensors: int):
        self.h2d_bytes_per_s = h2d_bytes_per_s
        self.copy_overhead_us = copy_overhead_us
        layer_bytes = sum(map(sum, layer_params))
        self.options: list[_Option] = []
        for gib in range(math.ceil(layer_bytes / GIB) + 1):
            moved = moved_bytes(layer_params, gib * GIB)
            # the offloaded params leave the GPU, one layer's copies come back while it runs
            weights = fixed_bytes + layer_bytes - sum(moved) + max(moved, default=0)
            self.options.append(_Option(gib=gib, moved=moved,
                                        gpu_bytes=weights + allocation_slack_bytes(weights, num_tensors)))
        self._least = min(self.options, key=lambda option: (option.gpu_bytes, option.gib))

    def minimum_gpu_bytes(self) -> int:
        """The least budget search() finds a placement within."""
        return self._least.gpu_bytes

    def fits(self, budget_bytes: int) -> bool:
        """Whether some placement fits ``budget_bytes``."""
        return self._least.gpu_bytes <= budget_bytes

    def search(self, *, compute: ComputeTimes, budget_bytes: int) -> ReadAtUseChoice:
        """The fewest GiB whose GPU weights fit ``budget_bytes``; InfeasibleError where none does."""
        option = next((option for option in self.options if option.gpu_bytes <= budget_bytes), None)
        if option is None:
            least = self._least.gpu_bytes
            raise InfeasibleError(
                f"no --cpu-offload-gb placement fits: with every layer's params read at use the weights need {least} "
                f"bytes ({format_bytes(least)}) of GPU memory, but the budget is {budget_bytes} bytes "
                f"({format_bytes(budget_bytes)}); raise --budget or use a larger GPU")
        return self.choice(option, compute)

    def choice(self, option: _Option, compute: ComputeTimes) -> ReadAtUseChoice:
        """``option`` priced at ``compute``: every offloaded byte copied before its layer runs."""
        moved = option.moved
        offloaded = tuple(i for i, nbytes in enumerate(moved) if nbytes)
        copy_ms = {i: copy_ms_of(moved[i], self.h2d_bytes_per_s, self.copy_overhead_us) for i in offloaded}
        knob = 1 if offloaded else 0  # one layer's copies at a time: one slot, no rule, no prefetch
        return ReadAtUseChoice(group_size=knob, num_in_group=knob, prefetch_step=knob, offloaded=offloaded,
                               replay_start_copies=0,
                               simulation=read_at_use_simulation(compute.layer_ms, compute.head_ms, copy_ms),
                               gpu_bytes=option.gpu_bytes, host_pinned_bytes=sum(moved), copy_bytes=sum(moved),
                               gib=option.gib, moved=moved)


# ---- show's words for a read-at-use plan ---------------------------------------------------------------------------

#: show's "bound by" for a read-at-use plan that offloads something
BOUND_WORDS = ("reading at use: each offloaded layer's copy runs before its compute, on the same stream (no "
               "prefetch); fewer GiB (more GPU memory) is the only way faster")
#: show's label of the memory row of one layer's copies
SLOT_WORDS = "GPU: the copies of the layer being read (one at a time)"


def offload_words(plan) -> str:
    """show's offload row: the GiB, the layers it covers (the last in part) and how the engine reads them."""
    offload = plan.offload
    if not offload.layers:
        return f"nothing: --cpu-offload-gb {offload.read_at_use_gib} would move nothing; every weight fits the budget"
    last = plan.layers[offload.layers[-1]]
    part = (f", layer {last.index} in part ({format_bytes(last.offloaded_bytes)} of {format_bytes(last.bytes)})"
            if last.offloaded_bytes < last.bytes else "")
    return (f"--cpu-offload-gb {offload.read_at_use_gib}: layers {offload.layers[0]}-{offload.layers[-1]} of "
            f"{plan.model.num_layers}{part}, in pinned host memory; each layer's params are copied inside its forward "
            "and read at every step, behind no compute (SGLang's OffloaderV1)")


def engine_limits(plan) -> str:
    """What make --for held a read-at-use plan to, for show's verdict."""
    return (f"--cpu-offload-gb, the offloader it wires for {plan.model.architecture}: params read at use, no "
            "prefetch")


def read_at_use_rule(plan) -> str | None:
    """The reader's rule for a read-at-use plan ("field value: why", None when kept): made by make --for, its
    layers the first ones, each but the last moved whole, the GiB reached by them and not before the last."""
    offload = plan.offload
    if offload.mechanism != READ_AT_USE:
        return None
    if plan.inputs.engine is None:
        return "offload.mechanism read_at_use but inputs.engine is null (make --for ENGINE writes it)"
    layers, rows = offload.layers, plan.layers
    if layers != tuple(range(len(layers))):
        return f"offload.layers {list(layers)} are not the first layers, which read_at_use fills in order"
    if layers and (offload.group_size, offload.num_in_group, offload.prefetch_step) != (1, 1, 1):
        return "offload.group_size, num_in_group and prefetch_step are 1 for read_at_use (one layer at a time)"
    moved = [rows[i].offloaded_bytes for i in layers]
    if any(rows[i].offloaded_bytes != rows[i].bytes for i in layers[:-1]):
        return "layers[].offloaded_bytes: read_at_use moves every layer but the last of offload.layers whole"
    limit = offload.read_at_use_gib * GIB
    reached = sum(moved) >= limit or len(layers) == len(rows)
    if not reached or (layers and sum(moved[:-1]) >= limit):
        return (f"offload.read_at_use_gib {offload.read_at_use_gib} is not what offload.layers hold "
                f"({format_bytes(sum(moved))}: the engine stops at the layer that reaches it)")
    return None
