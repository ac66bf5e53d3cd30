"""``offload-plan export``: the vLLM or SGLang flags that run a plan, its prediction restated."""

import dataclasses
import json
import sys
from typing import Annotated

import typer

from offload_plan.console import say, warn
from offload_plan.options import JsonOption, PlanArgument


def export(
    plan: PlanArgument,
    to: Annotated[str, typer.Option("--to", help="The engine: vllm or sglang.")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size the engine runs with.")] = 1,
    engine_version: Annotated[str | None, typer.Option(
        "--engine-version",
        help="The engine release the flags are for (default: the newest offload-plan pins: vllm 0.33.0, "
             "sglang 0.5.23).")] = None,
    exact: Annotated[bool, typer.Option(
        "--exact",
        help="Fail instead of approximating what the engine cannot say.")] = False,
    explain: Annotated[bool, typer.Option(
        "--explain",
        help="Print the flags, then what the engine cannot express of the plan and the predicted tokens/s it "
             "loses, on stdout.")] = False,
    json_output: JsonOption = False,
):
    """The engine flags that run a plan, its prediction restated.

    Example: vllm serve MODEL $(offload-plan export plan.yaml --to vllm)

    stdout holds the flags alone; what the engine cannot express and the loss go to stderr (stdout with --explain).
    """
    from planner.views.export import describe_prediction, export_plan
    from planner.plan.file import read_plan

    result = export_plan(read_plan(plan), to, tp_size=tp, exact=exact, version=engine_version)
    if json_output:
        sys.stdout.write(json.dumps(_export_data(result), indent=2) + "\n")
        return
    if result.flags:
        sys.stdout.write(result.command_fragment() + "\n")
    if explain:
        sys.stdout.write("".join(f"{loss}\n" for loss in result.losses)
                         or f"{result.engine} expresses the plan exactly: nothing lost\n")
    else:
        for loss in result.losses:
            say(f"offload-plan: loss: {loss}")
    for note in result.notes:
        say(f"offload-plan: note: {note}")
    for warning in result.warnings:
        warn(warning)
    say(f"{result.engine} {result.engine_version}: {describe_prediction(result)}")


def _export_data(result) -> dict:
    def rounded(prediction) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(prediction).items()}

    return {"engine": result.engine, "engine_version": result.engine_version, "tp_size": result.tp_size,
            "flags": list(result.flags),
            "command_fragment": result.command_fragment(), "prefetch_step": result.prefetch_step,
            "notes": list(result.notes), "warnings": list(result.warnings), "losses": list(result.losses),
            "prediction": {"plan": rounded(result.plan_prediction), "exported": rounded(result.prediction)}}
