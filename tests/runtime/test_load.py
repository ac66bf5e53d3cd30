"""run's loader on the CPU stand-in: the model streamed from its safetensors files equals from_pretrained's bit
for bit for every family the tests build, a plan offloading nothing pins nothing, and faults are one line."""

import os
from pathlib import Path

import pytest
import torch

from planner.errors import ModelInputError, PlanError, RuntimeUnavailableError
from runtime.backend import CpuStandIn, pin_error
from runtime.load import build_model
from tests.runtime.conftest import engine_pieces, FAMILIES, RefusesPiece, resident_plan
from tests.runtime_models import stream_on_cpu
from runtime.load_source import check_fingerprint, open_source
from tests.runtime_models import plan_with, save_tiny_llama, skeleton

pytest.importorskip("transformers")


def _ids():
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))


def _logits(model, calls=1):
    with torch.inference_mode():
        return [model(_ids()).logits for _ in range(calls)]


def _num_layers(folder: Path) -> int:
    import json

    return json.loads((folder / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_model_equals_from_pretrained_bit_for_bit(checkpoints, family):
    """Every family, offloading everything (one slot) and part of the stack (two slots), and with only the
    experts offloaded where there are experts: logits equal to from_pretrained's all-resident model."""
    folder = checkpoints(family)
    reference = _logits(build_model(str(folder), None))[0]
    num_layers = _num_layers(folder)
    plans = [plan_with(folder, 1, 1, 1), plan_with(folder, num_layers, 3, 2)]
    if "moe" in family or family == "mixtral":
        plans.append(plan_with(folder, 1, 1, 2, params=("experts",)))
    for plan in plans:
        assert plan.offload.layers
        model, engine = stream_on_cpu(folder, plan, lazy_copies=True)
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert all(torch.equal(out, reference) for out in _logits(model, 3)), plan.offload
        assert engine.host_bytes == sum(engine.layer_bytes)
        assert engine.backend.pinned == engine_pieces(engine)  # every layer's piece pinned, nothing else


def test_streamed_state_equals_from_pretrained_state(checkpoints):
    """Not only the logits: every param and buffer, by name (MoE: experts fused by transformers' converters)."""
    folder = checkpoints("qwen3-moe")
    reference = build_model(str(folder), None).state_dict()
    model, engine = stream_on_cpu(folder, plan_with(folder, 4, 3, 2, params=("experts",)))
    engine.remove_hooks()
    engine.backend.synchronize()
    streamed = model.state_dict()
    assert streamed.keys() == reference.keys()
    offloaded = {f"model.layers.{i}." for i in engine.offloaded}
    for name, tensor in reference.items():
        if any(name.startswith(prefix) and "experts" in name for prefix in offloaded):
            continue  # offloaded params point at a shared slot: checked through the logits above
        assert torch.equal(streamed[name], tensor), name


def test_a_plan_offloading_nothing_runs_resident_without_pinning_or_hooks(checkpoints):
    """The planner writes such a plan whenever everything fits; cudaHostRegister fails on an empty allocation,
    so the stand-in refuses to pin one (CpuStandIn.pin asserts)."""
    folder = checkpoints("llama")
    plan = resident_plan(folder)
    assert plan.offload.layers == ()
    backend = CpuStandIn()
    model, engine = stream_on_cpu(folder, plan, backend=backend)
    assert backend.pinned == {} and engine._host_allocation is None and engine._hooks == []
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert torch.equal(_logits(model)[0], _logits(build_model(str(folder), None))[0])
    assert engine.slots == [] and engine.copy_bytes_per_step == 0
    engine.close()


def test_progress_counts_every_byte_once(checkpoints):
    from planner.source.checkpoint import load_checkpoint
    from runtime.load import stream_model

    folder = checkpoints("moe")
    seen = []
    stream_model(folder, plan_with(folder, 3, 2, 1), CpuStandIn(), on_bytes=seen.append)
    assert sum(seen) == load_checkpoint(str(folder)).total_bytes


def test_reads_use_no_mmap(checkpoints, monkeypatch):
    """Mapped file pages count in the process's RSS: the loader reads with preadv only."""
    import mmap

    anonymous = mmap.mmap

    def refuse(fileno, *args, **kwargs):
        # the host arena is an anonymous mapping (runtime.host_pages: huge pages); a file's is refused
        if fileno != -1:
            raise AssertionError("the loader must not mmap the checkpoint")
        return anonymous(fileno, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refuse)
    folder = checkpoints("llama")
    stream_on_cpu(folder, plan_with(folder, 3, 2, 1))


# ---- faults: one line, nothing left pinned -------------------------------------------------------------------


def _copy_checkpoint(folder: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(folder, target)
    return target


def _largest_shard(folder: Path) -> Path:
    return max(folder.glob("*.safetensors"), key=lambda path: path.stat().st_size)


def test_a_shard_truncated_before_loading_is_refused_before_allocating(checkpoints, tmp_path):
    folder = _copy_checkpoint(checkpoints("llama"), tmp_path / "ckpt")
    plan = plan_with(folder, 3, 2, 1)
    shard = _largest_shard(folder)
    os.truncate(shard, shard.stat().st_size - 1000)
    backend = CpuStandIn()
    with pytest.raises(ModelInputError, match="truncated") as error:
        stream_on_cpu(folder, plan, backend=backend)
    assert "\n" not in str(error.value) and backend.pinned == {}


def test_a_shard_truncated_while_loading_is_one_line_and_unpins(checkpoints, tmp_path, monkeypatch):
    """The headers were fine when read; the file is cut before its bytes are: a short read, reported as such,
    and the host arena and the staging ring are unpinned."""
    import runtime.load as load

    folder = _copy_checkpoint(checkpoints("llama"), tmp_path / "ckpt")
    plan = plan_with(folder, 3, 2, 1)
    sources_of = load.sources_of

    def read_then_truncate(checkpoint, folder):
        sources = sources_of(checkpoint, folder)
        for path in {source.path for source in sources.values()}:
            os.truncate(path, 4096)
        return sources

    monkeypatch.setattr(load, "sources_of", read_then_truncate)
    backend = CpuStandIn()
    with pytest.raises(ModelInputError, match="ended .* bytes early") as error:
        stream_on_cpu(folder, plan, backend=backend)
    assert "\n" not in str(error.value) and backend.pinned == {}


def test_a_shard_replaced_with_other_shapes_is_refused(checkpoints, tmp_path):
    """A shard replaced after make: the fingerprint check refuses it, and the loader too if it slips past."""
    from runtime.load import stream_model

    folder = _copy_checkpoint(checkpoints("llama"), tmp_path / "ckpt")
    plan = plan_with(folder, 3, 2, 1)
    other = save_tiny_llama(tmp_path / "wider", hidden=32)
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    for path in other.iterdir():
        if path.name != "config.json":
            (folder / path.name).write_bytes(path.read_bytes())
    with pytest.raises(PlanError, match="fingerprint"):
        check_fingerprint(plan, open_source(plan, str(folder)))
    backend = CpuStandIn()
    with pytest.raises(ModelInputError, match="shape") as error:
        stream_model(folder, plan, backend)
    assert "\n" not in str(error.value) and backend.pinned == {}


class _PinRefused(CpuStandIn):
    """A host whose memlock limit refuses page-locking (cudaHostRegister's error 2, out of memory)."""

    def pin(self, tensor):
        raise pin_error(tensor.numel(), 2)


def test_memory_that_cannot_be_pinned_is_one_line(checkpoints):
    folder = checkpoints("llama")
    backend = _PinRefused()
    with pytest.raises(RuntimeUnavailableError, match="memlock limit is") as error:
        stream_on_cpu(folder, plan_with(folder, 3, 2, 1), backend=backend)
    assert "\n" not in str(error.value) and "ulimit -l" in str(error.value) and backend.pinned == {}


class _GpuFull(CpuStandIn):
    def alloc_device(self, num_bytes):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")


def test_out_of_device_memory_during_load_is_one_line(checkpoints):
    folder = checkpoints("llama")
    backend = _GpuFull()
    with pytest.raises(RuntimeUnavailableError, match="ran out of memory") as error:
        stream_on_cpu(folder, plan_with(folder, 3, 2, 1), backend=backend)
    assert "\n" not in str(error.value) and backend.pinned == {}


class _FailsAfterPinning(CpuStandIn):
    """Out of device memory on the staging copies, after the host arena was pinned."""

    def upload(self, destination, source):
        raise torch.OutOfMemoryError("CUDA out of memory")


def test_a_failure_after_pinning_unpins_everything(checkpoints, monkeypatch):
    folder = checkpoints("llama")
    backend = _FailsAfterPinning()
    monkeypatch.setattr(backend, "device", torch.device("meta"))  # resident bytes take the staging path
    monkeypatch.setattr(backend, "alloc_device", lambda n: torch.empty(n, dtype=torch.uint8))
    pins = []
    pin = CpuStandIn.pin
    monkeypatch.setattr(CpuStandIn, "pin", lambda self, t: pins.append(t.numel()) or pin(self, t))
    with pytest.raises(torch.OutOfMemoryError):
        stream_on_cpu(folder, plan_with(folder, 3, 2, 1), backend=backend)
    assert pins and backend.pinned == {}  # the staging ring (and any piece pinned meanwhile), all undone


def test_tensors_stored_in_another_dtype_are_cast_as_from_pretrained_casts_them(checkpoints, tmp_path):
    """fp32 files under a config that says bfloat16: from_pretrained(dtype="auto") builds bf16 params and casts
    each tensor; the streamed loader casts the same way (read, then .to), to the same bits. (Only a resident
    plan loads such a checkpoint: plans count the files' bytes, and check_selection refuses offloaded layers
    whose params hold fewer.)"""
    import json

    folder = _copy_checkpoint(checkpoints("llama"), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    reference = build_model(str(folder), None)
    assert next(reference.parameters()).dtype == torch.bfloat16
    model, _ = stream_on_cpu(folder, resident_plan(folder))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert torch.equal(_logits(model)[0], _logits(reference)[0])


def test_a_refused_staging_ring_starts_nothing_and_leaves_nothing_pinned(checkpoints, monkeypatch):
    """On a GPU the staging ring is pinned first: refused, the host arena's pin never starts."""
    import threading

    folder = checkpoints("llama")
    backend = _PinRefused()
    monkeypatch.setattr(backend, "device", torch.device("meta"))  # resident bytes take the staging path
    monkeypatch.setattr(backend, "alloc_device", lambda n: torch.empty(n, dtype=torch.uint8))
    with pytest.raises(RuntimeUnavailableError, match="memlock"):
        stream_on_cpu(folder, plan_with(folder, 3, 2, 1), backend=backend)
    assert backend.pinned == {} and not any(t.name == "offload-plan-pin" for t in threading.enumerate())


def test_a_quantized_checkpoint_is_refused_in_one_line(checkpoints, tmp_path):
    """A method run does not place (FP8 block-quantized checkpoints load: tests/runtime/test_quantized.py): refused,
    not run wrongly."""
    import json

    folder = _copy_checkpoint(checkpoints("llama"), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    backend = CpuStandIn()
    with pytest.raises(ModelInputError, match="quantization_config") as error:
        stream_on_cpu(folder, plan_with(checkpoints("llama"), 3, 2, 1), backend=backend)
    assert "\n" not in str(error.value) and backend.pinned == {}


# ---- the host arena, page-locked piece by piece -------------------------------------------------------------


class _SnapshotPins(CpuStandIn):
    """Keeps a copy of each range's bytes as they are when it is page-locked, and the order of events."""

    def __init__(self):
        super().__init__()
        self.at_pin = {}
        self.events = []

    def pin(self, tensor):
        self.at_pin[tensor.data_ptr()] = tensor.clone()
        self.events.append("pin")
        return super().pin(tensor)


def _slow_reads(monkeypatch, backend, delay_s=0.003):
    """Every read takes a little longer and is logged, so a piece pinned before its bytes land is caught."""
    import time

    import runtime.checkpoint_reader as checkpoint_reader

    read_exact = checkpoint_reader.read_exact

    def slow_read(fd, offset, target, path):
        time.sleep(delay_s)
        read_exact(fd, offset, target, path)
        backend.events.append("read")

    monkeypatch.setattr(checkpoint_reader, "read_exact", slow_read)


@pytest.mark.parametrize("family, shape, params", [("llama", (3, 2, 1), ()), ("qwen3-moe", (4, 3, 2), ()),
                                                   ("qwen3-moe", (1, 1, 2), ("experts",)),
                                                   ("mixtral", (2, 1, 1), ())])
def test_each_piece_is_pinned_once_all_its_bytes_are_in_place(checkpoints, monkeypatch, family, shape, params):
    """Direct tensors and converted groups (fused experts) alike: at its page-locking a piece already holds
    its final bytes (reads are slowed down, so a piece pinned early would not)."""
    folder = checkpoints(family)
    backend = _SnapshotPins()
    _slow_reads(monkeypatch, backend)
    model, engine = stream_on_cpu(folder, plan_with(folder, *shape, params=params), backend=backend)
    assert backend.pinned == engine_pieces(engine) and len(engine.host_buffers) >= 2
    for piece in engine.host_buffers:
        assert torch.equal(backend.at_pin[piece.data_ptr()], piece), "a piece was pinned before its bytes landed"
    reference = _logits(build_model(str(folder), None))[0]
    assert torch.equal(_logits(model)[0], reference)


def test_a_refused_piece_unpins_the_pieces_pinned_and_stops_the_reads(checkpoints, monkeypatch):
    import threading

    from runtime.stream_load import NUM_READERS

    folder = checkpoints("llama")
    backend = RefusesPiece(num_allowed=1)
    _slow_reads(monkeypatch, backend)
    with pytest.raises(RuntimeUnavailableError, match="memlock limit is") as error:
        stream_on_cpu(folder, plan_with(folder, 1, 1, 1), backend=backend)  # all 7 layers offloaded
    message = str(error.value)
    assert "\n" not in message and "ulimit -l" in message and "in 7 layers; this was layer 2" in message
    assert backend.pinned == {} and backend.events.count("pin") == 1  # the first piece, pinned then unpinned
    after_refusal = backend.events[backend.events.index("refused"):]
    assert after_refusal.count("read") <= 2 * NUM_READERS  # the reads running finished; ~40 queued never ran
    assert not any(t.name == "offload-plan-pin" for t in threading.enumerate())


def test_a_read_failing_after_pieces_were_pinned_unpins_them_all(checkpoints, monkeypatch):
    """The release undoes every piece pinned so far, not only the first or the arena's start: a read into the
    last layer's piece waits until two pieces are pinned, then fails."""
    import threading

    import runtime.checkpoint_reader as checkpoint_reader
    import runtime.placement as placement

    folder = checkpoints("llama")
    two_pinned = threading.Event()

    class PinsTwo(CpuStandIn):
        def pin(self, tensor):
            super().pin(tensor)
            if len(self.pinned) == 2:
                two_pinned.set()
            return tensor

    backend = PinsTwo()
    arenas = []
    allocate = placement.host_allocation_or_fail
    monkeypatch.setattr(placement, "host_allocation_or_fail", lambda n: arenas.append(allocate(n)) or arenas[-1])
    read_exact = checkpoint_reader.read_exact

    def fail_in_last_piece(fd, offset, target, path):
        host = arenas[0]
        end = host.data_ptr() + host.numel()
        # the last of 7 equal layers; bounded above too: the resident arena may lie at higher addresses
        if end - host.numel() // 7 <= target.data_ptr() < end:
            assert two_pinned.wait(30), "the first pieces were not pinned while the last one was read"
            raise ModelInputError("the disk went away")
        return read_exact(fd, offset, target, path)

    monkeypatch.setattr(checkpoint_reader, "read_exact", fail_in_last_piece)
    with pytest.raises(ModelInputError, match="went away"):
        stream_on_cpu(folder, plan_with(folder, 1, 1, 1), backend=backend)  # all 7 layers offloaded
    assert two_pinned.is_set() and backend.pinned == {}


def test_per_expert_tensors_land_in_the_fused_params_in_expert_order(tmp_path):
    """Twelve experts (names sort 0, 1, 10, 11, 2, ...): each per-expert tensor is read into its range of the
    fused param, gate before up, and the state equals from_pretrained's, param by param."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from runtime.checkpoint_reader import checkpoint_files, read_sources
    from runtime.skeleton import plan_reads
    from tests.runtime_models import save_random

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=12, num_experts_per_tok=2)
    folder = save_random(AutoModelForCausalLM.from_config(config), tmp_path / "moe12", seed=3)
    files = checkpoint_files(folder)
    work = plan_reads(skeleton(folder), read_sources(files))
    assert not work.converted and len(work.sliced) == 2 * 12 * 3
    reference = build_model(str(folder), None).state_dict()
    model, engine = stream_on_cpu(folder, resident_plan(folder))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    engine.close()


def test_a_group_that_does_not_tile_its_param_is_converted_by_transformers(checkpoints, monkeypatch):
    """A missing expert, or a conversion other than stack-then-concatenate, leaves the group to transformers'
    converter; that path still loads bit for bit."""
    import runtime.skeleton as skeleton
    from runtime.checkpoint_reader import SourceTensor
    from runtime.skeleton import fused_offsets

    class Merge:
        dim = 0

    Merge.__name__ = "MergeModulelist"

    class Converter:
        source_patterns = ["mlp.experts.*.down_proj.weight"]
        operations = [Merge()]

    def source(expert):
        name = f"model.layers.0.mlp.experts.{expert}.down_proj.weight"
        return SourceTensor(name=name, path=Path("x"), offset_bytes=0, num_bytes=32, dtype=torch.bfloat16,
                            shape=(4, 4))

    group = [source(e) for e in range(3)]
    patterns = {source(e).name: Converter.source_patterns[0] for e in range(4)}
    assert fused_offsets(group, patterns, Converter, (3, 4, 4), 2) == {s.name: 32 * e for e, s in enumerate(group)}
    assert fused_offsets(group[:2] + [source(3)], patterns, Converter, (3, 4, 4), 2) is None  # expert 2 missing
    assert fused_offsets(group, patterns, Converter, (4, 4, 4), 2) is None  # does not fill the param
    Converter.operations = [Merge(), Merge()]
    assert fused_offsets(group, patterns, Converter, (3, 4, 4), 2) is None

    monkeypatch.setattr(skeleton, "fused_offsets", lambda *args: None)
    folder = checkpoints("qwen3-moe")
    reference = _logits(build_model(str(folder), None))[0]
    model, engine = stream_on_cpu(folder, plan_with(folder, 4, 3, 2, params=("experts",)), lazy_copies=True)
    assert all(torch.equal(out, reference) for out in _logits(model, 3))
