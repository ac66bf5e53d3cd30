"""Fuzz family of derived figures and experts sections (issue 39): a plan make wrote (whole layers offloaded, MoE
experts under CUDA graphs, serving, routed experts) with one figure that other fields determine changed, the
experts section edited by hand, or inputs.tp edited into a one-GPU plan; every reader must refuse it (check as a
stale plan). Unedited, the same plans must pass every reader: the round trip as a property.
"""

import json

from tests.fuzz.core import Base, Case, yaml_text
from tests.fuzz.roundtrip import READERS

#: which base plan, and whether it was made from the MoE model
PLANS = {"plain": False, "graph": True, "serving": False, "routed": True}
#: every reader of a plan file (check regenerates it from the base checkpoint: an edit is a stale plan there)
DERIVED_COMMANDS = (["show", "plan.yaml"], ["show", "plan.yaml", "--json"], ["show", "plan.yaml", "--no-layers"],
                    ["export", "plan.yaml", "--to", "vllm"], ["export", "plan.yaml", "--to", "sglang"],
                    ["export", "plan.yaml", "--to", "vllm", "--tp", "2"], ["diff", "plan.yaml", "graph-plan.yaml"],
                    ["diff", "graph-plan.yaml", "plan.yaml"], ["check", "plan.yaml"])


def _bump(section: dict, key: str, how) -> None:
    section[key] = how(section[key])


def generic_edits(rng, plan: dict) -> list[tuple[str, object]]:
    """(name, edit) of a figure any plan derives from its other fields."""
    layer = rng.randrange(len(plan["layers"]))
    model, memory, prediction = plan["model"], plan["memory"], plan["prediction"]
    edits = [
        ("model.total_bytes", lambda: _bump(model, "total_bytes", lambda v: v + 2)),
        ("model.layer_bytes", lambda: _bump(model, "layer_bytes", lambda v: v + 2)),
        ("model.non_layer_bytes", lambda: _bump(model, "non_layer_bytes", lambda v: v + 2)),
        ("model.dtype_bytes", lambda: model["dtype_bytes"].update({"F32": 4})),
        ("layers[].bytes", lambda: _bump(plan["layers"][layer], "bytes", lambda v: v + 64)),
        ("layers[].copy_ms", lambda: _bump(plan["layers"][layer], "copy_ms", lambda v: 2 * v + 1)),
        ("memory.gpu_bytes", lambda: _bump(memory, "gpu_bytes", lambda v: v // 2)),
        ("memory.host_pinned_bytes", lambda: _bump(memory, "host_pinned_bytes", lambda v: v + 1024)),
        ("memory.resident_layer_bytes", lambda: _bump(memory, "resident_layer_bytes", lambda v: v + 1024)),
        ("memory.non_layer_bytes", lambda: _bump(memory, "non_layer_bytes", lambda v: v + 2)),
        ("memory.num_slots", lambda: _bump(memory, "num_slots", lambda v: v + 1)),
        ("memory.allocation_slack_bytes", lambda: _bump(memory, "allocation_slack_bytes", lambda v: v + 8)),
        ("prediction.step_ms", lambda: _bump(prediction, "step_ms", lambda v: 1.5 * v + 0.01)),
        ("prediction.resident_step_ms", lambda: _bump(prediction, "resident_step_ms", lambda v: v + 0.5)),
        ("prediction.copy_bytes_per_step", lambda: _bump(prediction, "copy_bytes_per_step", lambda v: v + 4096)),
        ("prediction.link_floor_ms", lambda: _bump(prediction, "link_floor_ms", lambda v: v + 1)),
        ("inputs.tp", lambda: plan["inputs"].update(tp=rng.choice((2, 4, 8)))),
    ]
    if memory["total_gpu_bytes"] is not None:
        edits.append(("memory.total_gpu_bytes", lambda: _bump(memory, "total_gpu_bytes", lambda v: v + 1)))
    if prediction["decode_tokens_per_s"] is not None:
        edits.append(("prediction.decode_tokens_per_s", lambda: _bump(prediction, "decode_tokens_per_s",
                                                                      lambda v: 2 * v + 1)))
    offloaded = plan["offload"]["layers"]
    if offloaded and plan["offload"]["prefetch_step"] < len(offloaded):  # one more slot: another schedule
        edits.append(("offload.prefetch_step", lambda: _bump(plan["offload"], "prefetch_step", lambda v: v + 1)))
    if offloaded:
        edits.append(("memory.slot_bytes", lambda: _bump(memory, "slot_bytes", lambda v: v + 64)))
        edits.append(("offload.layers drops one", lambda: plan["offload"].update(layers=offloaded[:-1])))
    return edits


def experts_edits(rng, plan: dict) -> list[tuple[str, object, bool]]:
    """(name, edit, invalid) of an experts section edited by hand (issue 39's list). A whole-layer MoE plan's
    section holds figures of the routed placement it did not choose, which no other field determines: editing
    those may leave a plan make could have written, so only the routed plan's edits are all invalid."""
    experts = plan["experts"]
    routed = any(row["regime"] == "routed" for row in experts["layers"])
    row = rng.randrange(len(experts["layers"]))
    layer = experts["layers"][row]
    return [
        ("experts deleted", lambda: plan.pop("experts"), routed),
        ("experts.layers row deleted", lambda: experts["layers"].pop(row), routed),
        ("experts.num_experts", lambda: _bump(experts, "num_experts", lambda v: v + 1), routed),
        ("experts.expert_bytes", lambda: _bump(experts, "expert_bytes", lambda v: v + 2), routed),
        ("experts.fetch_slots", lambda: _bump(experts, "fetch_slots", lambda v: 0 if v else 2), True),
        ("experts.fetch_buffer_bytes", lambda: _bump(experts, "fetch_buffer_bytes", lambda v: v + 1), True),
        ("experts.staging_buffer_bytes", lambda: _bump(experts, "staging_buffer_bytes", lambda v: 0 if v else 64),
         True),
        ("experts.gather_workspace_bytes", lambda: _bump(experts, "gather_workspace_bytes", lambda v: v + 4), True),
        ("experts.routed_fetch_bytes_per_s 0", lambda: experts.update(routed_fetch_bytes_per_s=0), True),
        ("experts.routed_fetch_bytes_per_s", lambda: _bump(experts, "routed_fetch_bytes_per_s", lambda v: v / 2),
         True),
        ("experts.points empty", lambda: experts.update(points=[]), True),
        ("experts.points num_resident", lambda: experts["points"][0].update(num_resident=0), routed),
        ("experts.routed_unavailable", lambda: experts.update(routed_unavailable="quantized experts"), routed),
        ("experts.routing not hex", lambda: experts.update(routing="trace sha256:" + "z" * 64), True),
        ("experts.accuracy source without a trace", lambda: experts.update(prefetch_accuracy_source="trace_per_rank"),
         True),
        ("experts.prefetch without a depth", lambda: experts.update(prefetch="next_layer_router",
                                                                    prefetch_accuracy=0.5), True),
        ("experts.layers hit_rate", lambda: layer.update(hit_rate=1.0 if layer["hit_rate"] < 1 else 0.0), True),
        ("experts.layers expected_fetched_bytes", lambda: _bump(layer, "expected_fetched_bytes", lambda v: 3 * v + 8),
         True),
        ("experts.layers resident grows", lambda: layer.update(resident=sorted(
            set(layer["resident"]) | {max(layer["resident"], default=-1) + 1})), True),
        ("experts.layers resident shrinks", lambda: layer.update(resident=layer["resident"][:-1]),
         bool(layer["resident"])),
    ]


def gen_derived(rng, base_: Base) -> Case:
    """One base plan, edited (a derived figure, the experts section, inputs.tp) or not (then every reader must
    accept it), read by one reader."""
    which = rng.choice(sorted(PLANS))
    plan = base_.plan_copy(which)
    if rng.random() < 0.1:  # the round trip: the plan as make wrote it
        files = {"plan.yaml": base_.plan_text_of(which).encode()}
        # check is left out: these plans were written to stdout, and check regenerates such a plan with -o (its
        # header then differs); the round-trip family checks plans make wrote with -o
        readers = [[part.replace("new.yaml", "plan.yaml") for part in reader] for reader in READERS
                   if reader[0] != "check"]
        return Case(family="derived", mutation=f"{which} unedited", args=readers[0], invalid=False, files=files,
                    moe=PLANS[which], then=tuple(readers[1:]))
    edits = [(name, edit, True) for name, edit in generic_edits(rng, plan)]
    if plan.get("experts") is not None and rng.random() < 0.6:
        edits = experts_edits(rng, plan)
    elif which == "plain" and rng.random() < 0.1:  # an experts section on a dense plan
        edits = [("experts on a dense plan", lambda: plan.update(experts=json.loads(json.dumps(
            base_.routed_plan["experts"]))), True)]
    name, edit, invalid = rng.choice(edits)
    edit()
    return Case(family="derived", mutation=f"{which}: {name}", args=list(rng.choice(DERIVED_COMMANDS)),
                invalid=invalid, files={"plan.yaml": yaml_text(plan).encode()}, moe=PLANS[which])
