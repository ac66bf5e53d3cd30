"""Every bad input: one line on stderr starting with "offload-plan: error:", a non-zero exit (the error
class's code), no traceback, and an existing output file left exactly as it was, with no temporary files.

Every case runs in-process (fast; an uncaught exception fails the test), and one case of each error class
also runs the real CLI in a subprocess, where a traceback shows up exactly as a user would see it.
"""

import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from tests.conftest import (
    TEST_GPU,
    assert_one_line_error,
    make_checkpoint,
    run,
    run_cli,
    write_safetensors,
)
from tests.helpers import gpu_profile, write_profile

# Exit codes of planner.errors, written out so a change is deliberate.
MODEL, PROFILE, PLAN, INFEASIBLE, USAGE = 2, 3, 4, 5, 6


def _shard(workdir) -> Path:
    return workdir / "ckpt" / "model-00001-of-00002.safetensors"


def _corrupt_shard(workdir, payload: bytes) -> None:
    _shard(workdir).write_bytes(payload)


def _edit_index(workdir, edit) -> None:
    path = workdir / "ckpt" / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def _truncate(path: Path, num_bytes: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-num_bytes])


def _gap_checkpoint(workdir) -> None:
    """Drop every tensor of layer 2 from shard and index: the stack has a hole."""
    shutil.rmtree(workdir / "ckpt")
    written = make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=1)
    kept = {n: spec for n, spec in written.tensors.items() if not n.startswith("model.layers.2.")}
    write_safetensors(workdir / "ckpt" / written.shards[0], kept)
    _edit_index(workdir, lambda index: index.update(weight_map={n: written.shards[0] for n in kept}))


def _duplicate_tensor(workdir) -> None:
    """Put model.norm.weight in both shards' headers."""
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        path = workdir / "ckpt" / shard
        from planner.source.safetensors_header import read_header_json

        header = read_header_json(path)
        tensors = {n: (e["dtype"], tuple(e["shape"])) for n, e in header.items() if n != "__metadata__"}
        tensors["model.norm.weight"] = ("BF16", (64,))
        write_safetensors(path, tensors)


# id -> (setup(workdir) returning extra args or None, make args (after --model/--gpu defaults), exit code,
#        fragments the one line must contain)
MAKE_CASES = {
    # profiles
    "profile-missing-field": (lambda w: write_profile(w / "bad.yaml", gpu_profile(h2d_bytes_per_s=None)),
                              ["--gpu", "bad.yaml"], PROFILE, ["missing field(s) ['h2d_bytes_per_s']"]),
    "profile-bad-share": (
        lambda w: write_profile(w / "bad.yaml", gpu_profile(trigger={"value": 2, "source": "assumed"})),
        ["--gpu", "bad.yaml"], PROFILE, ["trigger must be a share"]),
    "profile-value-not-number": (
        lambda w: write_profile(w / "bad.yaml", gpu_profile(h2d_bytes_per_s={"value": "fast", "source": "measured"})),
        ["--gpu", "bad.yaml"], PROFILE, ["field h2d_bytes_per_s", "finite number"]),
    "profile-negative": (
        lambda w: write_profile(w / "bad.yaml", gpu_profile(copy_overhead_us={"value": -1, "source": "fitted"})),
        ["--gpu", "bad.yaml"], PROFILE, ["copy_overhead_us", "negative"]),
    "profile-bad-source": (
        lambda w: write_profile(w / "bad.yaml", gpu_profile(trigger={"value": 0.5, "source": "guessed"})),
        ["--gpu", "bad.yaml"], PROFILE, ["source must be one of"]),
    "profile-figure-not-mapping": (lambda w: write_profile(w / "bad.yaml", gpu_profile(trigger=0.5)),
                                   ["--gpu", "bad.yaml"], PROFILE, ["field trigger must be a mapping"]),
    "profile-unknown-field": (lambda w: write_profile(w / "bad.yaml", gpu_profile(colour="green")),
                              ["--gpu", "bad.yaml"], PROFILE, ["unknown field(s) ['colour']"]),
    "profile-reserve-too-big": (
        lambda w: write_profile(w / "bad.yaml",
                                gpu_profile(reserve_bytes={"value": 2_000_000_000, "source": "assumed"})),
        ["--gpu", "bad.yaml"], PROFILE, ["reserve_bytes must be less"]),
    "profile-not-mapping": (lambda w: write_profile(w / "bad.yaml", "- h100\n- 80GB\n"),
                            ["--gpu", "bad.yaml"], PROFILE, ["a profile is a YAML mapping"]),
    "profile-not-yaml": (lambda w: write_profile(w / "bad.yaml", "name: [unclosed\n"),
                         ["--gpu", "bad.yaml"], PROFILE, ["not valid YAML"]),
    "profile-binary": (lambda w: (w / "bad.yaml").write_bytes(b"\xff\xfe\x00garbage\xf7"),
                       ["--gpu", "bad.yaml"], PROFILE, ["bad.yaml"]),
    "profile-file-missing": (None, ["--gpu", "nope.yaml"], PROFILE, ["nope.yaml: cannot read profile"]),
    "unknown-gpu": (None, ["--gpu", "h999"], PROFILE, ["unknown GPU 'h999'", "h100-sxm"]),
    "unknown-gpu-close": (None, ["--gpu", "h100"], PROFILE,
                          ["unknown GPU 'h100'; did you mean h100-pcie or h100-sxm?"]),
    "unknown-gpu-typo": (None, ["--gpu", "h100-sxn"], PROFILE, ["unknown GPU 'h100-sxn'; did you mean h100-sxm?"]),
    "budget-no-unit": (None, ["--budget", "40"], USAGE, ["--budget 40 has no unit: did you mean 40GiB?"]),
    "budget-overflow": (None, ["--budget", "1e400GB"], USAGE, ["--budget 1e400GB is too large"]),
    # safetensors headers
    "header-garbage-json": (lambda w: _corrupt_shard(w, struct.pack("<Q", 16) + b"{not json at all"),
                            [], MODEL, ["not valid JSON"]),
    "header-not-object": (lambda w: _corrupt_shard(w, struct.pack("<Q", 8) + b"[1,2,3] "), [], MODEL,
                          ["not a JSON object"]),
    "header-length-huge": (lambda w: _corrupt_shard(w, struct.pack("<Q", 2**40) + b"{}"), [], MODEL,
                           ["header length 1099511627776 is not plausible"]),
    "header-past-end": (lambda w: _corrupt_shard(w, struct.pack("<Q", 4096) + b'{"a": 1}'), [], MODEL,
                        ["header says 4096 bytes but the file ends after 8"]),
    "file-shorter-than-8": (lambda w: _corrupt_shard(w, b"\x10\x00\x00"), [], MODEL,
                            ["file is 3 bytes, too short"]),
    "header-bad-dtype": (lambda w: _shard(w).write_bytes(_shard(w).read_bytes().replace(b'"BF16"', b'"BF99"')),
                         [], MODEL, ["unknown dtype 'BF99'"]),
    "truncated-shard": (lambda w: _truncate(_shard(w), 10), [], MODEL, ["truncated"]),
    # index and shards disagree
    "missing-shard": (lambda w: _shard(w).unlink(), [], MODEL, ["shard model-00001-of-00002.safetensors", "missing"]),
    "index-names-absent-tensor": (
        lambda w: _edit_index(w, lambda i: i["weight_map"].update({"model.layers.0.extra.weight": i["weight_map"][
            "model.norm.weight"]})),
        [], MODEL, ["'model.layers.0.extra.weight'", "does not have it"]),
    "index-not-json": (lambda w: (w / "ckpt" / "model.safetensors.index.json").write_text("{oops"), [], MODEL,
                       ["cannot read the index"]),
    "index-no-weight-map": (lambda w: (w / "ckpt" / "model.safetensors.index.json").write_text("{}"), [], MODEL,
                            ["no weight_map"]),
    "tensor-in-two-shards": (_duplicate_tensor, [], MODEL, ["'model.norm.weight' is in both"]),
    "layer-gap": (_gap_checkpoint, [], MODEL, ["layer indices are not 0..2", "missing [2]"]),
    "config-not-json": (lambda w: (w / "ckpt" / "config.json").write_text("{,}"), [], MODEL,
                        ["config.json: not valid JSON"]),
    "no-layer-stack": (lambda w: write_safetensors(w / "flat.safetensors", {"weight": ("F32", (4, 4))}),
                       ["--model", "flat.safetensors"], MODEL, ["no repeated layer stack"]),
    # budgets and flags
    "budget-nothing-fits": (None, ["--budget", "1KB"], INFEASIBLE,
                            ["no plan fits", "need 158208 bytes", "the budget is 1000 bytes"]),
    "budget-above-gpu": (None, ["--budget", "2GB"], USAGE, ["exceeds test-gpu's", "use --budget 858MiB or less"]),
    "budget-and-trigger": (None, ["--budget", "1GB", "--trigger", "0.5"], USAGE, ["not both"]),
    "trigger-not-share": (None, ["--trigger", "1.5"], USAGE, ["--trigger 1.5 is not a share"]),
    "budget-unreadable": (None, ["--budget", "lots"], USAGE, ["--budget 'lots': cannot read it as a size"]),
    "params-match-nothing": (None, ["--params", "expert", "--budget", "100KB"], USAGE,
                             ["--params expert matches no param"]),
    "stack-unknown": (None, ["--stack", "model.blocks"], MODEL, ["--stack 'model.blocks' is not a layer stack"]),
    "tokens-zero": (None, ["--tokens", "0"], USAGE, ["workload:"]),
    "tokens-not-multiple": (None, ["--tokens", "100", "--sequences", "3"], USAGE, ["multiple of sequences"]),
    "pinned-impossible": (None, ["--group-size", "2", "--num-in-group", "1", "--prefetch-step", "2"], INFEASIBLE,
                          ["pinned knobs"]),
    "host-memory-too-small": (None, ["--budget", "300KB", "--host-memory", "10KB"], INFEASIBLE,
                              ["of host memory but --host-memory allows 10000 bytes", "raise --budget"]),
    "host-memory-unreadable": (None, ["--host-memory", "lots"], USAGE,
                               ["--host-memory 'lots': cannot read it as a size"]),
    "path-not-there-not-repo": (None, ["--model", "no/such/folder"], MODEL,
                                ["'no/such/folder' is neither an existing path nor a Hugging Face repo id"]),
    "path-not-there-plain": (None, ["--model", "nosuchfolder"], MODEL, ["neither an existing path"]),
    "revision-on-local": (None, ["--revision", "main"], MODEL, ["--revision applies to hub repo ids"]),
}


def _snapshot(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


# One case per error class (and the hub-less path check) also runs as a real process.
SUBPROCESS_MAKE_CASES = ["profile-missing-field", "unknown-gpu", "header-length-huge", "missing-shard",
                         "budget-nothing-fits", "budget-and-trigger", "path-not-there-not-repo"]
SUBPROCESS_SHOW_CASES = ["not-yaml", "missing-section", "int-as-string"]


def _both(cases, subset):
    return [pytest.param(c, False, id=c) for c in cases] + [pytest.param(c, True, id=f"{c}-subprocess")
                                                          for c in subset]


@pytest.mark.parametrize("case, subprocess", _both(MAKE_CASES, SUBPROCESS_MAKE_CASES))
def test_make_bad_input(workdir, good_plan, case, subprocess):
    setup, args, code, fragments = MAKE_CASES[case]
    if setup is not None:
        setup(workdir)
    before = _snapshot(workdir)
    command = ["make", "--model", "ckpt", "--gpu", TEST_GPU, *args, "-o", "out.yaml"]
    # later options win in click: --model/--gpu given again in args replace the defaults
    proc = run(command, workdir, in_process=not subprocess)
    line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, tuple(fragments))
    assert proc.returncode == code, line
    assert proc.stdout == ""
    assert (workdir / "out.yaml").read_bytes() == good_plan, "a failed make changed the existing output"
    assert _snapshot(workdir) == before, "a failed make left files behind"


# ---- show ---------------------------------------------------------------------------------------------------------


def _plan_edit(edit):
    def setup(workdir):
        data = yaml.safe_load((workdir / "out.yaml").read_text())
        edit(data)
        (workdir / "bad-plan.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return setup


def _raw(text: bytes):
    return lambda w: (w / "bad-plan.yaml").write_bytes(text)


SHOW_CASES = {
    "not-yaml": (_raw(b"schema_version: [1\nmodel: {"), ["not valid YAML"]),
    "binary": (_raw(b"\x00\xff\xfe\xf7 not text"), ["not valid YAML"]),
    "empty": (_raw(b""), ["not a plan (expected a mapping)"]),
    "a-list": (_raw(b"- 1\n- 2\n"), ["not a plan (expected a mapping)"]),
    "missing-section": (_plan_edit(lambda d: d.pop("prediction")), ["plan keys differ", "'prediction'"]),
    "extra-section": (_plan_edit(lambda d: d.update(notes="hi")), ["plan keys differ", "'notes'"]),
    "missing-key": (_plan_edit(lambda d: d["memory"].pop("gpu_bytes")), ["memory: keys ['gpu_bytes']"]),
    "schema-version": (_plan_edit(lambda d: d.update(schema_version=3)), ["schema_version 3 is not one of 1, 2"]),
    "selected-above-bytes": (_plan_edit(lambda d: d["layers"][0].update(selected_bytes=d["layers"][0]["bytes"] + 1)),
                             ["offloaded_bytes <= selected_bytes <= bytes"]),
    "int-as-string": (_plan_edit(lambda d: d["model"].update(num_layers="four")),
                      ["model.num_layers must be int, got 'four'"]),
    "float-as-string": (_plan_edit(lambda d: d["prediction"].update(step_ms="fast")),
                        ["prediction.step_ms must be float"]),
    "int-as-float": (_plan_edit(lambda d: d["memory"].update(gpu_bytes=1.5)), ["memory.gpu_bytes must be int"]),
    "bool-as-int": (_plan_edit(lambda d: d["offload"].update(prefetch_step=True)),
                    ["offload.prefetch_step must be int"]),
    "null-not-allowed": (_plan_edit(lambda d: d["model"].update(fingerprint=None)),
                         ["model.fingerprint must not be null"]),
    "list-of-wrong-type": (_plan_edit(lambda d: d["offload"].update(layers=["a"])),
                           ["offload.layers must be a list of int"]),
    "section-not-mapping": (_plan_edit(lambda d: d.update(memory=[1, 2])), ["memory must be a mapping"]),
    "layers-not-list": (_plan_edit(lambda d: d.update(layers={"a": 1})), ["layers must be a list"]),
    "row-wrong-type": (_plan_edit(lambda d: d["layers"][1].update(compute_ms="x")),
                       ["layers[1].compute_ms must be float"]),
    "layers-unsorted": (_plan_edit(lambda d: d["offload"].update(layers=[3, 1], prefetch_step=1, group_size=4)),
                        ["ascending"]),
    "layer-beyond-model": (_plan_edit(lambda d: d["offload"].update(layers=[9], prefetch_step=1, group_size=4)),
                           ["beyond model.num_layers"]),
    "row-count": (_plan_edit(lambda d: d["layers"].pop()), ["one row per planned layer"]),
    "replay-start-copies-eager": (_plan_edit(lambda d: d["offload"].update(layers=[1, 3], prefetch_step=1, group_size=2,
                                                                            replay_start_copies=1)),
                                  ["replay_start_copies applies to CUDA-graph plans"]),
    "replay-start-copies-over-depth": (_plan_edit(lambda d: d["offload"].update(layers=[1, 3], prefetch_step=1,
                                                                                 group_size=2, replay_start_copies=2)),
                                       ["replay_start_copies must be between 0 and prefetch_step"]),
    "file-missing": (None, ["cannot read plan"]),
}


@pytest.mark.parametrize("case, subprocess", _both(SHOW_CASES, SUBPROCESS_SHOW_CASES))
def test_show_bad_plan(workdir, good_plan, case, subprocess):
    setup, fragments = SHOW_CASES[case]
    if setup is not None:
        setup(workdir)
    for extra in ([], ["--json"]):
        proc = run(["show", "bad-plan.yaml", *extra], workdir, in_process=not subprocess)
        line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, ("bad-plan.yaml", *fragments))
        assert proc.returncode == PLAN, line
        assert proc.stdout == ""


def test_show_good_plan_exits_zero(workdir, good_plan):
    proc = run_cli(["show", "out.yaml"], cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr


# ---- defects found in review, fixed: these keep them fixed ---------------------------------------------------


def test_show_row_index_out_of_range_is_one_line_error(workdir, good_plan):
    _plan_edit(lambda d: d["layers"][3].update(index=99))(workdir)
    proc = run_cli(["show", "bad-plan.yaml"], cwd=workdir)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout)
