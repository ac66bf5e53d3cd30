"""make --tp: the GPU counts it is given (one, or several to compare), where each count's plan is written, and
what a plan of one rank refuses before the checkpoint is sharded (planner.model.tensor_parallel shards it)."""

from pathlib import Path

from planner.errors import UsageError
from planner.model.all_reduce import link_bytes_per_s
from planner.model.tensor_parallel import check_tp_size


def parse_tp_sizes(text: str | int) -> list[int]:
    """--tp N, or N,M,... to compare GPU counts: distinct sizes from 1 to MAX_TP_SIZE, in the order given."""
    words = str(text).split(",")
    if not all(word.strip().isdigit() for word in words):
        raise UsageError(f"--tp {str(text)[:40]!r} is not a GPU count; give a number such as 2, or sizes to compare "
                         "such as 2,4")
    sizes = [int(word) for word in words]
    for size in sizes:
        check_tp_size(size)
    if len(set(sizes)) != len(sizes):
        raise UsageError(f"--tp {text}: a size is given twice; give each GPU count once, e.g. 2,4")
    return sizes


def plan_path_for(output, size: int):
    """Where make --tp N,M writes the plan of ``size``: plan.yaml -> plan.tp2.yaml."""
    output = Path(output)
    suffix = output.suffix if output.suffix in (".yaml", ".yml") else ".yaml"
    stem = output.name[: -len(output.suffix)] if output.suffix in (".yaml", ".yml") else output.name
    return output.with_name(f"{stem}.tp{size}{suffix}")


def check_tp_inputs(inputs, profile) -> None:
    """--tp plans one rank from the checkpoint's headers: the profile must name its GPU link, and LoRA adapters,
    whose shards are not modelled, are refused. --measure times the rank's own layers (rank_config's shapes)."""
    check_tp_size(inputs.tp)
    if inputs.tp == 1:
        return
    link_bytes_per_s(profile, inputs.tp)
    if inputs.adapters:
        raise UsageError(f"--adapter with --tp {inputs.tp} is not planned yet (LoRA shards per rank are not "
                         "modelled); drop --adapter or plan with --tp 1")
