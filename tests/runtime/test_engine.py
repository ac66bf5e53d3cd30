"""The runtime's schedule on the CPU stand-in: outputs equal to the all-resident model for every plan shape."""

import shutil

import pytest
import torch

from planner.search.schedule import PrefetchSchedule
from runtime.load import build_model
from tests.runtime_models import apply_plan_on_cpu
from tests.runtime_models import PLAN_SHAPES, plan_with, save_tiny_llama, save_tiny_moe, with_replay_start_copies


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("moe"))


def _input_ids():
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))


def _logits(model, calls: int = 3):
    with torch.inference_mode():
        return [model(_input_ids()).logits for _ in range(calls)]


# Copies landing at once catch a copy issued before its slot's last reader ran; copies landing only when
# awaited catch a layer that reads its slot without waiting (runtime.backend)
LANDING = pytest.mark.parametrize("lazy", [False, True], ids=["copies-at-once", "copies-when-awaited"])


def _offloaded_equals_resident(checkpoint, plan, lazy=False):
    reference = _logits(build_model(str(checkpoint), None), 1)[0]
    model = build_model(str(checkpoint), None)
    engine = apply_plan_on_cpu(model, plan, lazy)
    outputs = _logits(model)  # three calls: prefetch wraps into the next forward
    return engine, all(torch.equal(out, reference) for out in outputs)


@LANDING
@pytest.mark.parametrize("shape", PLAN_SHAPES)
def test_dense_plan_shapes_equal_resident(llama, shape, lazy):
    plan = plan_with(llama, *shape)
    engine, equal = _offloaded_equals_resident(llama, plan, lazy)
    assert equal
    assert plan.offload.layers  # the plan really offloads
    # every step copies each layer whose slot it shares: preload + 3 calls
    schedule = PrefetchSchedule(len(plan.offload.layers), plan.offload.prefetch_step)
    per_step = sum(schedule.needs_copy(k) for k in range(len(plan.offload.layers)))
    assert engine.stats.num_copies == schedule.num_slots + 3 * per_step


@LANDING
@pytest.mark.parametrize("shape", [(1, 1, 2), (3, 2, 1), (7, 5, 3)])
@pytest.mark.parametrize("params", [(), ("experts",), ("self_attn", "mlp.gate")])
def test_moe_plan_shapes_and_selections_equal_resident(moe, shape, params, lazy):
    plan = plan_with(moe, *shape, params=params)
    _, equal = _offloaded_equals_resident(moe, plan, lazy)
    assert equal


def test_a_missing_wait_is_caught_when_copies_land_late(llama, monkeypatch):
    """Negative control for the copies-when-awaited stand-in: a layer that skips its wait reads the slot's
    previous contents, so outputs differ; with copies landing at once the same bug would pass unseen."""
    from runtime.engine import OffloadEngine

    plan = plan_with(llama, 3, 2, 1)  # 4 offloaded through 2 slots: every slot is reloaded each step
    waits = OffloadEngine._before_layer
    monkeypatch.setattr(OffloadEngine, "_before_layer", lambda self, p: None if p == 2 else waits(self, p))
    assert _offloaded_equals_resident(llama, plan, lazy=False)[1]
    assert not _offloaded_equals_resident(llama, plan, lazy=True)[1]


def test_vllm_slot_reuse_bug_is_caught(llama, monkeypatch):
    """Negative control: vLLM's pre-fix rule (copy (k+P) mod N after k, slot k % P) corrupts weights when P
    does not divide N; the stand-in must show it, or the equality tests above prove nothing."""
    plan = plan_with(llama, 1, 1, 2)  # 7 layers offloaded, depth 2: 7 % 2 != 0
    n, depth = len(plan.offload.layers), plan.offload.prefetch_step

    def buggy_issue_after(self):
        return tuple(((k + depth) % n,) for k in range(n))

    monkeypatch.setattr(PrefetchSchedule, "issue_after", buggy_issue_after)
    monkeypatch.setattr(PrefetchSchedule, "previous_reader", lambda self, k: (0, (k - depth) % n))
    _, equal = _offloaded_equals_resident(llama, plan)
    assert not equal


def test_params_keep_their_addresses_and_host_bytes_are_exact(llama):
    plan = plan_with(llama, 1, 1, 3)
    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan)
    layers = model.model.layers
    before = {name: p.data_ptr() for name, p in layers.named_parameters()}
    _logits(model, 2)
    assert before == {name: p.data_ptr() for name, p in layers.named_parameters()}
    offloaded_bytes = sum(plan.layers[i].offloaded_bytes for i in plan.offload.layers)
    assert engine.host_bytes - offloaded_bytes < 256 * 8 * len(plan.offload.layers)  # alignment only
    assert engine.slot_bytes >= plan.memory.slot_bytes
    assert len(engine.slots) == plan.memory.num_slots
    # one arena holds every resident param and the slots, within the plan's bound
    weights = plan.memory.gpu_bytes - plan.memory.allocation_slack_bytes
    assert weights <= engine.arena.numel() <= plan.memory.gpu_bytes
    arena_start = engine.arena.data_ptr()
    assert all(arena_start <= p.data_ptr() < arena_start + engine.arena.numel() for p in model.parameters())


def test_copy_waits_follow_the_schedule(llama):
    """Each copy into a slot is issued after the slot's previous reader recorded its event."""
    plan = plan_with(llama, 1, 1, 3)
    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan)
    _logits(model, 2)
    log = engine.backend.log
    recorded = set()
    for entry in log:
        if entry[0] == "record":
            recorded.add(entry[1])
        if entry[0] == "copy-wait":
            assert entry[1] in recorded
    assert any(entry[0] == "compute-wait" for entry in log)


def test_selection_mismatch_is_a_plan_error(moe):
    """A plan whose segments name checkpoint-only tensor names (transformers fuses experts) is refused."""
    from planner.errors import PlanError

    plan = plan_with(moe, 1, 1, 2, params=("experts.0",))  # per-expert names exist only on disk
    with pytest.raises(PlanError, match="moves"):
        apply_plan_on_cpu(build_model(str(moe), None), plan)


def test_fingerprint_mismatch_is_a_plan_error(llama, moe):
    from planner.errors import PlanError
    from runtime.load_source import check_fingerprint, open_source

    plan = plan_with(llama, 1, 1, 2)
    check_fingerprint(plan, open_source(plan, str(llama)))
    with pytest.raises(PlanError, match="regenerate the plan"):
        check_fingerprint(plan, open_source(plan, str(moe)))


def test_run_without_a_gpu_is_one_line(tmp_path, llama):
    import subprocess
    import sys

    from tests.runtime_models import write_plan

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    plan_path = write_plan(plan_with(llama, 1, 1, 2), tmp_path / "plan.yaml")
    result = subprocess.run([sys.executable, "-m", "offload_plan", "run", str(plan_path), "--bench"],
                            capture_output=True, text=True)
    assert result.returncode == 7
    assert result.stderr.strip().count("\n") == 0 and "CUDA GPU" in result.stderr


def test_measure_and_calibrate_need_a_gpu(llama, tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for args in (["make", "-m", str(llama), "-g", "h100-sxm", "--measure"], ["calibrate"],
                 ["make", "-m", str(llama), "-g", "h100-sxm", "--measured-on", "h100-sxm"]):
        result = subprocess.run([sys.executable, "-m", "offload_plan", *args], capture_output=True, text=True)
        assert result.returncode in (6, 7), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_measure_kinds_split_by_attention_type():
    from types import SimpleNamespace

    from planner.model.layout import LayerInfo
    from runtime.measure import measured_kinds

    dense = (("mlp.w", "BF16", (4, 4), 32),)
    layout = SimpleNamespace(layers=tuple(LayerInfo(index=i, params=dense) for i in range(4)))
    types = ["sliding_attention", "full_attention"] * 2
    assert measured_kinds(layout, {"layer_types": types}) == ((0, 2), (1, 3))
    assert measured_kinds(layout, {"text_config": {}}) == ((0, 1, 2, 3),)


@pytest.mark.parametrize("save", [save_tiny_llama, save_tiny_moe])
def test_measure_model_aliases_equal_a_model_of_copied_layers(save, tmp_path):
    """The full-depth model measure times is the real model with every layer holding its kind's weights, in the
    checkpoint's dtype."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from runtime.graph import cache_argument
    from runtime.experts_impl import PREFILL, use_phase
    from runtime.measure import build_measure_model, measure_dtype

    config = json.loads((save(tmp_path) / "config.json").read_text())
    aliased = build_measure_model(config, (tuple(range(7)),), "model.layers", device="cpu")
    layers = aliased.model.layers
    assert len(layers) == 7 and aliased.config.num_hidden_layers == 7
    owner_params = [p.data_ptr() for p in layers[0].parameters()]
    assert all([p.data_ptr() for p in layer.parameters()] == owner_params for layer in layers)
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(7))
    fired = []
    layers[3].register_forward_pre_hook(lambda *a: fired.append(3))

    assert {p.dtype for p in aliased.parameters()} == {measure_dtype(config)}
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=measure_dtype(config)).eval()
    use_phase(reference, PREFILL, torch.device("cpu"))  # the experts' implementation the measured model runs
    reference.load_state_dict(aliased.state_dict(), strict=False)  # non-layer weights
    for layer in reference.model.layers:
        layer.load_state_dict(layers[0].state_dict())
    ids = _input_ids()
    with torch.inference_mode():
        caches = [DynamicCache(config=m.config) for m in (aliased, reference)]
        out, expected = (m(input_ids=ids, use_cache=True, **cache_argument(m, c)).logits
                         for m, c in zip((aliased, reference), caches))
    assert torch.equal(out, expected) and fired == [3]
    assert [caches[0].get_seq_length(i) for i in range(7)] == [ids.shape[1]] * 7


def _captured_steps(engine, model, calls: int = 3, finish: bool = True, steps_per_capture: int = 1):
    """Forwards as CUDA-graph captures would run them, on the stand-in that enforces capture's rules: each
    capture runs steps_per_capture steps and joins the wrapped copies after its last (DecodeLoop's order)."""
    outputs = []
    with torch.inference_mode():
        for _ in range(calls):
            engine.backend.begin_capture()
            for step in range(steps_per_capture):
                engine.start_step(first=step == 0, last=step == steps_per_capture - 1)
                outputs.append(model(_input_ids()).logits)
                if finish:
                    engine.finish_step(join=step == steps_per_capture - 1)
            engine.backend.end_capture()
    return outputs


REPLAY_START_COPIES = pytest.mark.parametrize("replay_start_copies", [0, 1, 6], ids=["joined", "one-left", "all-left"])


@LANDING
@REPLAY_START_COPIES
@pytest.mark.parametrize("steps_per_capture", [1, 4])
@pytest.mark.parametrize("shape", PLAN_SHAPES)
def test_graph_mode_steps_are_capturable_and_equal_resident(llama, shape, steps_per_capture, replay_start_copies,
                                                            lazy):
    """Every plan shape, including those with slots that hold one layer for good (copied once at load: a
    wait on their load event inside a capture is the 'uncaptured work' CUDA rejects), with the wrapped
    copies joined at each replay's end, one of them or all left to the next replay's start."""
    plan = with_replay_start_copies(plan_with(llama, *shape), replay_start_copies)
    reference = _logits(build_model(str(llama), None), 1)[0]
    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan, lazy)
    _logits(model, 2)  # eager steps first: graph mode must take over their in-flight copies
    engine.set_graph_mode(True)
    outputs = _captured_steps(engine, model, steps_per_capture=steps_per_capture)
    assert all(torch.equal(out, reference) for out in outputs)


@LANDING
@REPLAY_START_COPIES
def test_eager_steps_after_captured_ones_equal_resident(llama, replay_start_copies, lazy):
    """Graph mode off after captures: eager steps must not wait on events recorded inside a capture (CUDA
    rejects that with 'invalid argument'), the slots the captures left loaded stay correct, and a copy the
    last capture left to a next one is made."""
    plan = with_replay_start_copies(plan_with(llama, 3, 2, 2), replay_start_copies)
    reference = _logits(build_model(str(llama), None), 1)[0]
    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan, lazy)
    engine.set_graph_mode(True)
    _captured_steps(engine, model, calls=2)
    engine.set_graph_mode(False)
    assert all(torch.equal(out, reference) for out in _logits(model, 2))


def test_eager_schedule_is_not_capturable_and_unjoined_copies_are_caught(llama):
    plan = plan_with(llama, 3, 2, 2)  # 4 offloaded through 2 slots: copies every step
    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan)
    with pytest.raises(AssertionError, match="recorded before the capture began"):
        _captured_steps(engine, model, calls=1)
    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan)
    engine.set_graph_mode(True)
    with pytest.raises(AssertionError, match="never joined"):
        _captured_steps(engine, model, calls=1, finish=False)


def test_a_copy_left_to_the_next_replay_is_its_first_work_on_the_link(llama):
    """With one wrapped copy left to the replay's start, each capture's first copy comes before any layer has
    run (it waits only for the replay to begin), and the last step issues one copy fewer than it would."""
    plan = with_replay_start_copies(plan_with(llama, 3, 2, 1), 1)  # 4 offloaded through 1 slot
    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan)
    engine.set_graph_mode(True)
    logged = len(engine.backend.log)
    _captured_steps(engine, model, calls=1)
    log = engine.backend.log[logged:]
    first_copy = next(i for i, entry in enumerate(log) if entry[0] == "copy")
    first_layer_done = next(i for i, entry in enumerate(log) if entry[:2] == ("record", "reader-done-0"))
    assert first_copy < first_layer_done and log[first_copy] == ("copy", f"layer-{engine.offloaded[0]}")
    assert sum(entry[0] == "copy" for entry in log) == len(engine.offloaded)  # 3 in the step + 1 at its start


def test_copy_bytes_per_step_follows_the_schedule(llama):
    engine = apply_plan_on_cpu(build_model(str(llama), None), plan_with(llama, 7, 5, 2))
    assert engine.copy_bytes_per_step == sum(engine.layer_bytes)  # 5 layers through 2 slots: all recopied
    engine = apply_plan_on_cpu(build_model(str(llama), None), plan_with(llama, 1, 1, 6))
    # 7 through 6 slots: positions 1..5 keep a slot of their own, 0 and 6 share one
    assert engine.copy_bytes_per_step == engine.layer_bytes[0] + engine.layer_bytes[6]


@LANDING
@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_decode_loop_matches_generate_and_the_plan_matches_resident(llama, steps_per_call, lazy):
    """DecodeLoop's greedy steps over a static cache: the tokens transformers' generate gives, and with a plan
    applied (graph mode, each call checked against capture's rules: inside one, steps wrap copies into the
    next step; the last joins them) the resident logits bit for bit."""
    from runtime.graph import DecodeLoop

    prompt = _input_ids()
    resident = build_model(str(llama), None)
    loop = DecodeLoop(resident, batch=2, max_cache_tokens=32, device=torch.device("cpu"),
                      steps_per_call=steps_per_call)
    loop.prefill(prompt)
    saved = loop.save_state()
    loop.generate(3)
    loop.restore_state(saved)  # back to right after the prefill: the same steps again
    ids, logits = loop.generate(8)
    with torch.inference_mode():
        expected = resident.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(ids, expected[:, prompt.shape[1]:])

    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan_with(llama, 3, 2, 1), lazy)
    planned = DecodeLoop(model, batch=2, max_cache_tokens=32, device=torch.device("cpu"), engine=engine,
                         steps_per_call=steps_per_call)
    planned.prefill(prompt)
    engine.set_graph_mode(True)
    for call in range(8 // steps_per_call):
        engine.backend.begin_capture()
        planned.step()
        engine.backend.end_capture()
        for index in range(steps_per_call):
            assert torch.equal(planned.step_logits[index], logits[call * steps_per_call + index])


def test_cuda_graph_plans_need_a_decode_workload(llama):
    from tests.conftest import assert_one_line_error, run_cli

    result = run_cli(["make", "-m", str(llama), "-g", "h100-sxm", "--tokens", "64", "--cuda-graph"], cwd=llama)
    assert_one_line_error(result.returncode, result.stderr, contains=("--tokens equal to", "--sequences"))
    ok = run_cli(["make", "-m", str(llama), "-g", "h100-sxm", "--tokens", "8", "--sequences", "8", "--context", "64",
                  "--cuda-graph", "--budget", "1MB"], cwd=llama)
    assert ok.returncode == 0 and "cuda_graph: true" in ok.stdout and "--cuda-graph" in ok.stdout.splitlines()[1]
    assert "replay_start_copies:" in ok.stdout
    (llama / "graphed.yaml").write_text(ok.stdout)
    shown = run_cli(["show", "graphed.yaml"], cwd=llama)
    assert shown.returncode == 0 and "CUDA-graph replays" in shown.stdout


# Inductor compiles C++ on the CPU
needs_c_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                      reason="Inductor on the CPU needs a C compiler")


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama-bf16"), dtype=torch.bfloat16)


@pytest.mark.parametrize("backend, checkpoint", [("aot_eager", "llama"),
                                                 pytest.param("inductor", "llama", marks=needs_c_compiler),
                                                 pytest.param("inductor", "llama_bf16", marks=needs_c_compiler)])
def test_compiled_steps_run_the_offload_inside_and_equal_compiled_resident(backend, checkpoint, request):
    """torch.compile traces the hooks as the layer_boundary op: each compiled step waits and copies as the
    schedule says (capture's rules checked) and gives the compiled resident logits bit for bit, in bf16 too
    (where the op's split of Inductor's fusions would change rounding). The resident model compiles first,
    so its code (no hooks) being reused for the plan's model would show here. Copies land only when awaited,
    so a kernel that Inductor moved ahead of its layer's wait would read the slot's previous layer."""
    from runtime.graph import DecodeLoop

    llama = request.getfixturevalue(checkpoint)
    prompt = _input_ids()
    resident = DecodeLoop(build_model(str(llama), None), batch=2, max_cache_tokens=32, device=torch.device("cpu"),
                          compile_backend=backend)
    resident.prefill(prompt)
    resident.warm_up()
    assert resident.compile_s > 0
    _, reference = resident.generate(4)

    model = build_model(str(llama), None)
    engine = apply_plan_on_cpu(model, plan_with(llama, 3, 2, 1), lazy_copies=True)  # 4 offloaded, 2 slots
    loop = DecodeLoop(model, batch=2, max_cache_tokens=32, device=torch.device("cpu"), engine=engine,
                      compile_backend=backend, steps_per_call=4)  # steps wrap inside one capture too
    loop.prefill(prompt)
    engine.set_graph_mode(True)
    loop.warm_up()
    logged = len(engine.backend.log)
    engine.backend.begin_capture()
    loop.step()  # 4 steps
    engine.backend.end_capture()
    assert all(torch.equal(loop.step_logits[step], reference[step]) for step in range(4))
    copies = [entry for entry in engine.backend.log[logged:] if entry[0] == "copy"]
    assert len(copies) == 4 * 4  # every offloaded layer recopied each step, from inside the compiled code


def test_a_full_static_cache_is_a_usage_error(llama):
    """The cache's free tokens are counted on the host: a call past its end would write out of bounds inside a
    replay, where nothing could be reported."""
    from planner.errors import UsageError
    from runtime.graph import DecodeLoop

    loop = DecodeLoop(build_model(str(llama), None), batch=2, max_cache_tokens=16, device=torch.device("cpu"),
                      steps_per_call=4)
    loop.prefill(_input_ids())  # 11 of 16 tokens: one call of 4 fits, a second does not
    loop.step()
    with pytest.raises(UsageError, match="1 free tokens and the next steps need 4"):
        loop.step()
    with pytest.raises(UsageError, match="give it more room"):
        loop.warm_up()


def test_meminfo_reads_the_hosts_memory():
    """calibrate records MemTotal as the host memory figure; run checks MemAvailable before loading."""
    import os

    from runtime.host_memory import meminfo_bytes

    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo here")
    total, available = meminfo_bytes("MemTotal"), meminfo_bytes("MemAvailable")
    assert total == pytest.approx(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), rel=0.01)
    assert 0 < available <= total and meminfo_bytes("NoSuchKey") is None


def test_measure_kinds_of_a_config_without_layer_types_follow_transformers_pattern():
    """Gemma-3's config.json names no layer_types (transformers derives every sixth layer global): measure
    still times the sliding and the global layers apart, and its model holds one of each, so the rotary
    tables of both types exist (transformers 5.17 keys them by the types the built layers have)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from planner.model.layout import LayerInfo
    from runtime.measure import build_measure_model, measured_kinds

    release = json.loads((Path(__file__).parents[2] / "examples/gemma-3-27b-it/config.json").read_text())
    config = dict(release["text_config"], model_type="gemma3_text", num_hidden_layers=12, hidden_size=64,
                  intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
                  torch_dtype="bfloat16")
    dense = (("mlp.w", "BF16", (4, 4), 32),)
    layout = SimpleNamespace(layers=tuple(LayerInfo(index=i, params=dense) for i in range(12)))
    kinds = measured_kinds(layout, config)
    assert kinds == ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), (5, 11))
    model = build_measure_model(config, ((0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 5, 11),), "model.layers", device="cpu")
    logits = model(torch.tensor([[1, 2, 3]])).logits  # every layer type has its rotary table
    assert logits.shape == (1, 3, 128) and torch.isfinite(logits.float()).all()
