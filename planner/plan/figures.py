"""The figures a reader can work out from a plan itself, held to what the plan stores: model and memory bytes,
layer copies, the predicted step from the plan's own schedule, the experts' rows, the serving and adapter rows,
the GPU count its compute prices. Each check returns the first stored figure that disagrees as "field value: why",
or None. planner.plan.rules runs them after the rules across fields (first_broken_rule's ``derived``).
"""

import math

from planner.model.cost import is_decode_step
from planner.plan.experts_section import WHOLE_LAYER
from planner.plan.schema import Plan, gathers, routed_expert_bytes, routed_layer_expert_bytes, routed_rows


def first_disagreeing_figure(plan: Plan) -> str | None:
    """The first stored figure that disagrees with what the plan's other fields give (model and memory bytes,
    layer copies, the predicted step from the plan's own schedule, the experts' rows, the GPU count its compute
    prices), None when every one agrees. show, export and diff refuse such a plan; check regenerates it and shows
    the difference (an edited prefetch_step is a stale plan there, with its diff and fix)."""
    for rules in (_tp_rules, _model_figures, _layer_figures, _memory_figures, _prediction_figures,
                  _experts_row_rules, _serving_figures, _adapter_figures, _step_rule):
        broken = rules(plan)
        if broken is not None:
            return broken
    return None


#: a stored time is rounded to MS_DECIMALS (planner.plan.schema): sums of n of them may be off by n half-units
_MS_UNIT = 10.0 ** -4


def near(stored: float, derived: float, terms: int = 1, relative: float = 1e-6) -> bool:
    """Whether a stored time or rate equals the one derived from other stored figures, to their rounding."""
    return abs(stored - derived) <= terms * _MS_UNIT + relative * max(abs(stored), abs(derived))


def _tp_rules(plan: Plan) -> str | None:
    """inputs.tp against the all-reduces its compute source prices (make --tp N adds them; a one-GPU plan has
    none): a hand-edited tp would export --tensor-parallel-size with whole-model figures."""
    priced = f"all-reduces a step over {plan.inputs.tp} GPUs" in plan.workload.compute_source
    any_priced = "all-reduces a step over " in plan.workload.compute_source
    if plan.inputs.tp > 1 and not priced:
        return (f"inputs.tp {plan.inputs.tp} but workload.compute_source prices no all-reduces over {plan.inputs.tp} "
                "GPUs (a one-GPU plan's figures)")
    if plan.inputs.tp == 1 and any_priced:
        return "inputs.tp 1 but workload.compute_source prices all-reduces between GPUs (a rank's figures)"
    return None


def _model_figures(plan: Plan) -> str | None:
    """model: the bytes by dtype and by part add up to the total; the layer rows add up to layer_bytes."""
    model = plan.model
    if sum(model.dtype_bytes.values()) != model.total_bytes:
        return f"model.dtype_bytes sum to {sum(model.dtype_bytes.values())}, not total_bytes {model.total_bytes}"
    if model.layer_bytes + model.non_layer_bytes + model.unused_bytes != model.total_bytes:
        parts = model.layer_bytes + model.non_layer_bytes + model.unused_bytes
        return f"model.layer_bytes + non_layer_bytes + unused_bytes is {parts}, not total_bytes {model.total_bytes}"
    rows = sum(row.bytes for row in plan.layers)
    if rows != model.layer_bytes:
        return f"layers[].bytes sum to {rows}, not model.layer_bytes {model.layer_bytes}"
    if len(model.unused_layers) != len(set(model.unused_layers)) or (model.unused_bytes > 0) != bool(
            model.unused_layers):
        return "model.unused_layers and unused_bytes must name the same unused layers"
    return None


def _layer_figures(plan: Plan) -> str | None:
    """layers: an offloaded layer moves its selected params, a routed one its non-resident experts, any other
    nothing; each copy time is its bytes over the profile's link."""
    from planner.search.groups import copy_ms_of

    offloaded, routed = set(plan.offload.layers), routed_rows(plan)
    hardware = plan.hardware
    for row in plan.layers:
        where = f"layers[{row.index}]"
        if row.index in offloaded and row.offloaded_bytes != row.selected_bytes:
            return f"{where}.offloaded_bytes {row.offloaded_bytes} is not its selected_bytes (offload.layers holds it)"
        if row.index not in offloaded and row.index not in routed and row.offloaded_bytes:
            return (f"{where}.offloaded_bytes {row.offloaded_bytes} but the layer is neither in offload.layers nor a "
                    "routed MoE layer")
        derived = copy_ms_of(row.selected_bytes, hardware.h2d_bytes_per_s, hardware.copy_overhead_us)
        if not near(row.copy_ms, derived):
            return f"{where}.copy_ms {row.copy_ms:g} is not its selected_bytes over the link ({derived:.4f} ms)"
    return None


def _memory_figures(plan: Plan) -> str | None:
    """memory: the weights on the GPU are what the layer rows, slots and buffers leave there, plus the slack."""
    memory, model, experts = plan.memory, plan.model, plan.experts
    routed = routed_rows(plan)
    # a routed layer pins every expert on the host (its gather reads them there) and keeps copies of its resident
    # ones on the GPU beside the rest of the layer
    resident_experts, pinned_experts = routed_expert_bytes(plan)
    host = sum(row.offloaded_bytes for row in plan.layers if row.index not in routed) + pinned_experts
    offloaded = plan.offload.layers
    derived = {
        "non_layer_bytes": model.non_layer_bytes,
        "host_pinned_bytes": host,
        "resident_layer_bytes": model.layer_bytes - host,
        "num_slots": min(plan.offload.prefetch_step, len(offloaded)),
        "slot_bytes": max((plan.layers[i].selected_bytes for i in offloaded), default=0),
    }
    for key, value in derived.items():
        if getattr(memory, key) != value:
            return f"memory.{key} {getattr(memory, key)} is not the {value} the plan's rows give"
    buffers = 0 if experts is None else (experts.fetch_buffer_bytes + experts.staging_buffer_bytes
                                         + experts.gather_workspace_bytes)
    weights = (memory.non_layer_bytes + memory.resident_layer_bytes + memory.num_slots * memory.slot_bytes + buffers
               + resident_experts)
    if memory.gpu_bytes - weights != memory.allocation_slack_bytes:
        return (f"memory.gpu_bytes {memory.gpu_bytes} is not the {weights} bytes of weights and buffers plus "
                f"allocation_slack_bytes {memory.allocation_slack_bytes}")
    if memory.total_gpu_bytes is not None:
        adapters = 0 if plan.adapters is None else plan.adapters.gpu_bytes
        total = (memory.gpu_bytes + memory.kv_cache_bytes + memory.activation_bytes + memory.cuda_graph_pool_bytes
                 + memory.cuda_context_bytes + adapters)
        if memory.total_gpu_bytes != total:
            return f"memory.total_gpu_bytes {memory.total_gpu_bytes} is not the sum of its parts ({total})"
        if memory.total_gpu_bytes > memory.gpu_memory_bytes:
            return f"memory.total_gpu_bytes {memory.total_gpu_bytes} exceeds gpu_memory_bytes {memory.gpu_memory_bytes}"
    return None


def is_decode(plan: Plan) -> bool:
    """Whether the plan's step is a decode step: a context, one token per sequence."""
    return is_decode_step(plan.workload)


def _prediction_figures(plan: Plan) -> str | None:
    """prediction: the resident step is the rows' compute, the link floor the copied bytes over the link, a decode
    step's tokens/s its sequences over its time."""
    from planner.model.experts import ROUTED_FETCH_EFFICIENCY

    prediction, workload = plan.prediction, plan.workload
    compute = prediction.head_ms + sum(row.compute_ms for row in plan.layers)
    if not near(prediction.resident_step_ms, compute, len(plan.layers) + 1):
        return (f"prediction.resident_step_ms {prediction.resident_step_ms:g} is not head_ms and the layers' "
                f"compute_ms ({compute:.4f})")
    decode, routed, gathering = is_decode(plan), bool(routed_rows(plan)), gathers(plan)
    if routed and gathering:
        copied = sum(row.expected_fetched_bytes for row in routed_rows(plan).values())
    elif plan.offload.mechanism == "read_at_use":  # read at use: every offloaded byte, every step
        copied = sum(row.offloaded_bytes for row in plan.layers)
    elif routed:  # a prefill stages every expert of a routed layer: its non-resident ones and its resident ones
        copied = sum(plan.experts.num_experts * routed_layer_expert_bytes(plan, row)
                     for row in routed_rows(plan).values())
    else:  # a layer alone in its slot stays there: copied once at load, not every step
        from planner.search.schedule import PrefetchSchedule

        layers = plan.offload.layers
        schedule = PrefetchSchedule(len(layers), plan.offload.prefetch_step) if layers else None
        copied = sum(plan.layers[layers[k]].offloaded_bytes for k in schedule.copied_positions()) if layers else 0
    # a routed layer's expected fetch is stored rounded, the step's total unrounded: one byte a row apart; a
    # prefetch also gathers predictions that miss, up to the routed layers' non-resident bytes more
    slack = len(routed_rows(plan)) if routed and gathering else 0
    extra = sum(row.offloaded_bytes for row in plan.layers) if routed and gathering and plan.experts.prefetch else 0
    if not copied - slack <= prediction.copy_bytes_per_step <= copied + slack + extra:
        return (f"prediction.copy_bytes_per_step {prediction.copy_bytes_per_step} is not the {copied} bytes its rows "
                "move")
    rate = plan.hardware.h2d_bytes_per_s * (ROUTED_FETCH_EFFICIENCY if routed and gathering else 1.0)
    if not near(prediction.link_floor_ms, 1e3 * prediction.copy_bytes_per_step / rate, relative=1e-4):
        return f"prediction.link_floor_ms {prediction.link_floor_ms:g} is not copy_bytes_per_step over the link"
    if (prediction.decode_step_ms is not None) != decode:
        return "prediction.decode_step_ms is given exactly for a decode step (context, one token per sequence)"
    if decode and not near(prediction.decode_step_ms, prediction.step_ms):
        return f"prediction.decode_step_ms {prediction.decode_step_ms:g} is not step_ms {prediction.step_ms:g}"
    if decode and not _tokens_per_s_near(prediction.decode_tokens_per_s, workload.sequences_per_step,
                                         prediction.step_ms):
        return (f"prediction.decode_tokens_per_s {prediction.decode_tokens_per_s:g} is not the "
                f"{workload.sequences_per_step} sequences over step_ms")
    if prediction.step_ms + len(plan.layers) * _MS_UNIT < prediction.resident_step_ms:
        return f"prediction.step_ms {prediction.step_ms:g} is below resident_step_ms {prediction.resident_step_ms:g}"
    return None


def _tokens_per_s_near(tokens_per_s: float, sequences: int, step_ms: float) -> bool:
    """Whether ``tokens_per_s`` is ``sequences`` a step of ``step_ms`` (stored rounded: any time within half a
    unit of it)."""
    low_ms, high_ms = max(0.0, step_ms - _MS_UNIT), step_ms + _MS_UNIT
    highest = math.inf if low_ms == 0 else 1e3 * sequences / low_ms
    # tokens/s is itself stored to MS_DECIMALS
    return 1e3 * sequences / high_ms * (1 - 1e-6) - _MS_UNIT <= tokens_per_s <= highest * (1 + 1e-6) + _MS_UNIT


def _step_rule(plan: Plan) -> str | None:
    """prediction.step_ms as the plan's own schedule gives it (planner.views.show.resimulate, what show draws): a
    hand-edited prefetch_step, layer list or step time no longer matches. A routed prefill step (its experts
    copied whole through the staging buffer) is priced from figures the plan does not hold."""
    from planner.views.show import resimulate, routed_decode

    if routed_rows(plan) and not routed_decode(plan):
        return None
    derived = resimulate(plan).step_ms
    if not near(plan.prediction.step_ms, derived, 2 * len(plan.layers) + 2, relative=2e-3):
        return (f"prediction.step_ms {plan.prediction.step_ms:g} is not the {derived:.4f} ms the plan's own schedule "
                "(offload, layers) gives")
    return None


def _experts_row_rules(plan: Plan) -> str | None:
    """experts.layers: a whole layer fetches its selected params where offloaded, nothing elsewhere; a routed one
    at most its non-resident experts, none where every expert is resident."""
    experts = plan.experts
    if experts is None:
        return None
    offloaded = set(plan.offload.layers)
    for i, row in enumerate(experts.layers):
        where, layer = f"experts.layers[{i}]", plan.layers[row.index]
        if row.regime == WHOLE_LAYER:
            moved = row.index in offloaded
            if row.expected_fetched_bytes != (layer.selected_bytes if moved else 0):
                return f"{where}.expected_fetched_bytes {row.expected_fetched_bytes} is not what the whole layer moves"
            if row.hit_rate != (0.0 if moved else 1.0):
                return f"{where}.hit_rate {row.hit_rate:g} is not {0 if moved else 1} for a whole layer"
            continue
        non_resident = experts.num_experts - len(row.resident)
        if layer.offloaded_bytes > non_resident * experts.expert_bytes or (non_resident and (
                not layer.offloaded_bytes or layer.offloaded_bytes % non_resident)):
            return (f"layers[{row.index}].offloaded_bytes {layer.offloaded_bytes} is not the layer's "
                    f"{non_resident} non-resident experts")
        if row.expected_fetched_bytes > layer.offloaded_bytes:
            return f"{where}.expected_fetched_bytes {row.expected_fetched_bytes} exceeds its non-resident bytes"
        uniform_hit = len(row.resident) / experts.num_experts  # uniform routing: every expert equally likely
        if experts.routing == "uniform" and abs(row.hit_rate - uniform_hit) > _MS_UNIT:
            return (f"{where}.hit_rate {row.hit_rate:g} is not the {uniform_hit:.4f} its {len(row.resident)} resident "
                    "experts give under uniform routing")
        if (not row.resident and row.hit_rate != 0.0) or (non_resident == 0 and (
                row.hit_rate != 1.0 or row.expected_fetched_bytes)):
            return f"{where}.hit_rate {row.hit_rate:g} contradicts its {len(row.resident)} resident experts"
    return None


def _serving_figures(plan: Plan) -> str | None:
    """serving: each row's tokens/s is its concurrency over its step; the chosen row is the plan's own figures."""
    serving = plan.serving
    if serving is None:
        return None
    for i, row in enumerate(serving.points):
        if row.step_ms is not None and not _tokens_per_s_near(row.tokens_per_s, row.concurrency, row.step_ms):
            return f"serving.points[{i}].tokens_per_s {row.tokens_per_s:g} is not its concurrency over its step_ms"
    memory, prediction = plan.memory, plan.prediction
    here = next((row for row in serving.points if row.concurrency == plan.workload.concurrency), None)
    if here is None:
        return f"serving.points has no row at the plan's concurrency {plan.workload.concurrency}"
    derived = {"weights_gpu_bytes": memory.gpu_bytes, "kv_cache_bytes": memory.kv_cache_bytes,
               "total_gpu_bytes": memory.total_gpu_bytes}
    for key, value in derived.items():
        if getattr(here, key) != value:
            return (f"serving.points at concurrency {here.concurrency}: {key} {getattr(here, key)} is not the plan's "
                    f"{value}")
    if here.step_ms is None or not near(here.step_ms, prediction.decode_step_ms):
        return f"serving.points at concurrency {here.concurrency}: step_ms is not prediction.decode_step_ms"
    return None


def _adapter_figures(plan: Plan) -> str | None:
    """adapters: copy times are bytes over the link; a LoRA pair is two tensors per adapted module."""
    from planner.search.groups import copy_ms_of

    section, hardware = plan.adapters, plan.hardware
    if section is None:
        return None
    for i, row in enumerate(section.items):
        if row.num_tensors % 2 or row.num_tensors < 2 * len(row.target_modules):
            return (f"adapters.items[{i}].num_tensors {row.num_tensors} is not a lora_A and lora_B for each of its "
                    f"{len(row.target_modules)} module(s)")
        if not near(row.copy_ms, copy_ms_of(row.bytes, hardware.h2d_bytes_per_s, hardware.copy_overhead_us)):
            return f"adapters.items[{i}].copy_ms {row.copy_ms:g} is not its bytes over the link"
    if not near(section.copy_ms, copy_ms_of(section.slot_bytes, hardware.h2d_bytes_per_s, hardware.copy_overhead_us)):
        return f"adapters.copy_ms {section.copy_ms:g} is not slot_bytes over the link"
    return None
