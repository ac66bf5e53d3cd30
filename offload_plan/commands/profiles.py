"""``offload-plan profiles``: the built-in hardware profiles."""

import json
import sys

from rich.table import Table

from offload_plan.console import stdout
from offload_plan.options import JsonOption


def profiles(json_output: JsonOption = False):
    """List the built-in hardware profiles with their key figures.

    Example: offload-plan profiles
    """
    from planner.source.profile import list_profile_names, load_profile, profile_to_dict

    loaded = [load_profile(name) for name in list_profile_names()]
    if json_output:
        sys.stdout.write(json.dumps([profile_to_dict(p) for p in loaded], indent=2) + "\n")
        return
    table = Table(title="Hardware profiles (d = datasheet, m = measured, f = fitted, a = assumed)",
                  title_justify="left")
    for name in ("name", "GPU GiB", "HBM TB/s", "bf16 TFLOP/s", "H2D GB/s", "trigger", "description"):
        table.add_column(name, justify="left" if name in ("name", "description") else "right")
    for p in loaded:
        table.add_row(
            p.name,
            _with_source(p.gpu_memory_bytes, 2**30, ".1f"),
            _with_source(p.hbm_bytes_per_s, 1e12, ".2f"),
            _with_source(p.bf16_flops_per_s, 1e12, ".0f"),
            _with_source(p.h2d_bytes_per_s, 1e9, ".1f"),
            _with_source(p.trigger, 1, ".2f"),
            p.description,
        )
    stdout.print(table)


def _with_source(figure, scale: float, spec: str) -> str:
    return f"{figure.value / scale:{spec}} {figure.source[0]}"
