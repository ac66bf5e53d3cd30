"""run --prompt --adapter NAME: greedy generation with one of the plan's adapters equals PEFT's, token for token,
on the CPU stand-in (the loader's model, half its layers offloaded) and, marked gpu, on CUDA."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from tests.adapter_models import peft_reference, save_random_adapters  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NUM_NEW_TOKENS = 64
NAMES = ["sql", "chat", "code"]


@pytest.fixture(scope="module")
def checkpoint_and_plan(tmp_path_factory):
    """A tiny Qwen3 checkpoint (random bf16 weights), three random rank-8 adapters on every linear layer, and a
    plan offloading half its layers with them (make --adapter)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    work = tmp_path_factory.mktemp("generate")
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for param in base.parameters():
            param.normal_(0.0, 0.05).add_(1.0 if param.dim() == 1 else 0.0)
    base.save_pretrained(work / "ckpt")
    folders = save_random_adapters(base, work / "adapters", NAMES, rank=8, scale=0.1)
    args = [sys.executable, "-m", "offload_plan", "make", "-m", str(work / "ckpt"), "-g", "h100-sxm", "--budget",
            "60GiB", "--tokens", "16", "--group-size", "2", "--num-in-group", "1", "--prefetch-step", "1",
            "-o", str(work / "plan.yaml")]
    for name, folder in folders.items():
        args += ["--adapter", f"{name}={folder}"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return work, folders


def _greedy(model, prompt: torch.Tensor) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids=prompt, max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _served_tokens(work: Path, name: str | None, prompt: torch.Tensor, backend=None) -> list[int]:
    """The loader's model (offloaded layers streamed by the engine), the adapter attached as run attaches it."""
    from planner.plan.file import read_plan
    from runtime.adapters import attach_adapter
    from tests.runtime_models import stream_on_cpu

    plan = read_plan(work / "plan.yaml")
    assert plan.offload.layers  # the adapter's copies share the engine's link with offloaded weights
    model, engine = stream_on_cpu(work / "ckpt", plan, backend=backend)
    if name is None:
        return _greedy(model, prompt)
    pool, hooks = attach_adapter(model, plan, engine.backend, name, work / "plan.yaml")
    try:
        return _greedy(model, prompt)
    finally:
        hooks.remove()
        pool.close()


def test_generation_with_an_adapter_equals_peft(checkpoint_and_plan):
    from runtime.backend import CpuStandIn
    from runtime.load import build_model

    work, folders = checkpoint_and_plan
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    reference = peft_reference(build_model(str(work / "ckpt"), None), folders)
    base_tokens = _served_tokens(work, None, prompt)
    outputs = set()
    for name in NAMES:
        reference.set_adapter(name)
        expected = _greedy(reference, prompt)
        # lazy copies: the adapter's copy lands only when waited for, so a missing wait would show
        got = _served_tokens(work, name, prompt, backend=CpuStandIn(lazy_copies=True))
        assert len(got) == NUM_NEW_TOKENS and got == expected, name
        outputs.add(tuple(got))
    # each adapter gives its own tokens, none the base model's: the check above is not vacuous
    assert len(outputs) == len(NAMES) and tuple(base_tokens) not in outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generation_with_an_adapter_equals_peft_on_the_gpu(checkpoint_and_plan):
    """On CUDA: the plan loaded as run loads it (offloaded layers on the copy stream), the adapter attached as
    run --prompt --adapter attaches it, greedy tokens against PEFT's over the all-resident model on the GPU."""
    from planner.plan.file import read_plan
    from runtime.adapters import attach_adapter
    from runtime.load import build_model, load_with_plan

    work, folders = checkpoint_and_plan
    plan = read_plan(work / "plan.yaml")
    loaded = load_with_plan(plan, str(work / "ckpt"))
    prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)).cuda()
    reference = peft_reference(build_model(str(work / "ckpt"), None).cuda(), folders)
    for name in NAMES:
        reference.set_adapter(name)
        expected = _greedy(reference, prompt)
        pool, hooks = attach_adapter(loaded.model, plan, loaded.engine.backend, name, work / "plan.yaml")
        try:
            got = _greedy(loaded.model, prompt)
        finally:
            hooks.remove()
            pool.close()
        assert len(got) == NUM_NEW_TOKENS and got == expected, name


def test_unknown_adapter_is_one_line_listing_the_plans(checkpoint_and_plan):
    from tests.conftest import assert_one_line_error

    work, _ = checkpoint_and_plan
    proc = subprocess.run([sys.executable, "-m", "offload_plan", "run", str(work / "plan.yaml"), "--prompt", "hi",
                           "--adapter", "sq1"], capture_output=True, text=True, cwd=REPO)
    assert_one_line_error(proc.returncode, proc.stderr, contains=("sq1", "chat, code, sql"))


def test_the_runtime_reads_the_plans_adapters_section(checkpoint_and_plan):
    """The pool is filled from the adapters section's rows (name, source, revision), not from the make flags the
    plan echoes in inputs.adapters: handed the section alone (no inputs), every adapter loads, from its row's
    folder."""
    from types import SimpleNamespace

    from planner.plan.file import read_plan
    from runtime.adapters import load_pool, plan_adapter_folder
    from runtime.backend import CpuStandIn
    from runtime.load import build_model

    work, folders = checkpoint_and_plan
    plan = read_plan(work / "plan.yaml")
    plan = SimpleNamespace(adapters=plan.adapters)  # no inputs section to read NAME=PATH flags from
    assert {row.name: plan_adapter_folder(row, work / "plan.yaml") for row in plan.adapters.items} == folders
    pool, hooks = load_pool(build_model(str(work / "ckpt"), None), plan, CpuStandIn(), work / "plan.yaml")
    try:
        assert sorted(pool.layouts) == sorted(NAMES)
    finally:
        hooks.remove()
        pool.close()
