"""LoRA adapters served from GPU slots (runtime.adapters) on the CPU stand-in: outputs equal PEFT's, for both
ways of serving a stream, and the copies obey the slots' readers."""

import copy

import pytest
import torch

from planner.search.adapter_stream import BLOCKING, PIPELINED, schedule_stream
from planner.errors import ModelInputError
from runtime.adapters import AdapterPool, LoraHooks, serve_stream
from runtime.backend import CpuStandIn
from tests.adapter_models import peft_logits, peft_reference, save_random_adapters

pytest.importorskip("peft")

NAMES = [f"a{k}" for k in range(5)]
BATCHES = [["a0", "a1", "a2", "a0", "a3"], ["a4", "a1", "a2", "a3"], ["a0", "a0"]]


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    folders = save_random_adapters(base, tmp_path_factory.mktemp("adapters"), NAMES, rank=8)
    return base, folders


def _served(base, folders, mode: str, num_slots: int):
    model = copy.deepcopy(base)
    backend = CpuStandIn(lazy_copies=True)  # a copy lands only when waited for: a missing wait shows
    pool = AdapterPool(model, list(folders.items()), num_slots, backend)
    hooks = LoraHooks(model, {pair.module for layout in pool.layouts.values() for pair in layout.pairs})
    schedule = schedule_stream(BATCHES, num_slots, mode)
    prompts = torch.randint(0, 128, (len(schedule.request_adapters), 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        served = serve_stream(model, pool, hooks, schedule, prompts)
    return served, schedule, prompts, pool


@pytest.mark.parametrize("mode", [BLOCKING, PIPELINED])
@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_stream_outputs_equal_peft(base_and_adapters, mode, num_slots):
    base, folders = base_and_adapters
    served, schedule, prompts, pool = _served(base, folders, mode, num_slots)
    reference = peft_reference(copy.deepcopy(base), folders)
    for forward in schedule.forwards:
        expected = peft_logits(reference, prompts[list(forward.requests)], list(forward.adapters))
        got = torch.stack([served.logits[r] for r in forward.requests])
        assert torch.equal(got, expected), (mode, num_slots, forward)
    # rows mixing adapters: a blocking wave of two or more, a pipelined wave's rest after its lead
    assert any(len(set(f.adapters)) > 1 for f in schedule.forwards) == (num_slots > (1 if mode == BLOCKING else 2))
    pool.close()
    assert not pool.backend.pinned


def test_outputs_differ_per_adapter(base_and_adapters):
    """The check above is not vacuous: each adapter changes the logits."""
    base, folders = base_and_adapters
    served, schedule, _, _ = _served(base, folders, PIPELINED, 2)
    first = {}
    for request, adapter in enumerate(schedule.request_adapters):
        first.setdefault(adapter, served.logits[request])
    assert len({tuple(v.float().tolist()[:8]) for v in first.values()}) == len(first)


def test_each_copy_waits_for_the_last_reader_of_its_slot(base_and_adapters):
    """In the stand-in's log, no copy into a slot comes before the slot's last reader finished (its end
    event), and every forward waits for its adapter's copy."""
    base, folders = base_and_adapters
    served, schedule, _, pool = _served(base, folders, PIPELINED, 1)
    log = pool.backend.log
    copies = [at for at, entry in enumerate(log) if entry[0] == "copy"]
    assert [log[at][1] for at in copies] == [f"adapter {ld.adapter} -> slot {ld.slot}" for ld in schedule.loads]
    for load, copy_at in zip(schedule.loads, copies):
        if load.after_forward is not None:
            assert ("copy-wait", f"forward-end-{load.after_forward}") in log[:copy_at]
    for index, forward in enumerate(schedule.forwards):
        start = log.index(("record", f"forward-start-{index}"))
        assert all(("compute-wait", f"adapter-{k}") in log[:start] for k in forward.waits)


def test_an_adapter_for_another_model_is_one_line(base_and_adapters, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    base, _ = base_and_adapters
    other = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=48,
                                                         num_hidden_layers=3, num_attention_heads=4,
                                                         num_key_value_heads=2, head_dim=8))
    folders = save_random_adapters(other, tmp_path, ["x"], rank=4)
    with pytest.raises(ModelInputError, match="do not fit"):
        AdapterPool(copy.deepcopy(base), list(folders.items()), 1, CpuStandIn())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [BLOCKING, PIPELINED])
def test_stream_on_the_gpu_equals_peft(base_and_adapters, mode):
    """The same stream on the GPU: copies on the copy stream, forwards waiting on their events."""
    from runtime.backend import CudaBackend

    base, folders = base_and_adapters
    model = copy.deepcopy(base).cuda()
    pool = AdapterPool(model, list(folders.items()), 2, CudaBackend(torch.device("cuda")))
    hooks = LoraHooks(model, {pair.module for layout in pool.layouts.values() for pair in layout.pairs})
    schedule = schedule_stream(BATCHES, 2, mode)
    prompts = torch.randint(0, 128, (len(schedule.request_adapters), 6)).cuda()
    with torch.inference_mode():
        served = serve_stream(model, pool, hooks, schedule, prompts)
    reference = peft_reference(copy.deepcopy(base).cuda(), folders)
    for forward in schedule.forwards:
        expected = peft_logits(reference, prompts[list(forward.requests)], list(forward.adapters))
        assert torch.equal(torch.stack([served.logits[r] for r in forward.requests]), expected), forward
    assert served.times.total_ms > 0 and all(t > 0 for t in served.times.ttft_ms)
    pool.close()


def test_an_adapter_neither_local_nor_cached_is_one_line(monkeypatch, tmp_path):
    from runtime.adapters import adapter_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelInputError, match="hf download org/sql-lora") as error:
        adapter_folder("org/sql-lora")
    assert "\n" not in str(error.value)
    assert adapter_folder(str(tmp_path)) == tmp_path  # a local folder comes back as it is


def test_slots_the_gpu_cannot_hold_are_one_line_with_nothing_pinned(base_and_adapters):
    """The slots are allocated before anything is read or pinned: their failure leaves the host untouched."""
    from planner.errors import RuntimeUnavailableError

    class NoRoom(CpuStandIn):
        def alloc_device(self, num_bytes):
            raise torch.OutOfMemoryError("CUDA out of memory")

    base, folders = base_and_adapters
    backend = NoRoom()
    with pytest.raises(RuntimeUnavailableError, match="of adapter slots; .*fewer --adapter-slots") as error:
        AdapterPool(copy.deepcopy(base), list(folders.items()), 2, backend)
    assert "\n" not in str(error.value) and not backend.pinned
