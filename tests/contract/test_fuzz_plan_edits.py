"""Fuzz regressions, class: a plan edited by hand whose fields are out of range or disagree with each other (the
offload section, the hardware and prediction figures, the serving and adapters sections, an experts section, a
derived figure). show, export and check refuse it in one line instead of following the edit.
"""

import random

import pytest

from tests.fuzz import base
from tests.fuzz.core import yaml_text
from tests.fuzz.derived import PLANS, experts_edits, generic_edits
from tests.fuzz.regression import Refusal, adapter_plan_file, assert_refused, plan_file, run_regression, \
    serving_plan_file

SHOW = ["show", "plan.yaml"]
EXPORT_VLLM = ["export", "plan.yaml", "--to", "vllm"]
EXPORT_SGLANG = ["export", "plan.yaml", "--to", "sglang"]


def _chunk_zero(plan: dict) -> None:
    plan["workload"].update(chunk_tokens=0)
    plan["inputs"].update(chunk=0)


def _adapter_renamed(plan: dict) -> None:
    """An adapter named as make refuses to name one, in its item and in the inputs alike."""
    plan["adapters"]["items"][0].update(name="a=b")
    plan["inputs"].update(adapters=["a=b=ad"])


# name -> the refusal
CASES = {
    # issue 16: tracebacks in _section, plan_from_dict, simulate, schedule, export, search, units.format_bytes;
    # layer indices out of range accepted
    "plan-schema-version-float": Refusal(SHOW, plan_file(lambda p: p.update(schema_version=1.0)),
                                         "schema_version 1.0"),
    "plan-negative-layer": Refusal(SHOW, plan_file(lambda p: p["offload"].update(
        layers=[-1, *p["offload"]["layers"]])), "offload.layers must hold whole numbers"),
    "plan-layer-beyond": Refusal(SHOW, plan_file(lambda p: p["offload"].update(layers=[*p["offload"]["layers"], 99])),
                                 "beyond model.num_layers"),
    "plan-zero-bandwidth": Refusal(EXPORT_VLLM, plan_file(lambda p: p["hardware"].update(h2d_bytes_per_s=0.0)),
                                   "must be positive"),
    "plan-nan-ms": Refusal(SHOW, plan_file(lambda p: p["prediction"].update(step_ms=float("nan"))),
                           "prediction.step_ms is nan"),
    "plan-huge-bytes": Refusal(SHOW, plan_file(lambda p: p["memory"].update(gpu_bytes=2**64)), "memory.gpu_bytes is"),
    "plan-k-zero": Refusal(EXPORT_SGLANG, plan_file(lambda p: p["offload"].update(num_in_group=0)),
                           "num_in_group must be"),
    "plan-k-above-g": Refusal(SHOW, plan_file(lambda p: p["offload"].update(
        num_in_group=p["offload"]["group_size"] + 1)), "num_in_group must be"),
    "plan-tokens-zero": Refusal(SHOW, plan_file(lambda p: p["workload"].update(tokens_per_step=0)),
                                "workload.tokens_per_step"),
    "plan-trigger-above-one": Refusal(SHOW, plan_file(lambda p: p["hardware"].update(trigger=2.0)),
                                      "hardware.trigger"),
    # issue 25: hand-edited serving sections (null fields crashed show and export)
    "memory-kv-null": Refusal(SHOW, serving_plan_file(lambda p: p["memory"].update(kv_cache_bytes=None)),
                              "memory.kv_cache_bytes"),
    "decode-null-export": Refusal(EXPORT_VLLM, serving_plan_file(lambda p: p["prediction"].update(
        decode_step_ms=None)), "prediction."),
    "chunk-0": Refusal(EXPORT_VLLM, serving_plan_file(_chunk_zero), "chunk"),
    "range-low-above-high": Refusal(SHOW, serving_plan_file(lambda p: p["serving"].update(
        concurrency_low=64, concurrency_high=8)), "serving.concurrency_low..high"),
    "chosen-outside-range": Refusal(SHOW, serving_plan_file(lambda p: p["workload"].update(
        concurrency=5000, sequences_per_step=5000, tokens_per_step=5000)), "outside"),
    "kv-dtype-junk": Refusal(EXPORT_SGLANG, serving_plan_file(lambda p: p["workload"].update(kv_dtype="int3")),
                             "workload.kv_dtype"),
    "gpu-over-budget-export-tp": Refusal([*EXPORT_SGLANG, "--tp", "3"], serving_plan_file(
        lambda p: p["memory"].update(budget_bytes=0)), "budget_bytes"),
    # issue 25: hand-edited adapters sections, which export turned into engine flags
    "adapter-rank-0": Refusal(EXPORT_VLLM, adapter_plan_file(lambda p: p["adapters"]["items"][0].update(rank=0)),
                              "rank 0"),
    "adapter-max-rank": Refusal(EXPORT_VLLM, adapter_plan_file(lambda p: p["adapters"].update(max_rank=1)),
                                "max_rank"),
    "adapter-slots-above-adapters": Refusal(SHOW, adapter_plan_file(lambda p: p["adapters"].update(
        num_slots=2, gpu_bytes=2 * p["adapters"]["slot_bytes"])), "num_slots"),
    "adapter-slot-small": Refusal(SHOW, adapter_plan_file(lambda p: p["adapters"].update(slot_bytes=1, gpu_bytes=1)),
                                  "slot_bytes"),
    "adapter-pinned": Refusal(SHOW, adapter_plan_file(lambda p: p["adapters"].update(host_pinned_bytes=1)),
                              "host_pinned_bytes"),
    "adapter-name-make-refuses": Refusal(EXPORT_VLLM, adapter_plan_file(_adapter_renamed), "inputs.adapters"),
    "adapter-name-unlike-inputs": Refusal(SHOW, adapter_plan_file(lambda p: p["adapters"]["items"][0].update(
        name="b")), "not in inputs.adapters"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_edited_plan_refused(name):
    assert_refused(name, CASES[name])


def _edited_plans():
    """(plan, edit name, plan text) of every invalid edit of tests/fuzz/derived.py, on every base plan."""
    cases = []
    for which in PLANS:
        count = len(generic_edits(random.Random(0), base().plan_copy(which)))
        if base().plan_copy(which).get("experts") is not None:
            count += len(experts_edits(random.Random(0), base().plan_copy(which)))
        for k in range(count):
            plan = base().plan_copy(which)
            edits = [(name, edit, True) for name, edit in generic_edits(random.Random(0), plan)]
            if plan.get("experts") is not None:
                edits += experts_edits(random.Random(0), plan)
            name, edit, invalid = edits[k]
            if invalid:
                edit()
                cases.append((which, name, yaml_text(plan).encode()))
    return cases


@pytest.mark.parametrize("command", [SHOW, EXPORT_VLLM])
def test_every_reader_refuses_a_disagreeing_figure(command):
    """A derived figure, an experts field or inputs.tp edited by hand: refused in one line by show and export
    (issue 39: show divided by a zero routed_fetch_bytes_per_s, export wrote --tensor-parallel-size 2 with
    whole-model figures, and both followed an edited prefetch_step)."""
    accepted = []
    for which, name, text in _edited_plans():
        result = run_regression(name, command, {"plan.yaml": text}, moe=PLANS[which])
        if result.verdict != "error":
            accepted.append(f"{which}: {name}: {result.verdict} {result.detail}")
    assert not accepted, "\n".join(accepted)


def test_an_experts_section_without_its_layers_is_one_line():
    """A KeyError (exit 70) found by the campaign at seed 40: the experts section read its layers before its keys."""
    plan = base().plan_copy("graph")
    del plan["experts"]["layers"]
    result = run_regression("experts-without-layers", ["show", "plan.yaml", "--json"],
                            {"plan.yaml": yaml_text(plan).encode()}, moe=True)
    assert result.verdict == "error" and "experts" in result.message, result


def test_check_shows_an_edited_prefetch_step_as_stale():
    """check reads a plan whose figures disagree and shows the edit as the difference from what make writes."""
    plan = base().plan_copy("plain")
    plan["offload"]["prefetch_step"] += 1
    result = run_regression("prefetch-step-edited", ["check", "plan.yaml"], {"plan.yaml": yaml_text(plan).encode()})
    assert result.verdict == "error" and "stale" in result.message, result
