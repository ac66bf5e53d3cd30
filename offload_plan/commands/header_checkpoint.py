"""``offload-plan header-checkpoint``: a checkpoint with a real model's tensor names, dtypes and shapes, and no
weights (sparse shards), to plan a model without downloading it."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from offload_plan import runtime_seam
from offload_plan.console import say


def header_checkpoint(
    config: Annotated[Path, typer.Argument(help="The model's config.json.")],
    output: Annotated[Path, typer.Argument(help="Folder to write: new, empty, or one this command wrote before.")],
    dtype: Annotated[Optional[str], typer.Option(
        help="Tensor dtype: bfloat16, float16 or float32 (default: the config's).")] = None,
):
    """Write a header-only checkpoint of a config.json's model: tensor names, dtypes and shapes, no weights.

    Example: offload-plan header-checkpoint examples/llama-3.1-70b/config.json /tmp/llama-3.1-70b
    """
    from planner.units import format_bytes

    written = runtime_seam.write_header_checkpoint(config, output, dtype)
    say(f"wrote {written.folder}: {written.num_tensors} tensors in {written.num_shards} shard(s), "
        f"{format_bytes(written.tensor_bytes)} declared, none stored")
