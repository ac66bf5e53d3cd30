"""The rules across a plan's fields that make follows when it writes a plan, with make's own bounds
(planner.plan.bounds). Each field's type and range is checked as it is read (planner.plan.file); each rule here returns
the first broken rule as "field value: why", or None. The figures a reader can derive from the plan's other fields
are planner.plan.figures, checked after these.
"""

import re

from planner.errors import shown
from planner.model.expert_placement import decode_gather_bytes
from planner.plan.experts_section import CPU_EXPERTS_CHOICES, ROUTED_EXPERTS_CHOICES
from planner.plan.figures import first_disagreeing_figure, is_decode, near
from planner.plan.schema import NOTHING_FITS, AdaptersSection, Plan, copies_pairs, gathers, routed_rows
from planner.source.profile import MAX_CPU_TIME_SCALE


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
    if inputs.cpu_time_scale is not None and not 0 < inputs.cpu_time_scale <= MAX_CPU_TIME_SCALE:
        return f"inputs.cpu_time_scale {inputs.cpu_time_scale:g} is not in (0, {MAX_CPU_TIME_SCALE:g}]"
    if inputs.max_tpot_ms is not None and not 0 < inputs.max_tpot_ms <= MAX_TPOT_MS:
        return f"inputs.max_tpot_ms {inputs.max_tpot_ms:g} is not in (0, {MAX_TPOT_MS:g}]"
    if (inputs.concurrency is None) != (plan.serving is None):
        return "inputs.concurrency and the serving section come together"
    if not 1 <= inputs.tp <= 1024:
        return f"inputs.tp {inputs.tp} is not a number of GPUs from 1 to 1024"
    if inputs.cpu_experts not in CPU_EXPERTS_CHOICES:
        return f"inputs.cpu_experts {shown(inputs.cpu_experts)} is not one of {', '.join(CPU_EXPERTS_CHOICES)}"
    if inputs.cpu_experts == "off" and plan.experts is not None and plan.experts.cpu is not None:
        return "experts.cpu is given but inputs.cpu_experts is off"
    if inputs.cpu_experts != "rows" and plan.experts is not None and any(
            row.cpu_fixed_ms is not None for row in plan.experts.layers):
        return f"experts.layers split experts by their rows but inputs.cpu_experts is {inputs.cpu_experts}"
    if inputs.routed_experts not in ROUTED_EXPERTS_CHOICES:
        return (f"inputs.routed_experts {shown(inputs.routed_experts)} is not one of "
                f"{', '.join(ROUTED_EXPERTS_CHOICES)}")
    if inputs.routed_experts == "off" and plan.experts is not None and plan.experts.routed_layers:
        return "experts.layers has routed layers but inputs.routed_experts is off"
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


_SHA256 = re.compile(r"^trace sha256:[0-9a-f]{64}$")


def _experts_rules(plan: Plan) -> str | None:
    """experts: the buffers, rate and routing label as make derives them from the section's own counts."""
    from planner.model.experts import ROUTED_FETCH_EFFICIENCY

    experts = plan.experts
    if experts is None:
        return None
    rate = plan.hardware.h2d_bytes_per_s * ROUTED_FETCH_EFFICIENCY
    if not near(experts.routed_fetch_bytes_per_s, rate, relative=1e-6):
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
    dtypes = plan.model.dtype_bytes
    if experts.expert_dtype is not None and dtypes and experts.expert_dtype not in dtypes:
        return (f"experts.expert_dtype {shown(experts.expert_dtype)} is none of the checkpoint's dtypes "
                f"({', '.join(sorted(dtypes))})")
    if not experts.layers or not experts.points:
        return "experts.layers and experts.points hold at least one row each"
    largest = max(row.bytes for row in plan.layers) if plan.layers else 0
    if not 0 < experts.expert_bytes * experts.num_experts <= largest:
        return (f"experts: {experts.num_experts} experts of {experts.expert_bytes} bytes do not fit in any layer "
                f"(the largest holds {largest})")
    routed = bool(routed_rows(plan))
    slots = min(plan.workload.tokens_per_step * experts.top_k, experts.num_experts) if routed else 0
    sets = 2 if experts.prefetching else 1
    zero_row = experts.expert_bytes if experts.cpu is not None else 0  # the row CPU experts read as resident at
    derived = {"fetch_slots": slots, "fetch_buffer_bytes": slots * experts.expert_bytes * sets + zero_row,
               "staging_buffer_bytes": experts.num_experts * experts.expert_bytes if routed else 0}
    tokens = plan.workload.tokens_per_step
    derived["gather_workspace_bytes"] = (decode_gather_bytes(tokens, experts.top_k, experts.num_experts,
                                                             experts.expert_bytes, copies_pairs=copies_pairs(plan))
                                         if routed else 0)
    for key, value in derived.items():
        if getattr(experts, key) != value:
            return f"experts.{key} {getattr(experts, key)} is not the {value} its counts give"
    if routed and experts.routed_unavailable is not None:
        return "experts.routed_unavailable is given but layers are routed"
    if not routed and (experts.prefetch is not None or experts.prefetch_accuracy_source is not None):
        return "experts: prefetch figures belong to plans with routed layers"
    if experts.prefetch is not None and experts.prefetch_depth is None and experts.prefetch_rank_accuracy is not None:
        return "experts.prefetch is on but prefetch_depth is null"
    return _experts_cpu_rule(plan) or _experts_point_rule(plan)


def _experts_cpu_rule(plan: Plan) -> str | None:
    """experts.cpu: CPU experts in routed decode plans only, the section's step figures the layers' sums, and a
    decline reason only where layers are routed and none is on the CPU."""
    experts = plan.experts
    if experts.cpu_declined is not None and not experts.routed_layers:
        return "experts.cpu_declined says why routed layers compute no expert on the CPU: drop it (no routed layers)"
    cpu = experts.cpu
    if cpu is None:
        return None
    if not gathers(plan):
        return ("experts.cpu: CPU experts are planned for decode steps (a context, one token per sequence) that "
                "gather their experts (at most num_experts pairs) only")
    if not any(row.cpu for row in experts.routed_layers):
        return "experts.cpu is given but no routed layer has cpu ids"
    for row in experts.cpu_layers:
        expected = experts.expected_cpu_experts(row)
        # a step sends at most its cpu ids to the CPU, or, split by count, the table's largest entry
        most, what = (max(row.cpu_take), "the most its cpu_take sends") if row.cpu_take else \
            (len(row.cpu), f"every one of its {len(row.cpu)} cpu ids")
        if expected is not None and expected > most * (1 + 1e-6) + 1e-4 / row.cpu_ms_per_expert:
            return (f"experts.layers[{row.index}] cpu_ms {row.cpu_ms:g} is more than its handoff and {what} at "
                    f"cpu_ms_per_expert {row.cpu_ms_per_expert:g}")
    layers_cpu_ms = sum(row.cpu_ms for row in experts.cpu_layers)
    if not near(cpu.cpu_ms_per_step, layers_cpu_ms, len(experts.layers) + 1):
        return f"experts.cpu.cpu_ms_per_step {cpu.cpu_ms_per_step:g} is not its layers' cpu_ms ({layers_cpu_ms:.4f})"
    link_ms = sum(1e3 * row.expected_fetched_bytes / experts.routed_fetch_bytes_per_s
                  for row in experts.routed_layers)
    if not near(cpu.link_ms_per_step, link_ms, len(experts.layers) + 1):
        return (f"experts.cpu.link_ms_per_step {cpu.link_ms_per_step:g} is not its routed layers' expected fetches "
                f"over routed_fetch_bytes_per_s ({link_ms:.4f})")
    if any(row.cpu_ms < cpu.handoff_ms for row in experts.cpu_layers):
        return f"experts.layers cpu_ms below experts.cpu.handoff_ms {cpu.handoff_ms:g}: a CPU path pays its handoff"
    return None


def _experts_point_rule(plan: Plan) -> str | None:
    """The point at the plan's own concurrency chose the plan's regime, at the plan's step, with its residents."""
    experts = plan.experts
    here = next((point for point in experts.points if point.concurrency == plan.workload.concurrency), None)
    if here is None:
        return f"experts.points has no row at the plan's concurrency {plan.workload.concurrency}"
    routed = routed_rows(plan)
    if here.routed != bool(routed):
        return f"experts.points at concurrency {here.concurrency} chose {here.regime}, not the plan's regime"
    if routed and here.num_resident != sum(len(row.resident) for row in routed.values()):
        return f"experts.points at concurrency {here.concurrency}: num_resident is not the plan's resident experts"
    step = here.routed_step_ms if routed else here.whole_layer_step_ms
    if is_decode(plan) and (step is None or not near(step, plan.prediction.step_ms, 2)):
        return f"experts.points at concurrency {here.concurrency}: its step is not prediction.step_ms"
    return None
