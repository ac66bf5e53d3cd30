"""``offload-plan calibrate``: measure the local GPU and write a profile."""

import sys

from offload_plan import runtime_seam
from offload_plan.console import say
from offload_plan.options import OutputOption
from planner.source.outputs import check_output
from planner.plan.file import write_atomic


def calibrate(output: OutputOption = None):
    """Measure the local GPU and write a profile for --gpu FILE.

    Example: offload-plan calibrate -o my-h100.yaml
    """
    check_output(output, [])  # before minutes of measuring
    profile, text, details = runtime_seam.calibrate()
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text)
    say(f"{profile.name}: H2D {profile.h2d_bytes_per_s.value / 1e9:.1f} GB/s + {profile.copy_overhead_us.value:.1f} us "
        f"per copy, HBM {profile.hbm_bytes_per_s.value / 1e12:.2f} TB/s, "
        f"bf16 {profile.bf16_flops_per_s.value / 1e12:.0f} TFLOP/s, "
        f"memory {profile.gpu_memory_bytes.value / 2**30:.1f} GiB")
    for num_bytes, ms in details["h2d_points_bytes_ms"]:
        say(f"  H2D {num_bytes / 2**20:7.0f} MiB: {ms:8.3f} ms, {num_bytes / ms / 1e6:6.1f} GB/s")
    for dtype, table in details.get("cpu_experts_ms", {}).items():
        say(f"  CPU expert {dtype}, {profile.cpu_experts.threads} threads: "
            + ", ".join(f"{tokens} tok {ms:.3f} ms" for tokens, ms in table.items()))
