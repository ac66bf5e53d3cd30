"""Fuzz regressions, class: a path a command cannot read or write as asked. An output under a file, in a missing
folder, onto a folder or onto one of the command's own inputs; a path longer than the file system allows; a FIFO,
a device or a folder where a file belongs (a FIFO blocked make and check forever). Refused in one line, quickly,
with the guarded file left as it was.
"""

import pytest

from tests.fuzz import BASE_ARGS, GUARD_NAME
from tests.fuzz.adapters import adapter_files
from tests.fuzz.regression import Refusal, assert_refused, linked_profile, make_args, run_regression

LONG = "x" * 300
TRACE = ["trace", "--model", "ckpt", "--prompts", "prompts.txt"]
PROMPTS = {"prompts.txt": b"hello world\n"}

# name -> the refusal
CASES = {
    # issue 16: -o into a missing folder, onto a folder, under a file
    "output-under-a-file": Refusal([*BASE_ARGS, "--budget", "100MB", "-o", "out.yaml/plan.yaml"], {},
                                   "is not a folder"),
    "output-missing-folder": Refusal([*BASE_ARGS, "-o", "missing/plan.yaml"], {}, "does not exist"),
    "output-a-folder": Refusal([*BASE_ARGS, "-o", "ckpt"], {}, "is a folder"),
    # issue 25: paths longer than the file system allows
    "long-output": Refusal(make_args(output=f"{LONG}/{LONG}.yaml"), {}, "longer than the file system allows"),
    "long-model": Refusal([BASE_ARGS[0], "-m", LONG, "-g", "gpu.yaml"], {}, "longer than the file system allows"),
    "long-gpu": Refusal([BASE_ARGS[0], "-m", "ckpt", "-g", LONG], {}, "longer than the file system allows"),
    "long-adapter": Refusal(make_args("--adapter", f"a={LONG}"), {}, "longer than the file system allows"),
    "long-plan": Refusal(["show", LONG + ".yaml"], {}, "longer than the file system allows"),
    # issue 25: special files
    "fifo-gpu": Refusal(make_args(), {}, "not a pipe (FIFO)", special={"gpu.yaml": "fifo"}),
    "fifo-plan-check": Refusal(["check", "plan.yaml"], {}, "plan(s) fail check", special={"plan.yaml": "fifo"}),
    "fifo-shard": Refusal(make_args(), {}, "must be a regular file",
                          special={"ckpt/model-00001-of-00002.safetensors": "fifo"}),
    "fifo-config": Refusal(make_args(), {}, "must be a regular file", special={"ckpt/config.json": "fifo"}),
    "device-plan": Refusal(["show", "plan.yaml"], {}, "a device file", special={"plan.yaml": "dev-zero"}),
    "folder-adapter-config": Refusal(make_args("--adapter", "a=ad"), adapter_files(), "adapter_config.json",
                                     special={"ad/adapter_config.json": "folder"}),
    # issue 39: trace's output, checked before the model loads
    "trace-output-missing-folder": Refusal([*TRACE, "--device", "cpu", "-o", "missing/dir/t.yaml"], PROMPTS,
                                           "does not exist", moe=True),
    "trace-output-folder": Refusal([*TRACE, "--device", "cpu", "-o", "ckpt"], PROMPTS, "is a folder", moe=True),
    # issue 39: outputs that are inputs
    "make-o-trace": Refusal([*BASE_ARGS, "--routing-trace", GUARD_NAME, "-o", GUARD_NAME], {}, "--routing-trace"),
    "make-o-config": Refusal([*BASE_ARGS, "-o", "ckpt/config.json"], {}, "--model"),
    "make-o-shard": Refusal([*BASE_ARGS, "-o", "ckpt/model-00001-of-00002.safetensors"], {}, "--model"),
    "make-o-profile": Refusal([*BASE_ARGS, "-o", "gpu.yaml"], {}, "--gpu"),
    "make-tp-o-profile": Refusal([BASE_ARGS[0], "-m", "ckpt", "-g", "p.tp4.yaml", "--tp", "2,4", "-o", "p.yaml"],
                                 {"p.tp4.yaml": linked_profile()["gpu.yaml"]}, "--gpu p.tp4.yaml"),
    "trace-o-prompts": Refusal([*TRACE, "-o", "prompts.txt"], PROMPTS, "--prompts", moe=True),
    # issue 39: make --model config.json points to header-checkpoint
    "make-model-config-json": Refusal([BASE_ARGS[0], "-m", "ckpt/config.json", "-g", "gpu.yaml"], {},
                                      "header-checkpoint"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_path_refused(name):
    assert_refused(name, CASES[name])


def test_fifo_never_hangs():
    for args, special in ((["show", "plan.yaml"], {"plan.yaml": "fifo"}), (make_args(), {"gpu.yaml": "link-to-fifo"}),
                          (["diff", "plan.yaml", "graph-plan.yaml"], {"graph-plan.yaml": "fifo"})):
        result = run_regression("fifo", args, special=special)
        assert result.verdict == "error" and result.elapsed_ms < 1000, (args, result)
