"""runtime.cpu_doorbell's host side: the C kernel's doorbell thread runs the step whose key the GPU writes and
answers in the done word, as the GPU's ring and wait kernels expect (those run on a GPU only:
tests/runtime/test_cpu_handoff_gpu.py). Here this process plays the GPU, writing and polling the same words.

CPU only; it builds the kernel with the machine's C compiler (skipped where there is none).
"""

import shutil
import time

import pytest
import torch

from runtime import cpu_doorbell, cpu_kernel

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFLOAD_PLAN_CACHE", str(tmp_path))
    monkeypatch.delenv("OFFLOAD_PLAN_CPU_KERNEL", raising=False)
    cpu_kernel.reset_kernel()
    loaded = cpu_kernel.load_kernel()
    assert loaded is not None, cpu_kernel.kernel_refusal()
    yield loaded
    cpu_kernel.reset_kernel()


def _step(kernel, num_tokens: int, top_k: int, generator):
    """A HostStep over fresh buffers holding one step's inputs, and the partial_sum it should write."""
    hidden_size, intermediate, num_experts = 64, 24, 6
    gate_up = torch.randn(3, 2 * intermediate, hidden_size, generator=generator) * hidden_size ** -0.5
    down = torch.randn(3, hidden_size, intermediate, generator=generator) * intermediate ** -0.5
    local = torch.tensor([0, -1, 1, -1, 2, -1])
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    expected = torch.empty(num_tokens, hidden_size)
    cpu_kernel.partial_sum(kernel, gate_up, down, local, hidden, index, weights, expected, 1)
    floats, ints = cpu_kernel.scratch_sizes(index.numel(), hidden_size, intermediate)
    out = torch.full((num_tokens, hidden_size), float("nan"))
    step = cpu_kernel.HostStep(kernel, gate_up, down, local, hidden=hidden, index=index.reshape(-1).clone(),
                               weights=weights.reshape(-1).clone(), out=out, scratch=torch.empty(floats),
                               pairs=torch.empty(ints, dtype=torch.int64), num_threads=1)
    return step, out, expected


def _ring_and_wait(flags: torch.Tensor, key: int, timeout_s: float = 10.0) -> None:
    """What the GPU's kernels do: write the key, poll the done word, clear it."""
    flags[0] = key
    deadline = time.monotonic() + timeout_s
    while int(flags[1]) == 0:
        assert time.monotonic() < deadline, "the doorbell thread did not answer"
        time.sleep(1e-5)
    flags[1] = 0


def test_the_doorbell_thread_runs_each_rung_step_and_answers(kernel):
    generator = torch.Generator().manual_seed(0)
    flags = torch.zeros(cpu_doorbell.FLAGS_WORDS, dtype=torch.int32)
    doorbell = cpu_doorbell.Doorbell(kernel, flags)
    try:
        steps = [_step(kernel, num_tokens, 2, generator) for num_tokens in (1, 3)]
        keys = [doorbell.key(step) for step, _, _ in steps]
        assert keys == [1, 2] and doorbell.key(steps[0][0]) == 1  # one key per step, kept
        for _ in range(3):  # each step rung twice over, in turn, as layers and replays ring them
            for (step, out, expected), key in zip(steps, keys):
                out.fill_(float("nan"))
                _ring_and_wait(flags, key)
                assert torch.equal(out, expected)
                assert int(flags[0]) == 0  # the thread cleared the key before it computed
        assert doorbell.steps_run == 6 and not doorbell.timed_out
        assert [step.counters()["calls"] for step, _, _ in steps] == [3, 3]
        # after a sleep past the thread's spin, it still answers (from its sleeping polls)
        time.sleep(2 * cpu_doorbell.IDLE_SPIN_NS / 1e9)
        _ring_and_wait(flags, keys[1])
        assert doorbell.steps_run == 7
    finally:
        doorbell.close()
    flags[0] = keys[0]  # a stopped thread runs nothing
    time.sleep(0.05)
    assert int(flags[1]) == 0 and doorbell.steps_run == 7


def test_an_unregistered_key_is_left_alone(kernel):
    flags = torch.zeros(cpu_doorbell.FLAGS_WORDS, dtype=torch.int32)
    doorbell = cpu_doorbell.Doorbell(kernel, flags)
    try:
        flags[0] = 5  # no step 5: the thread must not read past its table's entries
        time.sleep(0.05)
        assert int(flags[1]) == 0 and doorbell.steps_run == 0
    finally:
        doorbell.close()


def test_a_doorbell_dropped_unclosed_stops_its_thread(kernel):
    """A runtime dropped without close: collecting the doorbell joins its thread before the memory it polls can go
    (else the thread reads freed memory)."""
    import gc

    flags = torch.zeros(cpu_doorbell.FLAGS_WORDS, dtype=torch.int32)
    doorbell = cpu_doorbell.Doorbell(kernel, flags)
    stopper = doorbell._stop
    assert stopper.alive
    del doorbell
    gc.collect()
    assert not stopper.alive
