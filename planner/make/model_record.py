"""The model record make reads once and every search shares, and the layer times it plans with."""

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.model.activations import ActivationShape, StepShape, estimate_activations, planned_experts_implementation
from planner.model.adapters import Adapter, default_slots
from planner.source.checkpoint import Checkpoint
from planner.model.cost import ComputeTimes, Workload, estimate_compute, geometry_from_config, is_decode_step
from planner.engines.read_at_use import planned_read_at_use, read_at_use_searcher
from planner.engines.versions import engine_version
from planner.model.fp8_cost import fp8_compute_for, has_fp8_experts
from planner.model.expert_placement import gather_rate
from planner.errors import PlanError, UsageError
from planner.search.expert_choice import Comparison, ExpertModel, routed_choice
from planner.model.kv_cache import KvCacheModel
from planner.model.layout import ModelLayout
from planner.make.inputs import ResolvedInputs
from planner.plan.schema import MS_DECIMALS, Inputs
from planner.source.profile import HardwareProfile
from planner.search.groups import Choice, LayerBytes, Searcher, SearchSpace
from planner.search.simulate import join_every_steps_for
from planner.model.all_reduce import AllReduceLink, assumed_link, with_all_reduces

#: times layers on the local GPU for --measure: (checkpoint, layout, workload, profile, measured_on, graphed) ->
#: ComputeTimes. The planner imports no runtime; the command line passes offload_plan.runtime_seam's.
MeasureFunction = Callable[[Checkpoint, ModelLayout, Workload, HardwareProfile, "str | None", bool], ComputeTimes]
#: measures a step on the local GPU for --measure: (checkpoint, layout, workload, graphed, limit_bytes) -> bytes,
#: the eager step's activation peak, or with graphed what its CUDA-graph capture holds at its peak; the process
#: held to limit_bytes of GPU memory (None: the GPU's) while it measures; raises
#: planner.errors.MeasuredOutOfMemoryError where the step does not fit that
MeasureActivations = Callable[[Checkpoint, ModelLayout, Workload, bool, "int | None"], int]
#: measures the all-reduce between the local GPUs for make --tp N --measure: (tp, target profile, measured_on) ->
#: the link (the profile's assumed figure, with why, where it cannot be measured here)
MeasureLink = Callable[[int, HardwareProfile, "str | None"], AllReduceLink]


@dataclass(frozen=True, kw_only=True)
class Model:
    """What make reads once and every search shares."""

    inputs: Inputs
    #: the inputs parsed and checked once (planner.make.inputs)
    resolved: ResolvedInputs
    profile: HardwareProfile
    checkpoint: Checkpoint
    layout: ModelLayout
    layer_bytes: LayerBytes
    #: the cache model, None where the architecture's cache is not modelled (weights-only plans only)
    kv: KvCacheModel | None
    #: tensor dims for the activation estimate, None with kv
    activation_shape: ActivationShape | None
    #: the activation dtype (bf16, fp16, fp32): config.json's, else the weights' (planner.model.kv_cache); what
    #: --kv-dtype auto means, recorded as the plan's workload.kv_dtype even where the cache is not modelled
    activation_dtype: str
    warnings: list[str]
    #: the caller's timing function for --measure (None: not given)
    measure: MeasureFunction | None = None
    #: the caller's activation measurement for --measure (None: not given; the estimate stands)
    measure_activations: MeasureActivations | None = None
    #: --adapter's LoRA adapters, in the order given (empty: none)
    adapters: tuple[Adapter, ...] = ()
    #: a MoE model's experts (planner.search.expert_choice; None for a dense model)
    experts: ExpertModel | None = None
    #: the caller's all-reduce measurement for --tp N --measure (None: the profile's figure stands)
    measure_link: MeasureLink | None = None

    def adapter_slots(self, num_sequences: int, free_bytes: int | None = None) -> int:
        """GPU slots for the adapters: --adapter-slots, else one per sequence of a batch (at most one per adapter)
        within ``free_bytes`` when given; 0 without adapters."""
        if not self.adapters:
            return 0
        if self.inputs.adapter_slots is not None:
            return self.inputs.adapter_slots
        return default_slots(self.adapters, num_sequences, 2**62 if free_bytes is None else free_bytes)

    @property
    def chunk_graphed(self) -> bool:
        """Whether run replays a serving plan's prefill chunk from a CUDA graph, where the plan's placement lets it
        (planner.make.assemble: not through routed experts): a --cuda-graph plan on one GPU, without adapters, for
        the runtime (not an engine's flags), of a dense model or of a MoE model whose prefill experts run
        transformers' grouped_mm (bf16 weights, unquantized), which takes its group offsets on the GPU. Eagerly, a
        small model's chunk is as long as the host takes to issue its kernels, and the host's pace drifts between
        processes: on the H100 a Gemma-2-shaped all-resident chunk of 2048 tokens read 7.2-10.7 ms in two processes
        minutes apart (scripts/experiments/chunk_timing.py), and eager MoE chunks read 11-27% away from make's
        timing; on the H200 two-layer MoE chunks ran 1.1-2.4x faster replayed than eager
        (scripts/experiments/moe_chunk_capture.py). Other experts implementations ask the host which experts
        were hit (runtime.experts_impl): those chunks stay eager."""
        inputs = self.inputs
        return (inputs.cuda_graph and inputs.engine is None and inputs.tp == 1 and not self.adapters
                and (self.experts is None or self._prefill_experts_capturable))

    @property
    def _prefill_experts_capturable(self) -> bool:
        """A MoE model's prefill experts run grouped_mm: bf16 weights and no quantized experts."""
        quantized = has_fp8_experts(self.checkpoint.tensors) or bool(
            (self.checkpoint.config or {}).get("quantization_config"))
        dtype = self.activation_shape.dtype if self.activation_shape is not None else self.activation_dtype
        return not quantized and planned_experts_implementation("prefill", dtype) == "grouped_mm"

    @functools.cached_property
    def searcher(self) -> Searcher:
        """The weight search over this model's layers, shared by every budget and compute time: make --for an
        engine that reads params at use for the model's family searches that engine's placements."""
        inputs = self.inputs
        if planned_read_at_use(inputs.engine, self.checkpoint.config):
            return read_at_use_searcher(self.layout, self.checkpoint.config, self.profile, self.layer_bytes.num_tensors)
        return Searcher(
            layers=self.layer_bytes,
            fixed_bytes=self.layout.non_layer_bytes,
            h2d_bytes_per_s=self.profile.h2d_bytes_per_s.value,
            copy_overhead_us=self.profile.copy_overhead_us.value,
            space=SearchSpace(
                group_size=inputs.group_size, num_in_group=inputs.num_in_group, prefetch_step=inputs.prefetch_step,
                prefetch_divides=inputs.engine is not None and engine_version(inputs.engine).prefetch.must_divide,
            ),
            join_every_steps=join_every_steps_for(inputs.cuda_graph),
        )

    def search(self, compute: ComputeTimes, budget_bytes: int) -> Choice:
        """The fastest placement of the weights within ``budget_bytes`` for steps of ``compute``."""
        return self.searcher.search(compute=compute, budget_bytes=budget_bytes)

    def search_or_none(self, compute: ComputeTimes, budget_bytes: int) -> Choice | None:
        """The fastest placement within the budget, None where none fits (pinned knobs can ask for more than the
        leanest placement needs)."""
        return self.search(compute, budget_bytes) if self.searcher.fits(budget_bytes) else None

    def compare(self, compute: ComputeTimes, budget_bytes: int, workload: Workload,
                routed_extra_bytes: int = 0) -> Comparison:
        """Whole layers against routed experts within ``budget_bytes`` at ``workload`` (a MoE model; routed is
        None where unavailable or nothing routed fits, whole None where no whole-layer placement fits); routed
        experts get ``routed_extra_bytes`` more (what a graphed prefill chunk would hold, which theirs does not)."""
        whole = self.search_or_none(compute, budget_bytes)
        decode = is_decode_step(workload)
        routed = routed_choice(self.experts, searcher=self.searcher, compute=compute,
                               budget_bytes=budget_bytes + routed_extra_bytes,
                               num_tokens=workload.tokens_per_step, decode=decode,
                               non_layer_bytes=self.layout.non_layer_bytes,
                               h2d_bytes_per_s=self.profile.h2d_bytes_per_s.value,
                               copy_overhead_us=self.profile.copy_overhead_us.value,
                               gather_bytes_per_s=gather_rate(self.profile.hbm_bytes_per_s.value,
                                                              self.profile.compute_efficiency.value))
        return Comparison(num_tokens=workload.tokens_per_step, whole=whole, routed=routed,
                          routed_runnable=self.experts.unavailable is None)

    def activations(self, workload: Workload, static_cache_tokens: int | None = None,
                    limit_bytes: int | None = None) -> int:
        """Peak activation bytes of a step of ``workload`` as the runtime runs it: a decode step over a static
        cache of ``static_cache_tokens``, else a prefill (MoE experts as planned_experts_implementation says).
        Measured (--measure) within ``limit_bytes`` of GPU memory, raising MeasuredOutOfMemoryError where the step
        does not fit them."""
        if self.measured_activations:
            return self.measure_activations(self.checkpoint, self.layout, workload, False, limit_bytes)
        tokens_per_sequence = workload.tokens_per_step // workload.sequences_per_step
        step = StepShape(num_sequences=workload.sequences_per_step, tokens_per_sequence=tokens_per_sequence,
                         context_tokens=workload.context_tokens, static_cache_tokens=static_cache_tokens)
        phase = "decode" if static_cache_tokens is not None else "prefill"
        implementation = planned_experts_implementation(phase, self.activation_shape.dtype)
        return estimate_activations(self.activation_shape, step, experts_implementation=implementation).planned_bytes

    def graph_reserve(self, workload: Workload, limit_bytes: int | None = None) -> int | None:
        """With --measure, what capturing a step of ``workload`` in a CUDA graph holds at its peak (its private
        pool, the warm-up stream's workspace), measured within ``limit_bytes`` as activations are; None where
        activations are estimated (the plan then books the pool from the eager peak)."""
        if not self.measured_activations:
            return None
        return self.measure_activations(self.checkpoint, self.layout, workload, True, limit_bytes)

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape by name (read once: a serving search estimates every concurrency)."""
        return {t.name: t.shape for t in self.checkpoint.tensors}

    @property
    def measured_activations(self) -> bool:
        """A serving plan with --measure measures its activation peaks on the local GPU (a weights-only plan keeps
        the estimate, so check can replan it from its recorded rows without a GPU)."""
        inputs = self.inputs
        return inputs.measure and inputs.concurrency is not None and self.measure_activations is not None

    def compute(self, workload: Workload, graphed: bool | None = None) -> ComputeTimes:
        """Layer times for ``workload``: measured with --measure, else the roofline estimate. ``graphed``: steps
        replayed from CUDA graphs (default: the plan's --cuda-graph; a prefill chunk runs eagerly)."""
        graphed = self.inputs.cuda_graph if graphed is None else graphed
        compute = compute_times(self.inputs, self.checkpoint, self.layout, workload, self.profile, self.kv,
                                self.measure, graphed, self.shapes)
        return with_all_reduces(compute, self.checkpoint, workload, self.profile, self.all_reduce_link)

    @functools.cached_property
    def all_reduce_link(self) -> AllReduceLink | None:
        """The all-reduce's cost between ranks (None on one GPU): measured once on the local GPUs with --tp N
        --measure where the caller can, else the profile's link and the assumed latency."""
        inputs = self.inputs
        if inputs.tp == 1:
            return None
        if not inputs.measure:
            return assumed_link(self.profile, inputs.tp)
        if self.measure_link is None:
            return assumed_link(self.profile, inputs.tp, "the all-reduce is measured by the command line's runtime")
        return self.measure_link(inputs.tp, self.profile, inputs.measured_on)


def compute_times(inputs: Inputs, checkpoint, layout, workload, profile, kv: KvCacheModel | None,
                  measure: MeasureFunction | None, graphed: bool, shapes: dict | None = None) -> ComputeTimes:
    """Measured by the caller's ``measure`` with --measure, else the roofline estimate (pure)."""
    if inputs.measure:
        if measure is None:
            raise UsageError("--measure times layers on the local GPU, which needs the runtime: run it as "
                             "offload-plan make --measure (with offload-plan[runtime] installed), or drop --measure")
        measured = measure(checkpoint, layout, workload, profile, inputs.measured_on, graphed)
        return as_recorded(measured, len(layout.layers))
    if inputs.measured_on is not None:
        raise UsageError("--measured-on only applies with --measure")
    shapes = {t.name: t.shape for t in checkpoint.tensors} if shapes is None else shapes
    kv_bytes_of = None if kv is None else functools.partial(kv_step_bytes, kv, kv_dtype=inputs.kv_dtype)
    return estimate_compute(layout, geometry_from_config(checkpoint.config, layout), workload, profile, shapes,
                            kv_bytes_of, fp8_compute_for(inputs.engine, has_fp8_experts(checkpoint.tensors)),
                            graphed, expand_kv_heads=inputs.engine is None)


def as_recorded(compute: ComputeTimes, num_layers: int) -> ComputeTimes:
    """Times rounded as the plan records them, so a plan made from them regenerates from its own rows (check)."""
    if len(compute.layer_ms) != num_layers:
        raise PlanError(f"{len(compute.layer_ms)} layer times for {num_layers} planned layers: the times are for "
                        "another checkpoint; regenerate the plan with make")
    return replace(compute, layer_ms=tuple(round(ms, MS_DECIMALS) for ms in compute.layer_ms),
                   head_ms=round(compute.head_ms, MS_DECIMALS))


def kv_step_bytes(kv: KvCacheModel, layer_index: int, workload: Workload, *, kv_dtype: str) -> float:
    """KV cache bytes one layer reads and writes in a step of ``workload``: each sequence's held tokens."""
    tokens_per_sequence = workload.tokens_per_step // workload.sequences_per_step
    return kv.cache_bytes(num_sequences=workload.sequences_per_step,
                          context_tokens=workload.context_tokens + tokens_per_sequence, kv_dtype=kv_dtype,
                          layer_index=layer_index)
