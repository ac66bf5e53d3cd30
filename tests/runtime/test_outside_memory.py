"""runtime.outside_memory: the refusal of a plan whose booking of the memory outside torch's allocator this stack
already passes (issue 36), on its arithmetic; the probe itself runs on the GPU (test_outside_memory_gpu)."""

from types import SimpleNamespace

import pytest

GIB = 2**30


def _memory(total_gib: float, booked_gib: float, gpu_gib: float) -> SimpleNamespace:
    return SimpleNamespace(total_gpu_bytes=int(total_gib * GIB), cuda_context_bytes=int(booked_gib * GIB),
                           gpu_memory_bytes=int(gpu_gib * GIB))


def test_a_stack_within_the_booking_runs():
    from runtime.outside_memory import stack_overrun

    assert stack_overrun(_memory(7.99, 1.0, 8.0), probe_bytes=int(0.75 * GIB), device_total_bytes=80 * GIB) is None


def test_a_stack_past_the_booking_runs_where_the_plan_has_room():
    """A weights-only plan that leaves half the GPU free keeps its promise whatever the context holds."""
    from runtime.outside_memory import stack_overrun

    assert stack_overrun(_memory(40.0, 1.0, 80.0), probe_bytes=int(1.5 * GIB), device_total_bytes=80 * GIB) is None


def test_a_stack_past_the_booking_of_a_full_plan_is_one_line():
    from runtime.outside_memory import stack_overrun

    refusal = stack_overrun(_memory(7.99, 1.0, 8.0), probe_bytes=int(1.5 * GIB), device_total_bytes=80 * GIB)
    assert refusal is not None and "\n" not in refusal and "--measure" in refusal and "1.50 GiB" in refusal


def test_the_smaller_of_the_plans_gpu_and_this_one_is_the_limit():
    """A plan made for an 80 GiB GPU run on a 40 GiB one: this GPU's memory is what it must fit."""
    from runtime.outside_memory import stack_overrun

    assert stack_overrun(_memory(39.5, 1.0, 80.0), probe_bytes=int(1.6 * GIB), device_total_bytes=40 * GIB)
    assert stack_overrun(_memory(39.5, 1.0, 80.0), probe_bytes=int(1.6 * GIB), device_total_bytes=80 * GIB) is None


@pytest.mark.gpu
def test_probe_counts_what_the_process_holds_outside_the_allocator():
    """The probe loads kernels and a graph: it holds more outside the allocator than the bare context, and a
    second probe adds next to nothing (the kernels are loaded once). In a fresh process: one that ran other GPU
    tests has those kernels loaded already."""
    import json
    import os
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    script = ("import json, torch\n"
              "from runtime.outside_memory import outside_allocator_bytes, probe_outside_allocator_bytes\n"
              "device = torch.device('cuda')\n"
              "torch.zeros(1, device=device)\n"
              "bare = outside_allocator_bytes(device)\n"
              "print(json.dumps([bare, probe_outside_allocator_bytes(device), "
              "probe_outside_allocator_bytes(device)]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-2000:]
    bare, first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first > bare and abs(second - first) <= 16 * 2**20
