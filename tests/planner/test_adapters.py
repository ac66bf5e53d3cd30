"""LoRA adapters in the plan: reading PEFT folders by their headers, slots, the pinned pool, the waits, and the
commands (make, show, check, diff, export) end to end on hand-written adapters."""

import json

import pytest
import yaml

from planner.model.adapters import MIN_ADAPTER_LINK_SHARE, adapter_waits, load_adapter
from planner.source.checkpoint import load_checkpoint
from planner.model.layout import build_layout
from tests.conftest import assert_one_line_error, invoke, make_adapter, make_checkpoint, nbytes_of

HIDDEN = 64
NUM_LAYERS = 4


@pytest.fixture
def base(workdir):
    """A 4-layer llama-style checkpoint at ckpt/ and three adapters at ad/{a,b,c} (ranks 8, 16, 4)."""
    checkpoint = make_checkpoint(workdir / "ckpt", num_layers=NUM_LAYERS, hidden=HIDDEN, num_shards=2)
    make_adapter(workdir / "ad" / "a", checkpoint.tensors, rank=8)
    make_adapter(workdir / "ad" / "b", checkpoint.tensors, rank=16, modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    make_adapter(workdir / "ad" / "c", checkpoint.tensors, rank=4)
    return checkpoint


def _bytes(specs: dict) -> int:
    return sum(nbytes_of(*spec) for spec in specs.values())


def _make(test_gpu, *extra, output="plan.yaml"):
    result = invoke(["make", "-m", "ckpt", "-g", test_gpu, "--tokens", "2", "--sequences", "2", "--context", "64",
                     *extra, *(["-o", output] if output else [])])
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load(open(output).read()) if output else yaml.safe_load(result.stdout)


ADAPTERS = ("--adapter", "a=ad/a", "--adapter", "b=ad/b", "--adapter", "c=ad/c")


# ---- reading ------------------------------------------------------------------------------------------------


def test_adapter_is_read_from_config_and_header(base, workdir):
    checkpoint = load_checkpoint("ckpt")
    layout = build_layout(checkpoint, None)
    adapter = load_adapter("b", "ad/b", checkpoint, layout)
    # q and o: A (16, 64) + B (64, 16); k and v: kv width 64 here (4 heads, no GQA): the same, in bf16
    per_module = 2 * (16 * HIDDEN + HIDDEN * 16)
    assert adapter.rank == 16 and adapter.alpha == 32.0
    assert adapter.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")
    assert adapter.layer_bytes == (4 * per_module,) * NUM_LAYERS
    assert adapter.total_bytes == 4 * 4 * per_module and adapter.num_tensors == 32
    assert adapter.base_model == "ckpt" and adapter.revision is None


def test_adapter_on_some_layers_counts_bytes_per_layer(base, workdir):
    make_adapter(workdir / "ad" / "d", base.tensors, rank=8, layers=(1, 3))
    checkpoint = load_checkpoint("ckpt")
    adapter = load_adapter("d", "ad/d", checkpoint, build_layout(checkpoint, None))
    pair = 2 * 2 * (8 * HIDDEN + HIDDEN * 8)  # q_proj and v_proj
    assert adapter.layer_bytes == (0, pair, 0, pair)


# ---- the waits ----------------------------------------------------------------------------------------------


def test_waits_blocking_against_pipelined_by_hand():
    """1 MB adapters on a 1 GB/s link with 10 us per copy: 1.01 ms each. 4 missing, weights busy 50% of a
    2 ms step: blocking 4.04 ms for all; pipelined the first after 1.01 ms, the next three at half the link."""
    waits = adapter_waits(slot_bytes=10**6, num_missing=4, h2d_bytes_per_s=1e9, copy_overhead_us=10.0, step_ms=2.0,
                          link_busy_share=0.5)
    assert waits.copy_ms == pytest.approx(1.01)
    assert waits.blocking_wait_ms == pytest.approx(4.04)
    assert waits.pipelined_first_wait_ms == pytest.approx(1.01)
    assert waits.shared_copy_ms == pytest.approx(2.02)
    assert waits.pipelined_last_wait_ms == pytest.approx(1.01 + 3 * 2.02)
    assert waits.pipelined_step_ms == pytest.approx(2.0)  # the weights keep their half


def test_waits_on_a_busy_link_give_adapters_their_least_share():
    """With the link always busy with weights, adapters still get MIN_ADAPTER_LINK_SHARE and the steps stretch."""
    waits = adapter_waits(slot_bytes=10**6, num_missing=2, h2d_bytes_per_s=1e9, copy_overhead_us=0.0, step_ms=2.0,
                          link_busy_share=1.0)
    assert waits.shared_copy_ms == pytest.approx(1.0 / MIN_ADAPTER_LINK_SHARE)
    assert waits.pipelined_step_ms == pytest.approx(2.0 / (1 - MIN_ADAPTER_LINK_SHARE))


# ---- make ---------------------------------------------------------------------------------------------------


def test_make_plans_slots_pool_and_waits(base, workdir, test_gpu):
    plan = _make(test_gpu, "--budget", "300KB", *ADAPTERS)
    adapters = plan["adapters"]
    sizes = {name: _bytes(json_specs) for name, json_specs in _adapter_specs(workdir).items()}
    assert [row["name"] for row in adapters["items"]] == ["a", "b", "c"]
    assert {row["name"]: row["bytes"] for row in adapters["items"]} == sizes
    # a batch of 2 sequences uses at most 2 adapters at once: 2 slots of the largest adapter
    assert adapters["num_slots"] == 2 and adapters["slot_bytes"] == sizes["b"]
    assert adapters["gpu_bytes"] == 2 * sizes["b"] and adapters["host_pinned_bytes"] == sum(sizes.values())
    assert adapters["max_rank"] == 16 and adapters["num_missing"] == 2
    assert adapters["copy_ms"] == pytest.approx(0.01 + sizes["b"] / 1e6, abs=1e-4)
    assert adapters["blocking_wait_ms"] == pytest.approx(2 * adapters["copy_ms"], abs=2e-4)
    assert adapters["pipelined_first_wait_ms"] == adapters["copy_ms"]
    memory = plan["memory"]
    assert memory["total_gpu_bytes"] == (memory["gpu_bytes"] + memory["kv_cache_bytes"] + memory["activation_bytes"]
                                         + memory["cuda_graph_pool_bytes"] + memory["cuda_context_bytes"]
                                         + adapters["gpu_bytes"])
    assert plan["inputs"]["adapters"] == ["a=ad/a", "b=ad/b", "c=ad/c"]


def _adapter_specs(workdir) -> dict:
    """name -> {tensor: (dtype, shape)} from the adapters' own headers."""
    out = {}
    for name in ("a", "b", "c"):
        raw = (workdir / "ad" / name / "adapter_model.safetensors").read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + length])
        out[name] = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
    return out


def test_plans_without_adapters_keep_their_keys(base, test_gpu):
    plan = _make(test_gpu, "--budget", "300KB")
    assert "adapters" not in plan and "adapters" not in plan["inputs"] and "adapter_slots" not in plan["inputs"]


def test_serving_plan_counts_the_slots_and_grows_them_with_concurrency(base, test_gpu):
    result = invoke(["make", "-m", "ckpt", "-g", test_gpu, "--context", "256", "--concurrency", "2", "--chunk", "64",
                     *ADAPTERS])
    assert result.exit_code == 0, result.stderr
    plan = yaml.safe_load(result.stdout)
    adapters, memory = plan["adapters"], plan["memory"]
    assert adapters["num_slots"] == 2
    point = plan["serving"]["points"][0]
    assert point["total_gpu_bytes"] == memory["total_gpu_bytes"]
    assert memory["total_gpu_bytes"] - adapters["gpu_bytes"] == (
        memory["gpu_bytes"] + memory["kv_cache_bytes"] + memory["activation_bytes"] + memory["cuda_graph_pool_bytes"]
        + memory["cuda_context_bytes"])


def test_default_slots_shrink_to_the_gpu_memory_left_and_pinned_slots_that_do_not_fit_fail(base, test_gpu):
    """With GPU memory for one slot beyond the plan, the planner keeps one; --adapter-slots 2 is refused."""
    without = _make(test_gpu, "--budget", "300KB", output=None)
    slot = _make(test_gpu, "--budget", "300KB", *ADAPTERS, output=None)["adapters"]["slot_bytes"]
    memory = f"{without['memory']['total_gpu_bytes'] + slot + slot // 2}B"
    plan = _make(test_gpu, "--budget", "300KB", "--gpu-memory", memory, *ADAPTERS, output=None)
    assert plan["adapters"]["num_slots"] == 1 and plan["adapters"]["num_missing"] == 1
    result = invoke(["make", "-m", "ckpt", "-g", test_gpu, "--tokens", "2", "--sequences", "2", "--context", "64",
                     "--budget", "300KB", "--gpu-memory", memory, *ADAPTERS, "--adapter-slots", "2"])
    assert_one_line_error(result.exit_code, result.stderr, contains=("adapter slot(s)", "--adapter-slots"))


def test_host_memory_counts_the_adapters(base, test_gpu):
    plan = _make(test_gpu, "--budget", "300KB", output=None)
    pinned = plan["memory"]["host_pinned_bytes"]
    ok = _make(test_gpu, "--budget", "300KB", "--host-memory", f"{pinned + 90112}B", *ADAPTERS, output=None)
    assert ok["adapters"]["host_pinned_bytes"] == 90112
    result = invoke(["make", "-m", "ckpt", "-g", test_gpu, "--tokens", "2", "--sequences", "2", "--context", "64",
                     "--budget", "300KB", "--host-memory", f"{pinned + 90111}B", *ADAPTERS])
    assert_one_line_error(result.exit_code, result.stderr, contains=("host memory",))


# ---- show, check, diff, export ------------------------------------------------------------------------------


def test_show_reports_the_adapters(base, test_gpu):
    _make(test_gpu, "--budget", "300KB", *ADAPTERS)
    result = invoke(["show", "plan.yaml", "--no-layers"])
    assert result.exit_code == 0, result.stderr
    assert "Adapters: 3 pinned in host memory" in result.stdout and "k_proj o_proj q_proj v_proj" in result.stdout
    assert "blocking" in result.stdout and "pipelined" in result.stdout and "adapter slot(s)" in result.stdout
    shown = json.loads(invoke(["show", "plan.yaml", "--json"]).stdout)
    assert shown["adapters"]["num_slots"] == 2 and len(shown["adapters"]["items"]) == 3


def test_check_regenerates_adapters_and_catches_a_changed_adapter(base, workdir, test_gpu):
    _make(test_gpu, "--budget", "300KB", *ADAPTERS)
    result = invoke(["check", "plan.yaml"])
    assert result.exit_code == 0, result.stdout + result.stderr
    make_adapter(workdir / "ad" / "c", base.tensors, rank=32)  # retrained at another rank
    result = invoke(["check", "plan.yaml"])
    assert result.exit_code == 8, result.stdout + result.stderr
    assert "rank: 32" in result.stdout or "rank: 32" in result.stderr


def test_diff_reports_adapters_added_and_changed(base, workdir, test_gpu):
    _make(test_gpu, "--budget", "300KB", "--adapter", "a=ad/a", output="old.yaml")
    make_adapter(workdir / "ad" / "a", base.tensors, rank=16)
    _make(test_gpu, "--budget", "300KB", *ADAPTERS, output="new.yaml")
    result = invoke(["diff", "old.yaml", "new.yaml", "--json"])
    assert result.exit_code == 0, result.stderr
    adapters = json.loads(result.stdout)["adapters"]
    assert adapters["added"] == ["b", "c"] and adapters["removed"] == []
    assert adapters["changed"]["a"]["rank"] == {"old": 8, "new": 16}
    assert adapters["num_slots"] == {"old": 1, "new": 2, "change": 1}
    words = invoke(["diff", "old.yaml", "new.yaml"]).stdout
    assert "adapters added: b, c" in words.replace("\n", " ").lower() and "adapter a changed" in words


def test_export_names_the_engines_lora_settings(base, test_gpu):
    _make(test_gpu, "--budget", "300KB", *ADAPTERS, "--adapter-slots", "1")
    vllm = invoke(["export", "plan.yaml", "--to", "vllm"])
    assert vllm.exit_code == 0, vllm.stderr
    assert ("--enable-lora --max-loras 1 --max-cpu-loras 3 --max-lora-rank 16 --lora-modules a=ad/a b=ad/b c=ad/c"
            in vllm.stdout)
    sglang = invoke(["export", "plan.yaml", "--to", "sglang"])
    assert sglang.exit_code == 0, sglang.stderr
    assert ("--enable-lora --lora-paths a=ad/a b=ad/b c=ad/c --max-loras-per-batch 1 --max-loaded-loras 3"
            in sglang.stdout)
    assert "--enable-lora-overlap-loading" in sglang.stderr


def test_export_rounds_the_rank_up_to_one_vllm_accepts(base, workdir, test_gpu):
    make_adapter(workdir / "ad" / "odd", base.tensors, rank=12)
    _make(test_gpu, "--budget", "300KB", "--adapter", "odd=ad/odd")
    result = invoke(["export", "plan.yaml", "--to", "vllm", "--json"])
    data = json.loads(result.stdout)
    flags = data["flags"]
    assert flags[flags.index("--max-lora-rank") + 1] == "16" and any("rounded up" in n for n in data["notes"])


def test_a_plan_missing_its_adapters_section_is_one_line(base, test_gpu):
    text = open(_plan_path(test_gpu)).read()
    cut = text[:text.index("\nadapters:")] + "\n"
    open("plan.yaml", "w").write(cut)
    result = invoke(["show", "plan.yaml"])
    assert_one_line_error(result.exit_code, result.stderr, contains=("adapters",))


def _plan_path(test_gpu) -> str:
    _make(test_gpu, "--budget", "300KB", *ADAPTERS)
    return "plan.yaml"


# ---- bad adapters: one line each ----------------------------------------------------------------------------


def _truncate(folder):
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _bad_header_prefix(folder):
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:20])


def _rank_mismatch(folder, base):
    make_adapter(folder, base.tensors, rank=8, config={"r": 4})


def _missing_module(folder, base):
    specs = {"base_model.model.model.layers.0.mlp.nope_proj.lora_A.weight": ("BF16", (8, HIDDEN)),
             "base_model.model.model.layers.0.mlp.nope_proj.lora_B.weight": ("BF16", (HIDDEN, 8))}
    make_adapter(folder, base.tensors, rank=8, modules=("nope_proj",), tensors=specs)


def _layer_beyond(folder, base):
    specs = {f"base_model.model.model.layers.{NUM_LAYERS}.self_attn.q_proj.lora_A.weight": ("BF16", (8, HIDDEN)),
             f"base_model.model.model.layers.{NUM_LAYERS}.self_attn.q_proj.lora_B.weight": ("BF16", (HIDDEN, 8))}
    make_adapter(folder, base.tensors, rank=8, modules=("q_proj",), tensors=specs)


def _lone_a(folder, base):
    specs = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ("BF16", (8, HIDDEN))}
    make_adapter(folder, base.tensors, rank=8, modules=("q_proj",), tensors=specs)


def _int_weights(folder, base):
    specs = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ("I32", (8, HIDDEN)),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": ("I32", (HIDDEN, 8))}
    make_adapter(folder, base.tensors, rank=8, modules=("q_proj",), tensors=specs)


def _untargeted(folder, base):
    make_adapter(folder, base.tensors, rank=8, config={"target_modules": ["q_proj"]})


BAD = {
    "missing config": (lambda f, b: (f / "adapter_config.json").unlink(), "adapter_config.json"),
    "missing weights": (lambda f, b: (f / "adapter_model.safetensors").unlink(), "adapter_model.safetensors"),
    "truncated data": (lambda f, b: _truncate(f), "truncated"),
    "truncated header": (lambda f, b: _bad_header_prefix(f), "adapter_model.safetensors"),
    "config not json": (lambda f, b: (f / "adapter_config.json").write_text("{r: 8"), "not valid JSON"),
    "rank mismatch": (_rank_mismatch, "do not match rank r=4"),
    "module the base lacks": (_missing_module, "nope_proj"),
    "layer beyond the base": (_layer_beyond, f"layer {NUM_LAYERS}"),
    "lora_A without lora_B": (_lone_a, "no lora_B"),
    "integer weights": (_int_weights, "I32"),
    "module not in target_modules": (_untargeted, "target_modules"),
    "target the base lacks": (lambda f, b: make_adapter(f, b.tensors, config={"target_modules": ["q_proj", "v_proj",
                                                                                              "wq"]}), "'wq'"),
    "rank not a count": (lambda f, b: make_adapter(f, b.tensors, config={"r": "8"}), "r is '8'"),
    "rank_pattern": (lambda f, b: make_adapter(f, b.tensors, config={"rank_pattern": {"q_proj": 4}}), "rank_pattern"),
    "not lora": (lambda f, b: make_adapter(f, b.tensors, config={"peft_type": "IA3"}), "IA3"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_one_line(base, workdir, test_gpu, case):
    spoil, expected = BAD[case]
    spoil(workdir / "ad" / "a", base)
    result = invoke(["make", "-m", "ckpt", "-g", test_gpu, "--adapter", "a=ad/a", "-o", "plan.yaml"])
    assert_one_line_error(result.exit_code, result.stderr, contains=(expected,))
    assert not (workdir / "plan.yaml").exists()


@pytest.mark.parametrize("args, expected", [
    (["--adapter", "ad/a"], "NAME=PATH"),
    (["--adapter", "a b=ad/a"], "NAME=PATH"),
    (["--adapter", "a=ad/a", "--adapter", "a=ad/b"], "twice"),
    (["--adapter", "a=./missing/folder"], "neither an existing folder"),
    (["--adapter", "a=org/not-cached"], "not in the local Hugging Face cache"),
    (["--adapter", "a=org/x..y"], "not a valid hub repo id"),
    (["--adapter", "a=ckpt/config.json"], "not a folder"),
    (["--adapter-slots", "2"], "--adapter-slots applies"),
    (["--adapter", "a=ad/a", "--adapter-slots", "2"], "--adapter-slots 2"),
    (["--adapter", "a=ad/a", "--adapter-slots", "0"], "--adapter-slots 0"),
])
def test_bad_adapter_flags_are_one_line(base, test_gpu, args, expected):
    result = invoke(["make", "-m", "ckpt", "-g", test_gpu, *args])
    assert_one_line_error(result.exit_code, result.stderr, contains=(expected,))


def test_adapter_of_another_base_is_refused_by_shape(base, workdir, test_gpu):
    """An adapter for a wider model: its lora_A rows do not match this base's in_features."""
    wide = make_checkpoint(workdir / "wide", num_layers=NUM_LAYERS, hidden=2 * HIDDEN, num_shards=1)
    make_adapter(workdir / "ad" / "wide", wide.tensors, rank=8)
    result = invoke(["make", "-m", "ckpt", "-g", test_gpu, "--adapter", "w=ad/wide"])
    assert_one_line_error(result.exit_code, result.stderr, contains=("base weight",))


# ---- hub ids ------------------------------------------------------------------------------------------------


def test_hub_adapter_is_read_from_the_cache_offline(base, workdir, tmp_path_factory):
    """An adapter named by hub id reads its config and header from the Hugging Face cache (HF_HUB_OFFLINE=1),
    records the commit, and plans like the same folder given locally; a cache without the weights is one line."""
    from tests.conftest import cli_env, run_cli
    from tests.helpers import HUB_COMMIT, cache_hub_repo

    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache_hub_repo(cache, "org/lora", workdir / "ad" / "b")
    env = cli_env(HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent))
    args = ["make", "-m", "ckpt", "-g", "tests/data/test-gpu.yaml", "--budget", "300KB"]
    proc = run_cli([*args, "--adapter", "b=org/lora"], cwd=workdir, env=env)
    assert proc.returncode == 0, proc.stderr
    hub = yaml.safe_load(proc.stdout)["adapters"]["items"][0]
    local = yaml.safe_load(run_cli([*args, "--adapter", "b=ad/b"], cwd=workdir, env=env).stdout)["adapters"]["items"][0]
    assert hub["revision"] == HUB_COMMIT and hub["source"] == "org/lora" and str(cache) not in proc.stdout
    assert {k: v for k, v in hub.items() if k not in ("source", "revision")} == \
        {k: v for k, v in local.items() if k not in ("source", "revision")}
    (cache / "models--org--lora" / "snapshots" / HUB_COMMIT / "adapter_model.safetensors").unlink()
    proc = run_cli([*args, "--adapter", "b=org/lora"], cwd=workdir, env=env)
    assert_one_line_error(proc.returncode, proc.stderr, contains=("adapter_model.safetensors", "local Hugging Face"))


def test_run_prompt_says_it_runs_the_base_model_alone(base, test_gpu):
    """--bench serves the adapters; --prompt without --adapter warns before anything else (here it then stops: no
    CUDA GPU); with --adapter it does not."""
    _make(test_gpu, "--budget", "300KB", *ADAPTERS)
    result = invoke(["run", "plan.yaml", "--prompt", "hello"])
    assert "--prompt runs the base model without the plan's 3 LoRA adapter(s)" in result.stderr
    assert "--adapter NAME" in result.stderr
    assert "adapter" not in invoke(["run", "plan.yaml", "--bench"]).stderr.lower()
    assert "adapter" not in invoke(["run", "plan.yaml", "--prompt", "hello", "--adapter", "a"]).stderr.lower()


@pytest.mark.parametrize("args, contains", [
    (["--prompt", "hi", "--adapter", "nope"], ("not one of the plan's adapters", "a, b, c")),
    (["--bench", "--adapter", "a"], ("--adapter goes with --prompt",)),
    (["--prompt", "hi", "--adapter-mode", "blocking"], ("--adapter-mode goes with --bench",)),
    (["--bench", "--adapter-mode", "fast"], ("blocking or pipelined",)),
    (["--prompt", "hi", "--adapter", "a", "--compile"], ("--adapter with --compile",)),
])
def test_run_adapter_flags_are_checked_before_loading(base, test_gpu, args, contains):
    """A bad --adapter or --adapter-mode is one line before anything loads (no GPU needed to see it)."""
    _make(test_gpu, "--budget", "300KB", *ADAPTERS)
    result = invoke(["run", "plan.yaml", *args])
    assert_one_line_error(result.exit_code, result.stderr, contains=contains)


def test_run_adapter_flags_need_a_plan_with_adapters(base, test_gpu):
    _make(test_gpu, "--budget", "300KB")
    for args in (["--prompt", "hi", "--adapter", "a"], ["--bench", "--adapter-mode", "pipelined"]):
        result = invoke(["run", "plan.yaml", *args])
        assert_one_line_error(result.exit_code, result.stderr, contains=("the plan has no adapters",))


def test_the_plan_records_its_loading_mode_and_show_says_why(base, test_gpu):
    """make picks the mode its stream prediction says is faster, records both totals and the margin; show names
    the mode, the totals and the flag that forces the other; check passes the plan."""
    plan = _make(test_gpu, "--budget", "300KB", *ADAPTERS)["adapters"]
    totals = {"blocking": plan["blocking_stream_ms"], "pipelined": plan["pipelined_stream_ms"]}
    assert plan["mode"] == min(totals, key=lambda mode: (totals[mode], mode != "pipelined"))
    assert plan["stream_requests_per_batch"] == 2 * plan["num_slots"] and plan["stream_num_batches"] == 4
    assert plan["mode_margin"] == pytest.approx(max(totals.values()) / min(totals.values()) - 1, abs=1e-3)
    shown = " ".join(invoke(["show", "plan.yaml"]).stdout.split())
    assert f"Loading: {plan['mode']}" in shown and "--adapter-mode" in shown
    # the plan's step is 2 sequences: no forward of the stream it was priced on runs more
    assert "in 2 sequences" in shown and "in forwards of at most 2 requests (the plan's step)" in shown
    assert invoke(["check", "plan.yaml"]).exit_code == 0


def test_target_modules_may_name_dotted_suffixes(base, workdir, test_gpu):
    """PEFT matches a target by its name or a dotted suffix (self_attn.q_proj), as the planner does."""
    make_adapter(workdir / "ad" / "d", base.tensors, config={"target_modules": ["self_attn.q_proj", "v_proj"]})
    plan = _make(test_gpu, "--budget", "300KB", "--adapter", "d=ad/d", output=None)
    assert plan["adapters"]["items"][0]["target_modules"] == ["q_proj", "v_proj"]


def test_diff_names_a_change_of_loading_mode(base, test_gpu):
    """diff says when the loading mode changes, with the new plan's totals; a plan without adapters has none."""
    from dataclasses import replace

    from planner.views.diff import compare_plans, summary_sentences
    from planner.plan.file import read_plan

    _make(test_gpu, "--budget", "300KB", *ADAPTERS)
    old = read_plan("plan.yaml")
    other = "blocking" if old.adapters.mode == "pipelined" else "pipelined"
    new = replace(old, adapters=replace(old.adapters, mode=other))
    data = compare_plans(old, new)
    assert data["adapters"]["mode"] == {"old": old.adapters.mode, "new": other}
    assert f"adapters load {old.adapters.mode} -> {other}" in " ".join(summary_sentences(data))
    assert "adapters load" not in " ".join(summary_sentences(compare_plans(old, old)))
    plain = replace(old, adapters=None, inputs=replace(old.inputs, adapters=(), adapter_slots=None))
    assert compare_plans(plain, old)["adapters"]["mode"] == {"old": None, "new": old.adapters.mode}
