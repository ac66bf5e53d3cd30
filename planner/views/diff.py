"""``diff``: what changed between two plans, in the terms a reviewer decides on.

Layers that moved between GPU and host, the params selection, G/K/P, GPU and host memory, the predicted step,
and whether the model, hardware or workload changed. ``compare_plans`` gives plain data (``diff --json``);
``summary_sentences`` says the same in words.
"""

from dataclasses import asdict

from planner.views.tp_comparison import compare_tp
from planner.plan.schema import Plan
from planner.units import format_bytes, format_ms, format_rate

MEMORY_FIELDS = ("budget_bytes", "gpu_bytes", "host_pinned_bytes", "num_slots", "slot_bytes")
PREDICTION_FIELDS = ("step_ms", "resident_step_ms", "stall_ms", "link_floor_ms", "copy_bytes_per_step")
KNOB_FIELDS = ("group_size", "num_in_group", "prefetch_step")


def compare_plans(old: Plan, new: Plan) -> dict:
    """Every difference between two plans as JSON-ready data; numbers as {old, new, change}."""
    data = {
        "same_model": old.model.fingerprint == new.model.fingerprint,
        "model": {"old": _model_identity(old), "new": _model_identity(new)},
        "hardware": {"old": old.hardware.profile, "new": new.hardware.profile,
                     "changed": _changed(asdict(old.hardware), asdict(new.hardware), exclude=("profile",))},
        "workload": {"changed": _changed(asdict(old.workload), asdict(new.workload))},
        "inputs": {"changed": _changed(_plain(asdict(old.inputs)), _plain(asdict(new.inputs)))},
        "offload": {
            **{name: _number(getattr(old.offload, name), getattr(new.offload, name)) for name in KNOB_FIELDS},
            "params": {"old": list(old.offload.params), "new": list(new.offload.params)},
            "num_offloaded": _number(len(old.offload.layers), len(new.offload.layers)),
        },
        "layers": _moved_layers(old, new),
        "memory": {name: _number(getattr(old.memory, name), getattr(new.memory, name)) for name in MEMORY_FIELDS},
        "prediction": {name: _number(getattr(old.prediction, name), getattr(new.prediction, name))
                       for name in PREDICTION_FIELDS},
    }
    data["adapters"] = compare_adapters(old, new)
    data["serving"] = compare_serving(old, new)
    if old.inputs.tp != new.inputs.tp:  # GPU counts compared: tokens/s per GPU and the verdict
        comparison = compare_tp([old, new])
        data["tensor_parallel"] = {"lines": list(comparison.lines), "verdict": comparison.verdict}
    experts = compare_experts(old, new)
    if experts:  # MoE plans only: other comparisons keep their keys
        data["experts"] = experts
    step = data["prediction"]["step_ms"]
    step["speedup"] = round(step["old"] / step["new"], 4) if step["new"] else None
    return data


ADAPTER_FIELDS = ("num_slots", "slot_bytes", "gpu_bytes", "host_pinned_bytes", "max_rank", "blocking_wait_ms",
                  "pipelined_first_wait_ms", "pipelined_last_wait_ms", "blocking_stream_ms", "pipelined_stream_ms",
                  "mode_margin")


#: the whole-GPU figures a serving comparison turns on: (section, field)
SERVING_FIGURES = (("prediction", "decode_tokens_per_s"), ("memory", "kv_cache_bytes"),
                   ("memory", "total_gpu_bytes"))


def compare_serving(old: Plan, new: Plan) -> dict:
    """Decode tokens/s, KV cache and GPU total as {old, new, change}, where both plans have them."""
    out = {}
    for section, name in SERVING_FIGURES:
        before, after = getattr(getattr(old, section), name), getattr(getattr(new, section), name)
        if before is not None and after is not None:
            out[name] = _number(before, after)
    return out


def _experts_figures(plan: Plan) -> dict:
    """A plan's expert figures: regime, routing, routed layers, resident experts, fetched bytes, mean hit rate,
    experts computed on the host CPU and their ms per decode step."""
    experts = plan.experts
    if experts is None:
        return {"regime": None, "routing": None, "num_routed": 0, "num_resident": 0, "expected_fetched_bytes": 0,
                "hit_rate": 0.0, "num_cpu": 0, "cpu_ms_per_step": 0.0}
    routed = experts.routed_layers
    return {"regime": experts.regime, "routing": experts.routing, "num_routed": len(routed),
            "num_resident": sum(len(row.resident) for row in routed),
            "expected_fetched_bytes": sum(row.expected_fetched_bytes for row in routed),
            "hit_rate": round(sum(row.hit_rate for row in routed) / len(routed), 4) if routed else 0.0,
            "num_cpu": sum(len(row.cpu) for row in experts.layers),
            "cpu_ms_per_step": experts.cpu.cpu_ms_per_step if experts.cpu is not None else 0.0}


def compare_experts(old: Plan, new: Plan) -> dict:
    """MoE plans' experts sections: regime and routing (old, new), counts as {old, new, change}, and the layers
    whose resident experts changed; empty when neither plan has the section."""
    if old.experts is None and new.experts is None:
        return {}
    before, after = _experts_figures(old), _experts_figures(new)
    out = {key: {"old": before[key], "new": after[key]} for key in ("regime", "routing")}
    out.update({key: _number(before[key], after[key]) for key in before if key not in out})
    resident = [{row.index: row.resident for row in plan.experts.layers} if plan.experts else {} for plan in (old, new)]
    out["resident_changed"] = sorted(i for i in set(resident[0]) | set(resident[1])
                                     if resident[0].get(i, ()) != resident[1].get(i, ()))
    return out


def compare_adapters(old: Plan, new: Plan) -> dict:
    """Adapters added, removed and changed (by name: another source, rank or tensors), and the slot and wait
    figures; numbers are 0 for a plan without adapters."""
    before = {row.name: row for row in old.adapters.items} if old.adapters else {}
    after = {row.name: row for row in new.adapters.items} if new.adapters else {}
    changed = {name: _changed(asdict(before[name]), asdict(after[name]))
               for name in sorted(set(before) & set(after)) if before[name] != after[name]}

    def figure(plan: Plan, name: str):
        return getattr(plan.adapters, name) if plan.adapters else 0

    return {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
            "changed": {name: {k: _plain_pair(v) for k, v in diff.items()} for name, diff in changed.items()},
            "mode": {"old": old.adapters.mode if old.adapters else None,
                     "new": new.adapters.mode if new.adapters else None},
            **{name: _number(figure(old, name), figure(new, name)) for name in ADAPTER_FIELDS}}


def _plain_pair(pair: dict) -> dict:
    return {side: list(value) if isinstance(value, tuple) else value for side, value in pair.items()}


def _model_identity(plan: Plan) -> dict:
    model = plan.model
    return {"source": model.source, "fingerprint": model.fingerprint, "architecture": model.architecture,
            "num_layers": model.num_layers}


def _plain(values: dict) -> dict:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}


def _changed(old: dict, new: dict, exclude: tuple[str, ...] = ()) -> dict:
    """{key: {old, new}} for the keys whose values differ."""
    return {key: {"old": old[key], "new": new[key]} for key in old if key not in exclude and old[key] != new[key]}


def _number(old: float, new: float) -> dict:
    change = new - old
    return {"old": old, "new": new, "change": round(change, 4) if isinstance(change, float) else change}


def _moved_layers(old: Plan, new: Plan) -> dict:
    """Layers newly offloaded (to host), newly resident (to GPU), and offloaded in both but moving other bytes."""
    before, after = set(old.offload.layers), set(new.offload.layers)
    both = sorted(before & after)
    reselected = [i for i in both if i < len(new.layers)
                  and old.layers[i].offloaded_bytes != new.layers[i].offloaded_bytes]
    return {"to_host": sorted(after - before), "to_gpu": sorted(before - after), "selection_changed": reselected}


def format_layers(indices: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


def summary_sentences(data: dict) -> list[str]:
    """The comparison in words, most decisive first: model and hardware, layers, memory, step time."""
    sentences = [_identity_sentence(data)]
    for section in ("inputs", "workload"):
        if data[section]["changed"]:
            sentences.append(f"{section.capitalize()} changed: {_pairs(data[section]['changed'])}.")
    sentences += [_layers_sentence(data), _knobs_sentence(data), _memory_sentence(data), _step_sentence(data)]
    serving = _serving_sentence(data["serving"])
    sentences += [serving] if serving else []
    adapters = _adapters_sentence(data["adapters"])
    sentences += [adapters] if adapters else []
    experts = _experts_sentence(data.get("experts", {}))
    sentences += [experts] if experts else []
    if "tensor_parallel" in data:
        sentences += [f"{line}." for line in data["tensor_parallel"]["lines"]]
        sentences.append(data["tensor_parallel"]["verdict"][0].upper() + data["tensor_parallel"]["verdict"][1:] + ".")
    return sentences


def _experts_sentence(experts: dict) -> str | None:
    """Regime, routing, resident experts, bytes fetched per step and hit rate; None without MoE plans."""
    if not experts:
        return None
    regime, routing = experts["regime"], experts["routing"]
    text = (f"Experts: {regime['old']} -> {regime['new']}" if regime["old"] != regime["new"]
            else f"Experts: {regime['new']} (unchanged)")
    if routing["old"] != routing["new"]:
        text += f"; routing {routing['old']} -> {routing['new']}"
    resident, hit = experts["num_resident"], experts["hit_rate"]
    text += (f"; {experts['num_routed']['old']} -> {experts['num_routed']['new']} routed layers, resident experts "
             f"{resident['old']} -> {resident['new']}, fetched per decode step "
             f"{_bytes_change(experts['expected_fetched_bytes'])}, hit rate {100 * hit['old']:.1f}% -> "
             f"{100 * hit['new']:.1f}%")
    cpu, cpu_ms = experts["num_cpu"], experts["cpu_ms_per_step"]
    if cpu["old"] or cpu["new"]:
        text += (f"; experts on the host CPU {cpu['old']} -> {cpu['new']} ({cpu_ms['old']:g} -> {cpu_ms['new']:g} ms "
                 "of CPU path per decode step)")
    if experts["resident_changed"]:
        text += f"; resident experts differ in layers {format_layers(experts['resident_changed'])}"
    return text + "."


def _adapters_sentence(adapters: dict) -> str | None:
    """Adapters added, removed or changed, and their slots and waits; None when neither plan has any."""
    slots = adapters["num_slots"]
    if not slots["old"] and not slots["new"]:
        return None
    parts = [f"{words} {', '.join(adapters[key])}" for key, words in
             (("added", "adapters added:"), ("removed", "adapters removed:")) if adapters[key]]
    parts += [f"adapter {name} changed ({', '.join(diff)})" for name, diff in adapters["changed"].items()]
    blocking, pipelined = adapters["blocking_wait_ms"], adapters["pipelined_first_wait_ms"]
    parts.append(f"{slots['old']} -> {slots['new']} adapter slot(s) of "
                 f"{format_bytes(adapters['slot_bytes']['old'])} -> {format_bytes(adapters['slot_bytes']['new'])}; "
                 f"pinned adapters {_bytes_change(adapters['host_pinned_bytes'])}")
    parts.append(f"a batch of missing adapters waits {format_ms(blocking['old'])} -> {format_ms(blocking['new'])} "
                 f"blocking, its first request {format_ms(pipelined['old'])} -> {format_ms(pipelined['new'])} "
                 "pipelined")
    mode = adapters["mode"]
    if mode["old"] != mode["new"] and mode["old"] and mode["new"]:
        parts.append(f"adapters load {mode['old']} -> {mode['new']} (stream predicted "
                     f"{format_ms(adapters[mode['old'] + '_stream_ms']['new'])} {mode['old']} against "
                     f"{format_ms(adapters[mode['new'] + '_stream_ms']['new'])} {mode['new']})")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def _identity_sentence(data: dict) -> str:
    old, new = data["model"]["old"], data["model"]["new"]
    hardware = data["hardware"]
    if data["same_model"]:
        text = f"Same model ({new['source']}, {new['num_layers']} layers)"
    else:
        text = (f"Different checkpoints: {old['source']} ({old['fingerprint'][:15]}...) -> {new['source']} "
                f"({new['fingerprint'][:15]}...); layers are compared by index")
    if hardware["old"] != hardware["new"]:
        text += f"; hardware {hardware['old']} -> {hardware['new']}"
    else:
        text += f" on {hardware['new']}"
    if hardware["changed"]:
        text += f" (profile figures changed: {_pairs(hardware['changed'])})"
    return text + "."


def _pairs(changed: dict) -> str:
    return ", ".join(f"{key} {shown_value(key, value['old'])} -> {shown_value(key, value['new'])}"
                     for key, value in changed.items())


#: names whose value counts tokens or sequences (inputs and workload), for their unit
TOKEN_NAMES = ("tokens", "context", "chunk")
SEQUENCE_NAMES = ("sequences", "concurrency", "adapter_slots")


def shown_value(name: str, value: object) -> str:
    """A changed field's value for a sentence, with its unit from its name (``*_bytes``, ``*_ms``, ...):
    "none" for None, never a raw float (issue 26: "budget 40GiB -> None", "0.30000000000000004")."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value) or "none"
    if not isinstance(value, (int, float)):
        return str(value)
    return _number_with_unit(name, value)


def _number_with_unit(name: str, value: float) -> str:
    if name.endswith("_bytes_per_s"):
        return f"{format_rate(value / 1e9)} GB/s"
    if name.endswith("_flops_per_s"):
        return f"{format_rate(value / 1e12)} TFLOP/s"
    if name.endswith("_bytes"):
        return format_bytes(value)
    if name.endswith("_ms"):
        return format_ms(value)
    if name.endswith("_us"):
        return f"{format_rate(value)} us"
    if name == "trigger":
        return f"{format_rate(100 * value)}% of GPU memory"
    if name.endswith("_tokens") or name.startswith("tokens") or name in TOKEN_NAMES:
        return f"{value:,} tokens" if isinstance(value, int) else f"{format_rate(value)} tokens"
    if name.startswith("sequences") or name in SEQUENCE_NAMES:
        return f"{value:,} sequences" if isinstance(value, int) else f"{format_rate(value)} sequences"
    if name.endswith("_s"):
        return f"{format_rate(value)} s"
    return f"{value:,}" if isinstance(value, int) else format_rate(value)  # a ratio (compute_efficiency)


def _layers_sentence(data: dict) -> str:
    layers = data["layers"]
    parts = []
    for key, words in (("to_gpu", "move to the GPU"), ("to_host", "move to host memory"),
                       ("selection_changed", "stay offloaded but move other params")):
        if layers[key]:
            parts.append(f"{len(layers[key])} layer(s) {words} ({format_layers(layers[key])})")
    count = data["offload"]["num_offloaded"]
    return (("; ".join(parts) if parts else "No layer moves") +
            f"; {count['old']} -> {count['new']} layers offloaded.")


def _knobs_sentence(data: dict) -> str:
    offload = data["offload"]
    knobs = "/".join(str(offload[name]["old"]) for name in KNOB_FIELDS)
    knobs_new = "/".join(str(offload[name]["new"]) for name in KNOB_FIELDS)
    params = offload["params"]
    old_params, new_params = (" ".join(p) or "whole layers" for p in (params["old"], params["new"]))
    knob_text = f"G/K/P {knobs} -> {knobs_new}" if knobs != knobs_new else f"G/K/P {knobs} (unchanged)"
    param_text = (f"params {old_params} -> {new_params}" if old_params != new_params
                  else f"params {new_params} (unchanged)")
    return f"{knob_text}; {param_text}."


def _memory_sentence(data: dict) -> str:
    memory = data["memory"]
    return (f"GPU weights {_bytes_change(memory['gpu_bytes'])}; budget {_bytes_change(memory['budget_bytes'])}; "
            f"pinned host memory {_bytes_change(memory['host_pinned_bytes'])}; "
            f"{memory['num_slots']['old']} -> {memory['num_slots']['new']} prefetch slot(s).")


def _serving_sentence(serving: dict) -> str | None:
    """Decode tokens/s (a faster step at fewer sequences can serve fewer tokens), KV cache, GPU total."""
    if "decode_tokens_per_s" not in serving:
        return None
    tokens = serving["decode_tokens_per_s"]
    share = 100 * tokens["change"] / tokens["old"] if tokens["old"] else 0.0
    parts = [f"decode {format_rate(tokens['old'])} -> {format_rate(tokens['new'])} tokens/s ({share:+.1f}%)"]
    parts += [f"{label} {_bytes_change(serving[key])}" for key, label in
              (("kv_cache_bytes", "KV cache"), ("total_gpu_bytes", "GPU total")) if key in serving]
    return "Serving: " + "; ".join(parts) + "."


def _bytes_change(pair: dict) -> str:
    if pair["change"] == 0:
        return f"{format_bytes(pair['new'])} (unchanged)"
    sign = "+" if pair["change"] > 0 else "-"
    return f"{format_bytes(pair['old'])} -> {format_bytes(pair['new'])} ({sign}{format_bytes(abs(pair['change']))})"


def _step_sentence(data: dict) -> str:
    step, stall = data["prediction"]["step_ms"], data["prediction"]["stall_ms"]
    if step["change"] == 0:
        return f"Predicted step {format_ms(step['new'])} (unchanged)."
    share = 100 * step["change"] / step["old"] if step["old"] else 0.0
    verdict = (f"{step['speedup']:.2f}x faster" if step["change"] < 0
               else f"{1 / step['speedup']:.2f}x slower") if step["speedup"] else "from zero"
    return (f"Predicted step {format_ms(step['old'])} -> {format_ms(step['new'])} ({share:+.1f}%, {verdict}); "
            f"stall {format_ms(stall['old'])} -> {format_ms(stall['new'])}.")
