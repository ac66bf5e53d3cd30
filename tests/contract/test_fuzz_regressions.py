"""Every distinct failure the fuzz campaign of issue 16 found, kept fixed: one line, the right exit code, fast.

Each case is built from the fuzzer's base inputs (tests/fuzz.py) with one edit, run through the CLI in-process
and must end in a clean one-line error of the expected class that says what is wrong. The comment on each
group names what the campaign saw before the fix.
"""

import json
import struct
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import MAX_ERROR_LINE_CHARS
from tests.fuzz import BASE_ARGS, GUARD_NAME, SHARDS, VERSION_LINE, Case, _framed, _header_of, base, run_case

MODEL, PROFILE, PLAN, USAGE = 2, 3, 4, 6
SHARD = f"ckpt/{SHARDS[0]}"
INDEX = "ckpt/model.safetensors.index.json"


def _make(**files) -> tuple[list[str], dict]:
    return [*BASE_ARGS, "--budget", base().budget, "-o", GUARD_NAME], files


def _header(edit, data_extra: int = 0, index_edit=None):
    """A make case whose first shard's header is ``edit(header)`` (a dict, or raw JSON bytes)."""
    tensors = base().dense.shards[SHARDS[0]]
    header = _header_of(tensors)
    data_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()) + data_extra
    edited = edit(header)
    files = {SHARD: _framed(header if edited is None else edited, data_bytes)}
    if index_edit is not None:
        weight_map = dict(base().dense.weight_map)
        index_edit(weight_map)
        files[INDEX] = json.dumps({"weight_map": weight_map}).encode()
    return lambda: _make(**files)


def _first(header: dict) -> str:
    return next(iter(header))


def _rename(old_suffix: str, new_suffix: str):
    """Rename the first tensor in the header and the index alike."""
    def edit(header):
        name = _first(header)
        header[name + new_suffix] = header.pop(name)
    def index_edit(weight_map):
        name = next(iter(_header_of(base().dense.shards[SHARDS[0]])))
        weight_map[name + new_suffix] = weight_map.pop(name)
    return _header(edit, index_edit=index_edit)


def _json_file(path: str, edit=None, raw: bytes | None = None, moe: bool = False):
    def build():
        model = base().moe if moe else base().dense
        data = json.loads(model.files()[path])
        if edit is not None:
            edit(data)
        return _make(**{path: raw if raw is not None else json.dumps(data).encode()})
    return build


def _plan(edit=None, raw: bytes | None = None, command: tuple = ("show", "plan.yaml")):
    def build():
        plan = base().plan_copy("plain")
        if edit is not None:
            edit(plan)
        text = raw if raw is not None else yaml.safe_dump(plan, sort_keys=False).encode()
        return list(command), {"plan.yaml": text}
    return build


def _profile(edit=None, raw: bytes | None = None):
    def build():
        profile = json.loads(json.dumps(base().profile))
        if edit is not None:
            edit(profile)
        return _make(**{"gpu.yaml": raw if raw is not None else yaml.safe_dump(profile).encode()})
    return build


def _flags(*args):
    return lambda: (list(args), {})


ALIAS_BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
                       + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 20)]) + "\n"
DEEP = "[" * 10_000 + "]" * 10_000
HUGE = "1" + "0" * 5000

#: the project's own words for a YAML document it will not read: its depth limit, or the parser's refusal
YAML_REFUSED = ("nested more than", "not valid YAML")

# name -> (build() -> (args, files), exit code, fragment of the one error line, or a tuple of alternatives);
# fragments are the project's words, never a dependency's (their wording changes between releases)
CASES = {
    # headers: negative offsets were accepted; TypeError in _entry; RecursionError and ValueError in _parse_json;
    # UnicodeEncodeError in fingerprint; ValueError in layout._split; overlaps, gaps, duplicates accepted
    "header-negative-offset": (_header(lambda h: h[_first(h)].update(data_offsets=[-8, -8 + 2 * 16 * 32])), MODEL,
                               "invalid data_offsets"),
    "header-dtype-list": (_header(lambda h: h[_first(h)].update(dtype=[])), MODEL, "unknown dtype"),
    "header-shape-bool": (_header(lambda h: h[_first(h)].update(shape=[True, 16])), MODEL, "invalid shape"),
    "header-huge-dim": (_header(lambda h: h[_first(h)].update(shape=[2**70, 16])), MODEL, "invalid shape"),
    "header-deep": (_header(lambda h: json.dumps({"x": json.loads("[" * 100 + "]" * 100)}).encode()), MODEL,
                    "nested more than"),
    "header-deeper-than-recursion": (_header(lambda h: ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()),
                                     MODEL, "nested more than"),
    "header-huge-int": (_header(lambda h: json.dumps(h).replace(
        json.dumps(h[_first(h)]["data_offsets"]), f"[0, {HUGE}]", 1).encode()), MODEL, "digit integer"),
    "header-nan-offset": (_header(lambda h: json.dumps(h).replace(
        json.dumps(h[_first(h)]["data_offsets"]), "[NaN, 8]", 1).encode()), MODEL, "NaN is not a JSON number"),
    "header-lone-surrogate-name": (_rename("", "\ud800"), MODEL, "\\ud800"),
    "header-newline-name": (_rename("", "\nx"), MODEL, "\\nx"),
    "header-escape-sequence-name": (_rename("", "\x1b[2J"), MODEL, "\\x1b[2J"),
    "header-superscript-layer-index": (_header(lambda h: json.dumps(h).replace(
        "model.layers.0.", "model.layers.\\u00b2.").encode(), index_edit=lambda m: m.update(
            {k.replace("model.layers.0.", "model.layers.\u00b2."): m.pop(k) for k in list(m)
             if k.startswith("model.layers.0.")})), MODEL, "layer indices are not"),
    "header-huge-layer-index": (_header(lambda h: json.dumps(h).replace(
        "model.layers.1.", "model.layers.99999999999.").encode(), index_edit=lambda m: m.update(
            {k.replace("model.layers.1.", "model.layers.99999999999."): m.pop(k) for k in list(m)
             if k.startswith("model.layers.1.")})), MODEL, "missing [1, 6"),
    "header-overlap": (_header(lambda h: h[list(h)[1]].update(data_offsets=[
        h[list(h)[1]]["data_offsets"][0] - 2, h[list(h)[1]]["data_offsets"][1] - 2])), MODEL, "overlaps"),
    "header-gap": (_header(lambda h: h[max(h, key=lambda n: h[n]["data_offsets"][1])].update(data_offsets=[
        o + 16 for o in h[max(h, key=lambda n: h[n]["data_offsets"][1])]["data_offsets"]]), data_extra=16), MODEL,
        "leaves a gap"),
    "header-duplicate-name": (_header(lambda h: json.dumps(h).replace(
        f'"{_first(h)}": {json.dumps(h[_first(h)])}',
        f'"{_first(h)}": {json.dumps(h[_first(h)])}, "{_first(h)}": {json.dumps(h[_first(h)])}', 1).encode()), MODEL,
        "appears twice"),
    "header-tensor-not-in-index": (_header(lambda h: h.update({"model.extra.weight": {
        "dtype": "BF16", "shape": [4], "data_offsets": [max(e["data_offsets"][1] for e in h.values()),
                                                        max(e["data_offsets"][1] for e in h.values()) + 8]}}),
        data_extra=8), MODEL, "not in the index"),
    # index: RecursionError and ValueError in _read_weight_map; newlines in names printed over several lines
    "index-deep": (_json_file(INDEX, raw=('{"weight_map": {}, "metadata": ' + DEEP + "}").encode()), MODEL,
                   "nested more than"),
    "index-huge-int": (_json_file(INDEX, raw=('{"metadata": {"total_size": ' + HUGE + "}}").encode()), MODEL,
                       "digit integer"),
    "index-newline-in-name": (_json_file(INDEX, lambda d: d["weight_map"].update({"a\nb": SHARDS[0]})), MODEL,
                              "'a\\nb'"),
    "index-shard-path-with-newline": (_json_file(INDEX, lambda d: d["weight_map"].update(
        {next(iter(d["weight_map"])): SHARDS[0] + "\n"})), MODEL, "not the name of a .safetensors shard"),
    "index-misses-a-tensor": (_json_file(INDEX, lambda d: d["weight_map"].pop(next(iter(d["weight_map"])))), MODEL,
                              "not in the index"),
    # config.json: RecursionError and ValueError in _read_config; KeyError and TypeError in _model_section;
    # TypeError in geometry_from_config; OverflowError in layer_cost; a hang on huge geometry
    "config-deep": (_json_file("ckpt/config.json", raw=('{"x": ' + DEEP + "}").encode()), MODEL, "nested more than"),
    "config-huge-int": (_json_file("ckpt/config.json", raw=('{"vocab_size": ' + HUGE + "}").encode()), MODEL,
                        "digit integer"),
    "config-architectures-mapping": (_json_file("ckpt/config.json", lambda d: d.update(architectures={"a": 1})),
                                     MODEL, "architectures is"),
    "config-architectures-number": (_json_file("ckpt/config.json", lambda d: d.update(architectures=5)), MODEL,
                                    "architectures is"),
    "config-hidden-size-text": (_json_file("ckpt/config.json", lambda d: d.update(hidden_size="x")), MODEL,
                                "hidden_size is 'x'"),
    "config-huge-head-dim": (_json_file("ckpt/config.json", lambda d: d.update(head_dim=10**20)), MODEL,
                             "head_dim is"),
    "config-huge-layers": (_json_file("ckpt/config.json", lambda d: d.update(num_hidden_layers=10**18)), MODEL,
                           "num_hidden_layers is"),
    "config-bool-heads": (_json_file("ckpt/config.json", lambda d: d.update(num_attention_heads=True)), MODEL,
                          "num_attention_heads is True"),
    "config-nan-hidden": (_json_file("ckpt/config.json", raw=b'{"hidden_size": NaN}'), MODEL, "hidden_size is nan"),
    "config-text-config-not-object": (_json_file("ckpt/config.json", lambda d: d.update(text_config=5)), MODEL,
                                      "text_config is 5"),
    "config-top-k-above-experts": (_json_file("ckpt/config.json", lambda d: d.update(num_experts_per_tok=9),
                                              moe=True), MODEL, "routes each token to 9 experts"),
    # plan YAML: hangs on alias bombs; tracebacks in read_plan, _section, plan_from_dict, simulate, schedule,
    # export, search, units.format_bytes; layer indices out of range accepted
    "plan-alias-bomb": (_plan(raw=(ALIAS_BOMB + base().plan_text).encode()), PLAN, "aliases are not allowed"),
    # deep YAML: libyaml or PyYAML may refuse it first (PyYAML 6.0.4's scanner does, in words of its own), so
    # the case asks for the project's framing of either refusal, never the library's wording
    "plan-deep": (_plan(raw=(base().plan_text + "x: " + DEEP + "\n").encode()), PLAN, YAML_REFUSED),
    "plan-huge-int": (_plan(raw=base().plan_text.replace(VERSION_LINE, f"schema_version: {HUGE}").encode()),
                      PLAN, "digit integer"),
    "plan-too-large": (_plan(raw=(base().plan_text + "#" + "x" * (17 * 2**20)).encode()), PLAN, "too large"),
    "plan-duplicate-key": (_plan(raw=base().plan_text.replace(
        VERSION_LINE, f"{VERSION_LINE}\n{VERSION_LINE}").encode()), PLAN, "appears twice"),
    "plan-number-keys": (_plan(lambda p: p["memory"].update({5: 1, "x": 2})), PLAN, "differ from the schema"),
    "plan-schema-version-float": (_plan(lambda p: p.update(schema_version=1.0)), PLAN, "schema_version 1.0"),
    "plan-negative-layer": (_plan(lambda p: p["offload"].update(layers=[-1, *p["offload"]["layers"]])), PLAN,
                            "offload.layers must hold whole numbers"),
    "plan-layer-beyond": (_plan(lambda p: p["offload"].update(layers=[*p["offload"]["layers"], 99])), PLAN,
                          "beyond model.num_layers"),
    "plan-zero-bandwidth": (_plan(lambda p: p["hardware"].update(h2d_bytes_per_s=0.0),
                                  command=("export", "plan.yaml", "--to", "vllm")), PLAN, "must be positive"),
    "plan-nan-ms": (_plan(lambda p: p["prediction"].update(step_ms=float("nan"))), PLAN, "prediction.step_ms is nan"),
    "plan-huge-bytes": (_plan(lambda p: p["memory"].update(gpu_bytes=2**64)), PLAN, "memory.gpu_bytes is"),
    "plan-k-zero": (_plan(lambda p: p["offload"].update(num_in_group=0),
                          command=("export", "plan.yaml", "--to", "sglang")), PLAN, "num_in_group must be"),
    "plan-k-above-g": (_plan(lambda p: p["offload"].update(num_in_group=p["offload"]["group_size"] + 1)), PLAN,
                       "num_in_group must be"),
    "plan-tokens-zero": (_plan(lambda p: p["workload"].update(tokens_per_step=0)), PLAN, "workload.tokens_per_step"),
    "plan-trigger-above-one": (_plan(lambda p: p["hardware"].update(trigger=2.0)), PLAN, "hardware.trigger"),
    # profile YAML: hangs on alias bombs; tracebacks in profile_from_dict, _figure, __post_init__, roofline_ms
    "profile-alias-bomb": (_profile(raw=(ALIAS_BOMB + yaml.safe_dump(base().profile)).encode()), PROFILE,
                           "aliases are not allowed"),
    "profile-deep": (_profile(raw=("description: " + DEEP + "\n").encode()), PROFILE, YAML_REFUSED),
    "profile-huge-int": (_profile(lambda p: p["gpu_memory_bytes"].update(value=10**400)), PROFILE,
                         "digit integer"),
    "profile-int-beyond-float": (_profile(lambda p: p["hbm_bytes_per_s"].update(value=10**29)), PROFILE,
                                 "beyond any GPU"),
    "profile-zero-fp8": (_profile(lambda p: p["fp8_flops_per_s"].update(value=0)), PROFILE,
                         "fp8_flops_per_s must be positive"),
    "profile-number-keys": (_profile(lambda p: p.update({5: 1, "x": 2})), PROFILE, "unknown field(s)"),
    "profile-name-list": (_profile(lambda p: p.update(name=[])), PROFILE, "name must be"),
    "profile-name-newline": (_profile(lambda p: p.update(name="a\nb")), PROFILE, "'a\\nb'"),
    "profile-duplicate-key": (_profile(raw=("name: x\n" + yaml.safe_dump(base().profile)).encode()), PROFILE,
                              "appears twice"),
    # flags: -o into a missing folder, onto a folder, under a file; pinned knobs below 1; implausible workloads
    "output-under-a-file": (_flags(*BASE_ARGS, "--budget", "100MB", "-o", "out.yaml/plan.yaml"), PLAN,
                            "is not a folder"),
    "output-missing-folder": (_flags(*BASE_ARGS, "-o", "missing/plan.yaml"), PLAN, "does not exist"),
    "output-a-folder": (_flags(*BASE_ARGS, "-o", "ckpt"), PLAN, "is a folder"),
    "prefetch-step-zero": (_flags(*BASE_ARGS, "--prefetch-step", "0"), USAGE, "--prefetch-step 0"),
    "group-size-huge": (_flags(*BASE_ARGS, "--group-size", "9" * 30), USAGE, "--group-size"),
    "context-huge": (_flags(*BASE_ARGS, "--context", "9" * 30), USAGE, "context at most"),
    "export-tp-huge": (_flags("export", "plan.yaml", "--to", "vllm", "--tp", "9" * 30), USAGE, "--tp"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fuzz_regression(name):
    build, exit_code, fragment = CASES[name]
    args, files = build()
    with tempfile.TemporaryDirectory(prefix="fuzz-regression-") as root:
        result = run_case(Case(family="regression", mutation=name, args=args, invalid=True, files=files), Path(root),
                          time_limit_s=5.0)
    assert result.verdict == "error", f"{result.verdict}: {result.detail} | {result.message}"
    assert any(text in result.message for text in ((fragment,) if isinstance(fragment, str) else fragment)), \
        result.message
    assert len(result.message) <= MAX_ERROR_LINE_CHARS, result.message
    assert result.elapsed_ms < 1000, f"refused, but only after {result.elapsed_ms:.0f} ms"


def test_exit_codes_match_error_classes():
    """One case per class, exit code checked (run_case only says 'error')."""
    from tests.fuzz.core import invoke_cli_in

    for name in ("header-overlap", "plan-alias-bomb", "profile-zero-fp8", "prefetch-step-zero"):
        build, exit_code, _ = CASES[name]
        args, files = build()
        with tempfile.TemporaryDirectory() as folder:
            code, _, stderr, exception = invoke_cli_in(Path(folder), base().files() | files, args)
        assert exception is None and code == exit_code, (name, code, stderr)


def test_shard_header_struct_prefix_of_zero_is_refused():
    args, files = _make(**{SHARD: struct.pack("<Q", 0) + b"{}"})
    with tempfile.TemporaryDirectory() as root:
        result = run_case(Case(family="regression", mutation="zero", args=args, invalid=True, files=files), Path(root))
    assert result.verdict == "error" and "not plausible" in result.message
