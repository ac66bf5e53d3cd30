"""The rules across a plan's fields that make follows when it writes a plan, with make's own bounds
(planner.plan.bounds). Each field's type and range is checked as it is read (planner.plan.file); each rule here returns
the first broken rule as "field value: why", or None.
"""

import math
import re

from planner.errors import shown
from planner.plan.schema import NOTHING_FITS, AdaptersSection, Plan, routed_expert_bytes, routed_rows


def first_broken_rule(plan: Plan, *, derived: bool = True) -> str | None:
    """The first rule across fields that ``plan`` breaks ("field value: why"), None when it keeps them all;
    ``derived``: also the figures a reader can derive from the plan's other fields (first_disagreeing_figure)."""
    from planner.engines.read_at_use import read_at_use_rule

    for rules in (_input_rules, _workload_rules, _memory_rules, _serving_rules, _adapter_rules, _experts_rules,
                  read_at_use_rule):
        broken = rules(plan)
        if broken is not None:
            return broken
    return first_disagreeing_figure(plan) if derived else None


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


def _outside(key: str, field_name: str, value: int) -> str | None:
    from planner.plan.bounds import BOUNDS

    low, high = BOUNDS[key]
    return None if low <= value <= high else f"{field_name} {value} is outside {low}..{high}"


def _input_rules(plan: Plan) -> str | None:
    """inputs: every flag within the bounds make checks it against."""
    from planner.plan.bounds import INPUT_KV_DTYPES, MAX_TPOT_MS

    inputs = plan.inputs
    for key in ("tokens", "sequences", "context", "chunk", "group_size", "num_in_group", "prefetch_step",
                "adapter_slots"):
        value = getattr(inputs, key)
        broken = None if value is None else _outside(key, f"inputs.{key}", value)
        if broken:
            return broken
    if inputs.kv_dtype not in INPUT_KV_DTYPES:
        return f"inputs.kv_dtype {shown(inputs.kv_dtype)} is not one of {', '.join(INPUT_KV_DTYPES)}"
    if inputs.prefetch_accuracy is not None and not 0 <= inputs.prefetch_accuracy <= 1:
        return f"inputs.prefetch_accuracy {inputs.prefetch_accuracy:g} is not a share from 0 to 1"
    if inputs.max_tpot_ms is not None and not 0 < inputs.max_tpot_ms <= MAX_TPOT_MS:
        return f"inputs.max_tpot_ms {inputs.max_tpot_ms:g} is not in (0, {MAX_TPOT_MS:g}]"
    if (inputs.concurrency is None) != (plan.serving is None):
        return "inputs.concurrency and the serving section come together"
    if not 1 <= inputs.tp <= 1024:
        return f"inputs.tp {inputs.tp} is not a number of GPUs from 1 to 1024"
    return None


def _workload_rules(plan: Plan) -> str | None:
    """workload: the step make planned from the inputs (a serving plan: a decode step of its concurrency)."""
    from planner.plan.bounds import PLAN_KV_DTYPES

    workload, inputs = plan.workload, plan.inputs
    for key, field_name in (("tokens", "tokens_per_step"), ("sequences", "sequences_per_step"),
                            ("context", "context_tokens"), ("chunk", "chunk_tokens"), ("sequences", "concurrency")):
        broken = _outside(key, f"workload.{field_name}", getattr(workload, field_name))
        if broken:
            return broken
    if workload.concurrency != workload.sequences_per_step:
        return f"workload.concurrency {workload.concurrency} differs from sequences_per_step"
    if workload.kv_dtype not in PLAN_KV_DTYPES:
        return f"workload.kv_dtype {shown(workload.kv_dtype)} is not one of {', '.join(PLAN_KV_DTYPES)}"
    if inputs.kv_dtype != "auto" and workload.kv_dtype != inputs.kv_dtype:
        return f"workload.kv_dtype {workload.kv_dtype} differs from inputs.kv_dtype {inputs.kv_dtype}"
    if workload.context_tokens != inputs.context:
        return f"workload.context_tokens {workload.context_tokens} differs from inputs.context {inputs.context}"
    if plan.serving is None and workload.chunk_tokens != workload.tokens_per_step:
        return f"workload.chunk_tokens {workload.chunk_tokens} differs from tokens_per_step (not a serving plan)"
    return None


def _memory_rules(plan: Plan) -> str | None:
    """memory and prediction: the figures make computes together are there together."""
    memory, prediction = plan.memory, plan.prediction
    whole_gpu = (memory.kv_cache_bytes, memory.activation_bytes, memory.total_gpu_bytes)
    if len({value is None for value in whole_gpu}) > 1:
        return "memory.kv_cache_bytes, activation_bytes and total_gpu_bytes are all null or all numbers"
    if memory.gpu_bytes > memory.budget_bytes:
        return f"memory.gpu_bytes {memory.gpu_bytes} exceeds budget_bytes {memory.budget_bytes}"
    if (prediction.decode_step_ms is None) != (prediction.decode_tokens_per_s is None):
        return "prediction.decode_step_ms and decode_tokens_per_s are both null or both numbers"
    if plan.serving is not None:
        needed = {"memory.kv_cache_bytes": memory.kv_cache_bytes, "prediction.decode_step_ms":
                  prediction.decode_step_ms, "prediction.prefill_chunk_ms": prediction.prefill_chunk_ms}
        missing = [name for name, value in needed.items() if value is None]
        if missing:
            return f"{missing[0]} is null in a serving plan"
    return None


def _serving_rules(plan: Plan) -> str | None:
    """serving: the range --concurrency asked for, the chosen concurrency inside it, rows make can write."""
    from planner.search.serving import parse_concurrency

    serving, workload = plan.serving, plan.workload
    if serving is None:
        return None
    try:
        wanted = parse_concurrency(plan.inputs.concurrency)
    except ValueError:
        return f"inputs.concurrency {shown(plan.inputs.concurrency)} is not a concurrency make accepts"
    if (serving.concurrency_low, serving.concurrency_high) != (wanted.low, wanted.high):
        return (f"serving.concurrency_low..high {serving.concurrency_low}..{serving.concurrency_high} is not "
                f"inputs.concurrency's {wanted.low}..{wanted.high}")
    if not serving.concurrency_low <= workload.concurrency <= serving.concurrency_high:
        return f"workload.concurrency {workload.concurrency} is outside serving's {wanted.low}..{wanted.high}"
    if workload.tokens_per_step != workload.sequences_per_step:
        return "workload.tokens_per_step differs from sequences_per_step in a serving plan (a decode step)"
    if workload.context_tokens < 1:
        return "workload.context_tokens 0: a serving plan serves sequences of --context tokens, at least 1"
    if workload.chunk_tokens != plan.inputs.chunk:
        return f"workload.chunk_tokens {workload.chunk_tokens} differs from inputs.chunk {plan.inputs.chunk}"
    if serving.max_tpot_ms != plan.inputs.max_tpot_ms:
        return f"serving.max_tpot_ms {serving.max_tpot_ms} differs from inputs.max_tpot_ms {plan.inputs.max_tpot_ms}"
    alternative = (serving.no_offload_concurrency, serving.no_offload_step_ms, serving.no_offload_tokens_per_s)
    if len({value is None for value in alternative}) > 1:
        return "serving.no_offload_concurrency, _step_ms and _tokens_per_s are all null or all numbers"
    if serving.no_offload_concurrency is not None and not wanted.low <= serving.no_offload_concurrency <= wanted.high:
        return f"serving.no_offload_concurrency {serving.no_offload_concurrency} is outside {wanted.low}..{wanted.high}"
    return _serving_row_rules(plan)


def _serving_row_rules(plan: Plan) -> str | None:
    serving = plan.serving
    concurrencies = [row.concurrency for row in serving.points]
    if not concurrencies or concurrencies != sorted(set(concurrencies)):
        return "serving.points must be rows of distinct concurrencies, ascending"
    for i, row in enumerate(serving.points):
        where = f"serving.points[{i}]"
        if not serving.concurrency_low <= row.concurrency <= serving.concurrency_high:
            return f"{where}.concurrency {row.concurrency} is outside the serving range"
        if not NOTHING_FITS <= row.num_offloaded <= plan.model.num_layers:
            return f"{where}.num_offloaded {row.num_offloaded} is not from -1 to the {plan.model.num_layers} layers"
        nothing = row.num_offloaded == NOTHING_FITS
        if nothing != (row.step_ms is None):
            return f"{where}.step_ms is null exactly where num_offloaded is -1 (nothing fits)"
        if nothing and (row.group_size, row.num_in_group, row.prefetch_step, row.weights_gpu_bytes) != (0, 0, 0, 0):
            return f"{where}: a row where nothing fits has no placement (group_size ... weights_gpu_bytes 0)"
    return None


def _adapter_rules(plan: Plan) -> str | None:
    """adapters: names as make accepts them, matching inputs.adapters; ranks, slots and pool as make sizes them."""
    from planner.model.adapters import parse_adapter_option
    from planner.errors import UsageError

    section = plan.adapters
    if section is None:
        return None
    given = {}
    for option in plan.inputs.adapters:
        try:
            name, source = parse_adapter_option(option)
        except UsageError:
            return f"inputs.adapters entry {shown(option)} is not NAME=PATH as make accepts it"
        given[name] = source
    if len(given) != len(plan.inputs.adapters):
        return "inputs.adapters names an adapter twice"
    for i, row in enumerate(section.items):
        if given.get(row.name) != row.source:
            return f"adapters.items[{i}] {shown(row.name)}={shown(row.source)} is not in inputs.adapters"
        broken = _outside("rank", f"adapters.items[{i}].rank", row.rank)
        if broken:
            return broken
        if not 0 < row.alpha:
            return f"adapters.items[{i}].alpha {row.alpha} must be above 0"
    return _adapter_pool_rules(plan)


def _adapter_pool_rules(plan: Plan) -> str | None:
    section, items = plan.adapters, plan.adapters.items
    largest_rank, largest_bytes = max(row.rank for row in items), max(row.bytes for row in items)
    if section.max_rank != largest_rank:
        return f"adapters.max_rank {section.max_rank} is not the largest adapter's rank {largest_rank}"
    if not 1 <= section.num_slots <= len(items):
        return f"adapters.num_slots {section.num_slots} is not from 1 to the {len(items)} adapter(s)"
    if plan.inputs.adapter_slots is not None and section.num_slots != plan.inputs.adapter_slots:
        return f"adapters.num_slots {section.num_slots} differs from inputs.adapter_slots {plan.inputs.adapter_slots}"
    if section.slot_bytes != largest_bytes:
        return f"adapters.slot_bytes {section.slot_bytes} is not the largest adapter's {largest_bytes} bytes"
    if section.host_pinned_bytes != sum(row.bytes for row in items):
        return f"adapters.host_pinned_bytes {section.host_pinned_bytes} is not the sum of the adapters' bytes"
    if section.num_missing > section.num_slots:
        return f"adapters.num_missing {section.num_missing} exceeds num_slots {section.num_slots}"
    return _adapter_mode_rules(section)


def _adapter_mode_rules(section: AdaptersSection) -> str | None:
    """The chosen mode is one of the two and the faster of the recorded totals, by the recorded margin."""
    totals = {"blocking": section.blocking_stream_ms, "pipelined": section.pipelined_stream_ms}
    if section.mode not in totals:
        return f"adapters.mode {shown(section.mode)} must be blocking or pipelined"
    chosen = totals[section.mode]
    other = totals["pipelined" if section.mode == "blocking" else "blocking"]
    if chosen > other:
        return f"adapters.mode {section.mode} is not the mode of the lower stream total; regenerate the plan"
    if chosen > 0 and abs(other / chosen - 1.0 - section.mode_margin) > 1e-3:
        return f"adapters.mode_margin {section.mode_margin} does not follow from the stream totals"
    return None


# ---- derived figures: what a reader can work out from the plan itself, held to what the plan stores ----------------


#: a stored time is rounded to MS_DECIMALS (planner.plan.schema): sums of n of them may be off by n half-units
_MS_UNIT = 10.0 ** -4


def _near(stored: float, derived: float, terms: int = 1, relative: float = 1e-6) -> bool:
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
        if not _near(row.copy_ms, derived):
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
    buffers = 0 if experts is None else experts.fetch_buffer_bytes + experts.staging_buffer_bytes
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


def _is_decode(plan: Plan) -> bool:
    workload = plan.workload
    return workload.context_tokens > 0 and workload.tokens_per_step == workload.sequences_per_step


def _prediction_figures(plan: Plan) -> str | None:
    """prediction: the resident step is the rows' compute, the link floor the copied bytes over the link, a decode
    step's tokens/s its sequences over its time."""
    from planner.model.experts import ROUTED_FETCH_EFFICIENCY

    prediction, workload = plan.prediction, plan.workload
    compute = prediction.head_ms + sum(row.compute_ms for row in plan.layers)
    if not _near(prediction.resident_step_ms, compute, len(plan.layers) + 1):
        return (f"prediction.resident_step_ms {prediction.resident_step_ms:g} is not head_ms and the layers' "
                f"compute_ms ({compute:.4f})")
    decode, routed = _is_decode(plan), bool(routed_rows(plan))
    if routed and decode:
        copied = sum(row.expected_fetched_bytes for row in routed_rows(plan).values())
    elif routed or plan.offload.mechanism == "read_at_use":  # read at use: every offloaded byte, every step
        copied = sum(row.offloaded_bytes for row in plan.layers)
    else:  # a layer alone in its slot stays there: copied once at load, not every step
        from planner.search.schedule import PrefetchSchedule

        layers = plan.offload.layers
        schedule = PrefetchSchedule(len(layers), plan.offload.prefetch_step) if layers else None
        copied = sum(plan.layers[layers[k]].offloaded_bytes for k in schedule.copied_positions()) if layers else 0
    # a routed layer's expected fetch is stored rounded, the step's total unrounded: one byte a row apart; a
    # prefetch also gathers predictions that miss, up to the routed layers' non-resident bytes more
    slack = len(routed_rows(plan)) if routed and decode else 0
    extra = sum(row.offloaded_bytes for row in plan.layers) if routed and decode and plan.experts.prefetch else 0
    if not copied - slack <= prediction.copy_bytes_per_step <= copied + slack + extra:
        return (f"prediction.copy_bytes_per_step {prediction.copy_bytes_per_step} is not the {copied} bytes its rows "
                "move")
    rate = plan.hardware.h2d_bytes_per_s * (ROUTED_FETCH_EFFICIENCY if routed and decode else 1.0)
    if not _near(prediction.link_floor_ms, 1e3 * prediction.copy_bytes_per_step / rate, relative=1e-4):
        return f"prediction.link_floor_ms {prediction.link_floor_ms:g} is not copy_bytes_per_step over the link"
    if (prediction.decode_step_ms is not None) != decode:
        return "prediction.decode_step_ms is given exactly for a decode step (context, one token per sequence)"
    if decode and not _near(prediction.decode_step_ms, prediction.step_ms):
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
    if not _near(plan.prediction.step_ms, derived, 2 * len(plan.layers) + 2, relative=2e-3):
        return (f"prediction.step_ms {plan.prediction.step_ms:g} is not the {derived:.4f} ms the plan's own schedule "
                "(offload, layers) gives")
    return None


_SHA256 = re.compile(r"^trace sha256:[0-9a-f]{64}$")


def _experts_rules(plan: Plan) -> str | None:
    """experts: the buffers, rate and routing label as make derives them from the section's own counts."""
    from planner.model.experts import ROUTED_FETCH_EFFICIENCY

    experts = plan.experts
    if experts is None:
        return None
    rate = plan.hardware.h2d_bytes_per_s * ROUTED_FETCH_EFFICIENCY
    if not _near(experts.routed_fetch_bytes_per_s, rate, relative=1e-6):
        return (f"experts.routed_fetch_bytes_per_s {experts.routed_fetch_bytes_per_s:g} is not "
                f"hardware.h2d_bytes_per_s x {ROUTED_FETCH_EFFICIENCY}")
    if experts.routing != "uniform" and not _SHA256.match(experts.routing):
        return f"experts.routing {shown(experts.routing)} is not uniform or trace sha256:<64 hex digits>"
    if (experts.routing != "uniform") != (plan.inputs.routing_trace is not None):
        return "experts.routing names a trace exactly when inputs.routing_trace gives one"
    if str(experts.prefetch_accuracy_source).startswith("trace") and experts.routing == "uniform":
        return (f"experts.prefetch_accuracy_source {experts.prefetch_accuracy_source} but the routing is uniform (no "
                "trace)")
    if not 1 <= experts.top_k <= experts.num_experts:
        return f"experts.top_k {experts.top_k} is not from 1 to num_experts {experts.num_experts}"
    if not experts.layers or not experts.points:
        return "experts.layers and experts.points hold at least one row each"
    largest = max(row.bytes for row in plan.layers) if plan.layers else 0
    if not 0 < experts.expert_bytes * experts.num_experts <= largest:
        return (f"experts: {experts.num_experts} experts of {experts.expert_bytes} bytes do not fit in any layer "
                f"(the largest holds {largest})")
    routed = bool(routed_rows(plan))
    slots = min(plan.workload.tokens_per_step * experts.top_k, experts.num_experts) if routed else 0
    sets = 2 if experts.prefetch is not None else 1
    derived = {"fetch_slots": slots, "fetch_buffer_bytes": slots * experts.expert_bytes * sets,
               "staging_buffer_bytes": experts.num_experts * experts.expert_bytes if routed else 0}
    for key, value in derived.items():
        if getattr(experts, key) != value:
            return f"experts.{key} {getattr(experts, key)} is not the {value} its counts give"
    if routed and experts.routed_unavailable is not None:
        return "experts.routed_unavailable is given but layers are routed"
    if not routed and (experts.prefetch is not None or experts.prefetch_accuracy_source is not None):
        return "experts: prefetch figures belong to plans with routed layers"
    if experts.prefetch is not None and experts.prefetch_depth is None and experts.prefetch_rank_accuracy is not None:
        return "experts.prefetch is on but prefetch_depth is null"
    return _experts_point_rule(plan)


def _experts_point_rule(plan: Plan) -> str | None:
    """The point at the plan's own concurrency chose the plan's regime, at the plan's step, with its residents."""
    experts = plan.experts
    here = next((point for point in experts.points if point.concurrency == plan.workload.concurrency), None)
    if here is None:
        return f"experts.points has no row at the plan's concurrency {plan.workload.concurrency}"
    routed = routed_rows(plan)
    if here.regime != ("routed" if routed else "whole_layer"):
        return f"experts.points at concurrency {here.concurrency} chose {here.regime}, not the plan's regime"
    if routed and here.num_resident != sum(len(row.resident) for row in routed.values()):
        return f"experts.points at concurrency {here.concurrency}: num_resident is not the plan's resident experts"
    step = here.routed_step_ms if routed else here.whole_layer_step_ms
    if _is_decode(plan) and (step is None or not _near(step, plan.prediction.step_ms, 2)):
        return f"experts.points at concurrency {here.concurrency}: its step is not prediction.step_ms"
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
        if row.regime == "whole_layer":
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
    if here.step_ms is None or not _near(here.step_ms, prediction.decode_step_ms):
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
        if not _near(row.copy_ms, copy_ms_of(row.bytes, hardware.h2d_bytes_per_s, hardware.copy_overhead_us)):
            return f"adapters.items[{i}].copy_ms {row.copy_ms:g} is not its bytes over the link"
    if not _near(section.copy_ms, copy_ms_of(section.slot_bytes, hardware.h2d_bytes_per_s, hardware.copy_overhead_us)):
        return f"adapters.copy_ms {section.copy_ms:g} is not slot_bytes over the link"
    return None
