"""The nearest plan an engine expresses, and what it loses against the plan in the plan's own words.

vLLM and SGLang offload whole params of chosen layers (planner.views.export's engine facts): neither fetches routed
experts. For a plan whose experts section routes some MoE layers, export emits the whole-layer plan the planner
itself would make at the same workload and weight budget: the same search over the plan's own layer rows (bytes,
selected bytes, compute times), the same copy model and the same CUDA-graph joins, read from the plan file alone
(no checkpoint). The loss is that plan's predicted step against the routed plan's, in tokens/s.
"""

import math
from dataclasses import dataclass, replace

from planner.model.cost import ComputeTimes
from planner.engines.targets import TARGETS, check_segment
from planner.engines.versions import engine_version
from planner.errors import PlanError, UsageError, shown
from planner.plan.schema import LayerRow, Plan
from planner.search.groups import Choice, LayerBytes, Searcher, SearchSpace, weight_gpu_bytes
from planner.search.simulate import join_every_steps_for
from planner.units import format_bytes, format_ms, format_rate


@dataclass(frozen=True, kw_only=True)
class Loss:
    """What an engine cannot express of a plan, and the predicted tokens/s the nearest expressible plan gives."""

    #: what the engine cannot say, and what it is given instead
    what: str
    #: tokens one step makes (the plan's tokens per step: its sequences for a decode plan)
    num_tokens: int
    plan_step_ms: float
    engine_step_ms: float

    @property
    def plan_tokens_per_s(self) -> float:
        return 1e3 * self.num_tokens / self.plan_step_ms if self.plan_step_ms > 0 else math.inf

    @property
    def engine_tokens_per_s(self) -> float:
        return 1e3 * self.num_tokens / self.engine_step_ms if self.engine_step_ms > 0 else math.inf

    def statement(self, engine: str) -> str:
        """One line: what is lost, the two steps and the two rates, and the share lost."""
        return (f"{engine} cannot express {self.what}: predicted {format_ms(self.plan_step_ms)} -> "
                f"{format_ms(self.engine_step_ms)} per step, {_rate(self.plan_tokens_per_s)} -> "
                f"{_rate(self.engine_tokens_per_s)} tokens/s ({_share_lost(self)})")


def _rate(tokens_per_s: float) -> str:
    """format_rate's three significant digits; 'inf' for a step that rounds to 0 ms."""
    return "inf" if math.isinf(tokens_per_s) else format_rate(tokens_per_s)


def _share_lost(loss: Loss) -> str:
    if loss.engine_step_ms <= 0 or loss.plan_step_ms <= 0:
        return "steps round to 0 ms: no share"
    lost = 1 - loss.plan_step_ms / loss.engine_step_ms
    return f"{100 * lost:.1f}% fewer tokens/s" if lost >= 0 else f"{-100 * lost:.1f}% more tokens/s"


def routed_layers(plan: Plan) -> tuple[int, ...]:
    """The MoE layers the plan fetches routed experts for (none for a dense or whole-layer plan)."""
    if plan.experts is None:
        return ()
    return tuple(row.index for row in plan.experts.routed_layers)


def whole_layer_searcher(plan: Plan, space: SearchSpace = SearchSpace()) -> Searcher:
    """make's whole-layer search, rebuilt from the plan's rows. ``num_tensors`` is the model's (make leaves out
    the tensors of unused layers, a few alignment pads more here: the rebuilt plan never under-counts)."""
    hardware = plan.hardware
    return Searcher(layers=searcher_layers(plan), fixed_bytes=plan.model.non_layer_bytes,
                    h2d_bytes_per_s=hardware.h2d_bytes_per_s, copy_overhead_us=hardware.copy_overhead_us, space=space,
                    join_every_steps=join_every_steps_for(plan.workload.cuda_graph))


def searcher_layers(plan: Plan) -> LayerBytes:
    """The plan's layer rows as the search's LayerBytes."""
    return LayerBytes(total=tuple(row.bytes for row in plan.layers),
                      selected=tuple(row.selected_bytes for row in plan.layers), num_tensors=plan.model.num_tensors)


def recorded_compute(plan: Plan) -> ComputeTimes:
    """The plan's own compute times: its layer rows and head."""
    return ComputeTimes(layer_ms=tuple(row.compute_ms for row in plan.layers), head_ms=plan.prediction.head_ms,
                        source=plan.workload.compute_source)


def whole_layer_choice(plan: Plan, space: SearchSpace = SearchSpace()) -> Choice:
    """The fastest whole-layer placement within the plan's weight budget at the plan's workload; PlanError where
    none fits (the routed plan's budget holds less than one whole-layer slot beside the resident weights)."""
    searcher = whole_layer_searcher(plan, space)
    budget = plan.memory.budget_bytes
    if not searcher.fits(budget):
        raise PlanError(f"no whole-layer placement fits the plan's weight budget of {format_bytes(budget)}, and the "
                        "engines offload only whole layers: serve this plan with offload-plan run, or make it with "
                        "more --gpu-memory")
    return searcher.search(compute=recorded_compute(plan), budget_bytes=budget)


def as_whole_layer_plan(plan: Plan, choice: Choice) -> Plan:
    """``plan`` with ``choice``'s placement instead of its own: offload, memory, prediction and layer rows; the
    experts section goes (every layer is whole), the KV cache, activations and context stay."""
    from planner.plan.schema import OffloadSection

    offloaded = set(choice.offloaded)
    num_slots = min(choice.prefetch_step, len(choice.offloaded))
    slot_bytes = max((plan.layers[i].selected_bytes for i in choice.offloaded), default=0)
    memory = plan.memory
    total = None if memory.total_gpu_bytes is None else memory.total_gpu_bytes - memory.gpu_bytes + choice.gpu_bytes
    simulation = choice.simulation
    step_ms = simulation.step_ms
    decode = plan.prediction.decode_step_ms is not None
    return replace(
        plan,
        offload=OffloadSection(group_size=choice.group_size, num_in_group=choice.num_in_group,
                               prefetch_step=choice.prefetch_step, params=plan.offload.params,
                               layers=choice.offloaded, replay_start_copies=choice.replay_start_copies),
        memory=replace(memory, gpu_bytes=choice.gpu_bytes, num_slots=num_slots, slot_bytes=slot_bytes,
                       allocation_slack_bytes=choice.gpu_bytes - weight_gpu_bytes(
                           plan.model.non_layer_bytes, searcher_layers(plan), choice.offloaded, num_slots),
                       host_pinned_bytes=choice.host_pinned_bytes, total_gpu_bytes=total,
                       resident_layer_bytes=sum(row.bytes for row in plan.layers if row.index not in offloaded)),
        prediction=replace(plan.prediction, step_ms=step_ms, stall_ms=simulation.stall_ms,
                           link_floor_ms=1e3 * choice.copy_bytes / plan.hardware.h2d_bytes_per_s,
                           copy_bytes_per_step=choice.copy_bytes,
                           link_busy_share=simulation.copy_busy_ms / step_ms if step_ms > 0 else 0.0,
                           decode_step_ms=step_ms if decode else None,
                           decode_tokens_per_s=1e3 * plan.workload.tokens_per_step / step_ms if decode and step_ms
                           else plan.prediction.decode_tokens_per_s if decode else None,
                           prefill_chunk_ms=None),  # not re-simulated: export restates decode steps only
        layers=tuple(LayerRow(index=row.index, bytes=row.bytes, selected_bytes=row.selected_bytes,
                              offloaded_bytes=row.selected_bytes if row.index in offloaded else 0,
                              compute_ms=row.compute_ms, copy_ms=row.copy_ms) for row in plan.layers),
        experts=None,
    )


def expressible_plan(plan: Plan) -> tuple[Plan, Loss | None]:
    """The plan the engines can run (itself, or for routed experts the planner's whole-layer plan at the same
    workload and budget) and the loss against it (None when the plan is already expressible)."""
    routed = routed_layers(plan)
    if not routed:
        return plan, None
    choice = whole_layer_choice(plan)
    whole = as_whole_layer_plan(plan, choice)
    placed = (f"{len(choice.offloaded)} whole layers offloaded (G={choice.group_size}, K={choice.num_in_group}, "
              f"P={choice.prefetch_step})" if choice.offloaded else "every layer resident")
    what = (f"routed experts in {len(routed)} MoE layers (the plan's hit rate "
            f"{_mean_hit_rate(plan):.0%}); it gets the planner's whole-layer plan at the same workload and weight "
            f"budget instead: {placed}")
    loss = Loss(what=what, num_tokens=plan.workload.tokens_per_step, plan_step_ms=plan.prediction.step_ms,
                engine_step_ms=whole.prediction.step_ms)
    return whole, loss


def _mean_hit_rate(plan: Plan) -> float:
    rows = [row.hit_rate for row in plan.experts.routed_layers]
    return sum(rows) / len(rows)


def check_engine_input(engine: str | None, params: tuple[str, ...]) -> None:
    """make --for: a known engine, and a --params selection the engine's name matching can say."""
    if engine is None:
        return
    if engine not in TARGETS:
        raise UsageError(f"--for {engine!r} is not an engine offload-plan plans for; choose "
                         f"{' or '.join(TARGETS)}, or leave --for out")
    for segment in params:
        try:
            check_segment(segment)
        except PlanError as error:
            raise UsageError(f"--for {engine}: {error}") from None


def engine_input_warnings(engine: str | None, params: tuple[str, ...]) -> list[str]:
    """make without --for: a --params selection no engine can say (make --for refuses it) is warned of, since
    offload-plan run can still serve it."""
    if engine is not None:
        return []
    warnings = []
    for segment in params:
        try:
            check_segment(segment)
        except PlanError as error:
            warnings.append(f"{error}; export will refuse this plan (make --for ENGINE refuses it at once)")
    return warnings


def check_engine_architecture(engine: str | None, params: tuple[str, ...], config: dict | None,
                              pinned: tuple[str, ...] = ()) -> None:
    """make --for: plan within what the newest pinned engine version wires for the model's family: its prefetch
    offloader, with the selection its model code fixes (SGLang's DeepSeek-V2/V3: the experts), or where that is
    not wired its read-at-use offloader (SGLang's --cpu-offload-gb), which takes neither a selection nor G, K, P
    (``pinned``: the knob flags given)."""
    if engine is None:
        return
    architecture = ((config or {}).get("architectures") or [None])[0]
    release = engine_version(engine)
    fixed = dict(release.prefetch.fixed_selection).get(architecture)
    if fixed is not None and params != (fixed,):
        raise UsageError(f"--for {engine}: {release.label}'s {architecture} code offloads only the routed experts of "
                         f"each offloaded layer; add --params {fixed}")
    if release.prefetch_wired(architecture):
        return
    name = shown(architecture, 40) if architecture else "a config that names no architecture"
    if not release.read_at_use_wired(architecture):
        raise UsageError(f"--for {engine}: {release.label} offloads none of the weights of {name} (its offloaders "
                         f"are wired for {len(release.read_at_use_architectures)} architectures): make the plan "
                         "without --for and serve it with offload-plan run")
    given = [flag for flag, value in (("--params", params), *((flag, True) for flag in pinned)) if value]
    if given:
        raise UsageError(f"--for {engine}: {release.label} offloads {name}'s params with {release.read_at_use_flag} "
                         f"only (the first N GiB, layer 0 onward, read at use), which takes no {given[0]}: drop it")
