"""make over every decoder architecture the installed transformers ships as a config class (tests.config_classes):
a weights-only plan and a serving plan, each read back by show, export (vLLM and SGLang), check and diff; or make
refuses in one line. Configs are written as the classes write them (no dtype), checkpoints header-only
(runtime.header_checkpoint), so every class costs a meta-device build and a few in-process commands.

    PYTHONPATH=. python3 -m tests.planner.test_make_config_classes   # the outcome of each class, one line each
"""

import sys
from pathlib import Path

import pytest

from tests.conftest import ERROR_PREFIX, MAX_ERROR_LINE_CHARS, invoke

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.config_classes import causal_lm_model_types, tiny_config, written  # noqa: E402

GPU = "h100-sxm"
#: the serving plan of the issue's reproduction (issue 36): 4 sequences of 2,048 tokens in 8 GiB
SERVING = ["--concurrency", "4", "--gpu-memory", "8GiB"]
SERVING_CONTEXT = 2048
#: make's exit code for a model it cannot plan (planner.errors.ModelInputError)
MODEL_INPUT_EXIT = 2


class NotBuilt(Exception):
    """transformers builds no model from the class's own config (at any size tests.config_classes tries)."""


def _write_checkpoint(model_type: str, folder: Path) -> dict:
    """The tiny config.json and a header-only checkpoint of its model in ``folder``; the config as written. The
    tensors are the meta-device model's (as header-checkpoint lists them), from the config object itself: some
    classes do not read back what they write (a float infinity, a per-layer list)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from planner.source.header_checkpoint import dtype_for, write_checkpoint_folder

    built = []

    def build(config) -> None:
        with torch.device("meta"):
            built.append(AutoModelForCausalLM.from_config(config))

    try:
        config = tiny_config(model_type, build=build)
        text = written(config)
    except Exception as error:  # noqa: BLE001 - transformers' own refusal, whatever its type
        raise NotBuilt(f"transformers builds no {model_type} model from its config class: "
                       f"{type(error).__name__}: {str(error)[:160]}") from None
    model = built[-1]
    tied = getattr(config, "tie_word_embeddings", False)
    specs = sorted((name, dtype_for("bfloat16"), list(tensor.shape)) for name, tensor in model.state_dict().items()
                   if not (tied and name == "lm_head.weight"))
    source = folder.parent / f"{folder.name}-config" / "config.json"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(json.dumps(text, indent=1))
    write_checkpoint_folder(config_path=source, specs=specs, out_dir=folder)
    return text


def _one_line_refusal(result) -> str:
    """make's refusal: model-input exit, one error line, no traceback; the line."""
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not line.startswith("offload-plan: warning:")]
    assert result.exit_code == MODEL_INPUT_EXIT, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), result.stderr
    assert len(lines[0]) <= MAX_ERROR_LINE_CHARS and "Traceback" not in result.stderr
    return lines[0]


def _context(config: dict) -> int:
    """The serving context: SERVING_CONTEXT, or the model's positions where they are fewer."""
    from planner.model.model_config import model_config

    limit = model_config(config).context
    return SERVING_CONTEXT if limit is None else min(SERVING_CONTEXT, limit.max_tokens)


def _read_back(plan: str) -> None:
    """show, export to both engines and check take the plan (exit 0)."""
    for command in (["show", plan], ["export", plan, "--to", "vllm"], ["export", plan, "--to", "sglang"],
                    ["check", plan]):
        result = invoke(command, catch_exceptions=True)
        assert result.exit_code == 0, (command, result.stderr, result.exception)


def plan_and_read(model_type: str, folder: Path) -> dict[str, str]:
    """Make the weights-only and the serving plan of ``model_type``'s tiny checkpoint in ``folder`` (the working
    directory) and read each back; "planned" or make's refusal line for each, and "diff" where both were made."""
    config = _write_checkpoint(model_type, folder / "ckpt")
    outcomes, made = {}, []
    for name, args in (("plain", []), ("serving", [*SERVING, "--context", str(_context(config))])):
        result = invoke(["make", "--model", "ckpt", "--gpu", GPU, *args, "-o", f"{name}.yaml"], catch_exceptions=True)
        if result.exit_code != 0:
            outcomes[name] = _one_line_refusal(result)
            continue
        _read_back(f"{name}.yaml")
        outcomes[name] = "planned"
        made.append(f"{name}.yaml")
    if len(made) == 2:
        result = invoke(["diff", *made], catch_exceptions=True)
        assert result.exit_code == 0, result.stderr
    return outcomes


#: issue 36's architectures whose caches transformers builds as plain per-layer keys and values: their serving
#: plans were refused ("this architecture's cache is not modelled") and must be made
SERVED = ("phi3", "olmo2", "olmoe", "glm4_moe", "phimoe", "cohere", "starcoder2", "gpt2", "gpt_neox", "falcon",
          "bloom")


@pytest.mark.parametrize("model_type", causal_lm_model_types())
def test_every_plan_make_writes_is_read_by_every_reader(model_type, workdir):
    """Plain and serving: planned and read back by every reader, or refused in one line (the weights-only plan
    too where the layers themselves cannot be found)."""
    try:
        outcomes = plan_and_read(model_type, workdir)
    except NotBuilt as error:
        pytest.skip(str(error))
    if model_type in SERVED:
        assert outcomes == {"plain": "planned", "serving": "planned"}, outcomes


def main() -> None:
    """Print each class's outcome (the report of issue 36's item 3)."""
    import os
    import tempfile

    names = sys.argv[1:] or causal_lm_model_types()
    for model_type in names:
        with tempfile.TemporaryDirectory() as folder:
            os.chdir(folder)
            try:
                outcomes = plan_and_read(model_type, Path(folder))
                print(model_type, "|", outcomes["plain"], "|", outcomes["serving"], flush=True)
            except NotBuilt as error:
                print(model_type, "| not built |", error, flush=True)
            except (AssertionError, Exception) as error:  # noqa: BLE001 - the report names every failure
                print(model_type, "| FAILED", type(error).__name__, str(error)[:300].replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
