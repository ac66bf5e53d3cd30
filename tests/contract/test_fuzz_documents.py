"""Fuzz regressions, class: a JSON or YAML document a reader must refuse before it reads it (aliases, nesting
deeper than any real file, integers of thousands of digits, NaN, a file too large, a key twice, keys that are
not names), whichever input it is: a safetensors header, the index, config.json, a plan or a GPU profile.

The comment on each group names what the campaign saw before the fix (issue 16's campaign found them all).
"""

import json

import pytest
import yaml

from tests.fuzz import ALIAS_BOMB, DEEP, VERSION_LINE, base
from tests.fuzz.core import HUGE_INT
from tests.fuzz.regression import CONFIG, INDEX, Refusal, assert_refused, first_tensor, header_edit, json_file, \
    make_args, plan_file, profile_file

#: the project's own words for a YAML document it will not read: its depth limit, or the parser's refusal
YAML_REFUSED = ("nested more than", "not valid YAML")


def _offsets_spliced(header: dict, new: str) -> bytes:
    """The header as JSON with its first tensor's data_offsets replaced by the raw text ``new``."""
    return json.dumps(header).replace(json.dumps(header[first_tensor(header)]["data_offsets"]), new, 1).encode()


def _entry_twice(header: dict) -> bytes:
    """The header as JSON with its first entry written twice."""
    name = first_tensor(header)
    entry = f'"{name}": {json.dumps(header[name])}'
    return json.dumps(header).replace(entry, f"{entry}, {entry}", 1).encode()


# name -> the refusal; built when the module is collected (the base inputs are built once per process)
CASES = {
    # safetensors headers: RecursionError and ValueError in _parse_json; duplicates accepted
    "header-deep": Refusal(make_args(), header_edit(
        lambda h: json.dumps({"x": json.loads("[" * 100 + "]" * 100)}).encode()), "nested more than"),
    "header-deeper-than-recursion": Refusal(make_args(), header_edit(
        lambda h: ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()), "nested more than"),
    "header-huge-int": Refusal(make_args(), header_edit(lambda h: _offsets_spliced(h, f"[0, {HUGE_INT}]")),
                               "digit integer"),
    "header-nan-offset": Refusal(make_args(), header_edit(lambda h: _offsets_spliced(h, "[NaN, 8]")),
                                 "NaN is not a JSON number"),
    "header-duplicate-name": Refusal(make_args(), header_edit(_entry_twice), "appears twice"),
    # index: RecursionError and ValueError in _read_weight_map
    "index-deep": Refusal(make_args(), json_file(INDEX, raw=('{"weight_map": {}, "metadata": ' + DEEP + "}").encode()),
                          "nested more than"),
    "index-huge-int": Refusal(make_args(), json_file(INDEX, raw=('{"metadata": {"total_size": ' + HUGE_INT
                                                                 + "}}").encode()), "digit integer"),
    # config.json: RecursionError and ValueError in _read_config
    "config-deep": Refusal(make_args(), json_file(CONFIG, raw=('{"x": ' + DEEP + "}").encode()), "nested more than"),
    "config-huge-int": Refusal(make_args(), json_file(CONFIG, raw=('{"vocab_size": ' + HUGE_INT + "}").encode()),
                               "digit integer"),
    # plan YAML: hangs on alias bombs; tracebacks in read_plan
    "plan-alias-bomb": Refusal(["show", "plan.yaml"], plan_file(raw=(ALIAS_BOMB + base().plan_text).encode()),
                               "aliases are not allowed"),
    # deep YAML: libyaml or PyYAML may refuse it first (PyYAML 6.0.4's scanner does, in words of its own), so
    # the case asks for the project's framing of either refusal, never the library's wording
    "plan-deep": Refusal(["show", "plan.yaml"], plan_file(raw=(base().plan_text + "x: " + DEEP + "\n").encode()),
                         YAML_REFUSED),
    "plan-huge-int": Refusal(["show", "plan.yaml"], plan_file(raw=base().plan_text.replace(
        VERSION_LINE, f"schema_version: {HUGE_INT}").encode()), "digit integer"),
    "plan-too-large": Refusal(["show", "plan.yaml"], plan_file(raw=(base().plan_text + "#" + "x" * (17 * 2**20))
                                                               .encode()), "too large"),
    "plan-duplicate-key": Refusal(["show", "plan.yaml"], plan_file(raw=base().plan_text.replace(
        VERSION_LINE, f"{VERSION_LINE}\n{VERSION_LINE}").encode()), "appears twice"),
    "plan-number-keys": Refusal(["show", "plan.yaml"], plan_file(lambda p: p["memory"].update({5: 1, "x": 2})),
                                "differ from the schema"),
    # profile YAML: hangs on alias bombs; tracebacks in profile_from_dict
    "profile-alias-bomb": Refusal(make_args(), profile_file(raw=(ALIAS_BOMB + yaml.safe_dump(base().profile))
                                                            .encode()), "aliases are not allowed"),
    "profile-deep": Refusal(make_args(), profile_file(raw=("description: " + DEEP + "\n").encode()), YAML_REFUSED),
    "profile-huge-int": Refusal(make_args(), profile_file(lambda p: p["gpu_memory_bytes"].update(value=10**400)),
                                "digit integer"),
    "profile-duplicate-key": Refusal(make_args(), profile_file(raw=("name: x\n" + yaml.safe_dump(base().profile))
                                                               .encode()), "appears twice"),
    "profile-number-keys": Refusal(make_args(), profile_file(lambda p: p.update({5: 1, "x": 2})), "unknown field(s)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_document_refused(name):
    assert_refused(name, CASES[name])
