"""Fuzz regressions, class: what an error line echoes keeps it one short line. A name or path from an input is
printed escaped (a newline, an escape sequence or a lone surrogate in a tensor, shard or profile name), and a list
that could run long is counted instead of listed.
"""

import pytest

from tests.fuzz.core import SHARDS
from tests.fuzz.regression import INDEX, Refusal, assert_refused, json_file, make_args, profile_file, renamed_tensor

# name -> the refusal; issue 16's campaign saw UnicodeEncodeError in fingerprint, and names with newlines printed
# over several lines
CASES = {
    "header-lone-surrogate-name": Refusal(make_args(), renamed_tensor("\ud800"), "\\ud800"),
    "header-newline-name": Refusal(make_args(), renamed_tensor("\nx"), "\\nx"),
    "header-escape-sequence-name": Refusal(make_args(), renamed_tensor("\x1b[2J"), "\\x1b[2J"),
    "index-newline-in-name": Refusal(make_args(), json_file(INDEX, lambda d: d["weight_map"].update(
        {"a\nb": SHARDS[0]})), "'a\\nb'"),
    "index-shard-path-with-newline": Refusal(make_args(), json_file(INDEX, lambda d: d["weight_map"].update(
        {next(iter(d["weight_map"])): SHARDS[0] + "\n"})), "not the name of a .safetensors shard"),
    "profile-name-newline": Refusal(make_args(), profile_file(lambda p: p.update(name="a\nb")), "'a\\nb'"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_echoed_name_escaped(name):
    assert_refused(name, CASES[name])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_architecture_no_engine_release_wires_is_one_short_line(engine):
    """A plan whose model.architecture no pinned release offloads (the campaign at seed 43 edited it in a plan):
    export's refusal counts the architectures it does wire instead of listing them (450 characters before)."""
    from dataclasses import replace

    from planner.errors import OffloadPlanError
    from planner.views.export import export_plan
    from planner.plan.file import read_plan
    from tests.conftest import REPO_ROOT

    plan = read_plan(REPO_ROOT / "plans" / "llama-3.1-70b-h100-sxm-40gib.yaml")
    unwired = replace(plan, model=replace(plan.model, architecture="NoSuchModelForCausalLM" * 8))
    with pytest.raises(OffloadPlanError) as refused:
        export_plan(unwired, engine)
    message = str(refused.value)
    assert "\n" not in message and len(message) <= 300, message
