"""``offload-plan trace``: record a MoE model's routing on the user's prompts, for ``make --routing-trace``."""

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from offload_plan import runtime_seam
from offload_plan.console import say
from planner.errors import UsageError, cut
from planner.source.outputs import check_output

#: the most greedy tokens a trace generates per prompt (a trace needs thousands of tokens in all, not millions)
MAX_DECODE_TOKENS = 65_536


def trace(
    model: Annotated[str, typer.Option("--model", "-m", help="Checkpoint folder with weights and a tokenizer.")],
    prompts: Annotated[Path, typer.Option("--prompts", help="Text file, one prompt a line.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the trace here (default: stdout).")]
    = None,
    device: Annotated[Optional[str], typer.Option(
        help="Where the model runs: cuda or cpu (default: cuda when present).")] = None,
    decode_tokens: Annotated[int, typer.Option(
        "--decode-tokens", help="Count the routing of this many greedy tokens generated after each prompt (the "
        "decode steps a plan serves) instead of the prompts' own tokens. 0: the prompts.")] = 0,
):
    """Record per-layer expert routing counts of a MoE model on your prompts, on the local GPU or CPU.

    Example: offload-plan trace --model ./qwen3-30b-a3b --prompts prompts.txt --decode-tokens 64 -o trace.yaml
    """
    from planner.plan.file import write_atomic
    from planner.source.routing_trace import render_trace

    if not 0 <= decode_tokens <= MAX_DECODE_TOKENS:
        raise UsageError(f"--decode-tokens {cut(str(decode_tokens))} is out of range; give 0 (count the prompts) to "
                         f"{MAX_DECODE_TOKENS} greedy tokens per prompt")
    check_output(output, [("--prompts", prompts), ("--model", model)])
    recorded = runtime_seam.record_routing_trace(model, prompts, device, decode_tokens)
    words = ["offload-plan", "trace", "--model", model, "--prompts", str(prompts)]
    words += ["--device", device] if device else []
    words += ["--decode-tokens", str(decode_tokens)] if decode_tokens else []
    text = render_trace(recorded, shlex.join(words + (["-o", str(output)] if output else [])))
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
    where = f"wrote {output}: " if output else ""
    say(f"{where}{recorded.num_tokens} tokens routed through {len(recorded.layers)} MoE layers (top-{recorded.top_k} "
        f"of {recorded.num_experts} experts); plan with it: offload-plan make ... --routing-trace "
        f"{output or 'TRACE.yaml'}")
