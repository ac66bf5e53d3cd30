"""``offload-plan trace``: record a MoE model's routing on the user's prompts, for ``make --routing-trace``."""

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from offload_plan import runtime_seam
from offload_plan.console import say


def trace(
    model: Annotated[str, typer.Option("--model", "-m", help="Checkpoint folder with weights and a tokenizer.")],
    prompts: Annotated[Path, typer.Option("--prompts", help="Text file, one prompt a line.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the trace here (default: stdout).")]
    = None,
    device: Annotated[Optional[str], typer.Option(
        help="Where the model runs: cuda or cpu (default: cuda when present).")] = None,
):
    """Record per-layer expert routing counts of a MoE model on your prompts (prefill), on the local GPU or CPU.

    Example: offload-plan trace --model ./qwen3-30b-a3b --prompts prompts.txt -o trace.yaml
    """
    from planner.plan_file import write_atomic
    from planner.routing_trace import render_trace

    recorded = runtime_seam.record_routing_trace(model, prompts, device)
    words = ["offload-plan", "trace", "--model", model, "--prompts", str(prompts)]
    words += ["--device", device] if device else []
    text = render_trace(recorded, shlex.join(words + (["-o", str(output)] if output else [])))
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
    where = f"wrote {output}: " if output else ""
    say(f"{where}{recorded.num_tokens} tokens routed through {len(recorded.layers)} MoE layers (top-{recorded.top_k} "
        f"of {recorded.num_experts} experts); plan with it: offload-plan make ... --routing-trace "
        f"{output or 'TRACE.yaml'}")
