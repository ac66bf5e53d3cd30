"""Helpers that more than one test module uses, in one place, so that no test module imports another.

pytest's own tests/conftest.py keeps the fixtures and the checkpoint writers every suite starts from; this is an
ordinary module, imported as ``tests.helpers``, for what a few suites share: a Hugging Face cache written by hand,
the golden plans' scenarios, a copy of the test GPU profile, and what a transformers cache holds. Topic modules
beside it (runtime_models.py, plan_cli.py, adapter_models.py, config_classes.py) keep their own subjects. Nothing
here imports torch at module level, so the planner's suites import it in a planner-only install.
"""

import shutil
from pathlib import Path

import yaml

from tests.conftest import TEST_GPU_FILE, invoke, make_checkpoint

# --- a Hugging Face cache written by hand (HF_HUB_OFFLINE=1: never the network) -------------------------------------

#: the commit every hand-written cache's refs/main names
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_hub_repo(cache: Path, repo_id: str, source: Path, commit: str = HUB_COMMIT, blobs: bool = False) -> Path:
    """Lay out models--org--name/{refs/main, snapshots/<commit>/...} like huggingface_hub does; the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if blobs:  # the real layout: content in blobs/, snapshot entries are relative symlinks
            (repo / "blobs").mkdir(exist_ok=True)
            blob = repo / "blobs" / f"blob-{file.name}"
            shutil.copy(file, blob)
            (snapshot / file.name).symlink_to(f"../../blobs/{blob.name}")
        else:
            shutil.copy(file, snapshot / file.name)
    return snapshot


# --- the golden plans' scenarios (tests/contract/test_golden.py pins them byte for byte) ---------------------------

GOLDEN_MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate": 32}

#: name -> (checkpoint kwargs, extra make arguments)
GOLDEN_CASES = {
    # 723,072 bytes of weights, budget 0.5 x 1 GB: everything fits.
    "dense-fits": (dict(num_layers=8, num_shards=3), []),
    # 500 KB is less than the 723,072 bytes of weights: offload forced.
    "dense-budget": (dict(num_layers=8, num_shards=3), ["--budget", "500KB"]),
    "moe-experts": (dict(num_layers=4, num_shards=2, moe=GOLDEN_MOE), ["--params", "experts", "--budget", "300KB"]),
    "dense-pinned": (dict(num_layers=8, num_shards=3),
                     ["--group-size", "4", "--num-in-group", "2", "--prefetch-step", "1"]),
}


def make_golden_plan(workdir: Path, gpu: str, case: str, output: str = "plan.yaml") -> str:
    """The plan text make writes for golden scenario ``case`` (its checkpoint written to workdir/ckpt once)."""
    checkpoint_kwargs, extra = GOLDEN_CASES[case]
    if not (workdir / "ckpt").exists():
        make_checkpoint(workdir / "ckpt", **checkpoint_kwargs)
    result = invoke(["make", "--model", "ckpt", "--gpu", gpu, *extra, "-o", output])
    assert result.exit_code == 0, result.stderr
    assert f"wrote {output}: " in result.stderr
    return (workdir / output).read_text()


# --- GPU profiles ---------------------------------------------------------------------------------------------------


def gpu_profile(**changes) -> dict:
    """The test GPU profile as a dict, each keyword a field replaced (None: the field removed)."""
    data = yaml.safe_load(TEST_GPU_FILE.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data



def roofline_profile(folder: Path, name: str = "h100-sxm") -> str:
    """A built-in profile without its measured layer floor, written into ``folder``: tests that hold a tiny
    model's plan to the roofline's choice (a measured floor makes a tiny layer's copy free to hide)."""
    from planner.source.profile import load_profile, profile_to_dict

    data = profile_to_dict(load_profile(name))
    data.pop("layer_floor", None)
    path = folder / f"{name}-roofline.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def write_profile(path: Path, data: dict | str) -> str:
    """Write a profile (a dict as YAML, or text as it is) to ``path``; its file name."""
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path.name


# --- what a transformers cache holds --------------------------------------------------------------------------------


def cache_tensors(cache) -> list:
    """(layer, what, tensor) of every tensor a transformers cache holds."""
    import torch

    out = []
    for index, layer in enumerate(cache.layers):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                out.append((index, name, tensor))
        for name in ("conv_states", "recurrent_states"):
            for tensor in (getattr(layer, name, None) or {}).values():
                if isinstance(tensor, torch.Tensor):
                    out.append((index, name, tensor))
    return out


def transformers_cache_difference(model, cache, num_sequences: int, context: int) -> int:
    """Bytes the engines allocate that transformers does not (positive) for this cache, with the reason.

    - Sliding layers: transformers' DynamicSlidingWindowLayer keeps window - 1 tokens (the new token completes
      the window); vLLM's SlidingWindowSpec and SGLang's SWA pool size a sequence's window at ``window``.
    - Latent layers: transformers before 5.2 cached the decompressed K (heads x (nope + rope)) and V; since then
      it caches the latent as the engines do. The older layout is computed from its cached shapes.
    """
    difference = 0
    for layer in model.layers:
        if layer.kind == "sliding" and context >= layer.window_tokens:
            difference += num_sequences * layer.elements_per_token * 2
        if layer.kind == "latent":
            keys = cache.layers[layer.layer_index].keys
            if keys.shape[1] != 1:  # decompressed per-head K and V
                held = keys.numel() + cache.layers[layer.layer_index].values.numel()
                difference += num_sequences * context * layer.latent_dims * 2 - held * 2
    return difference


# --- scripts/bench_tp.py's models ------------------------------------------------------------------------------------


def tiny_bench_tp_config(name: str, vocab_size: int = 1024) -> dict:
    """The config values of bench_tp's shape ``name``, shrunk to build in a second on the CPU."""
    from scripts import bench_tp

    return dict(bench_tp.shape_config(name, tiny=True), vocab_size=vocab_size)


def seeded_prompt(batch: int):
    """A 40-token prompt per sequence on the GPU, token ids below 256 (the tiny routed MoE models' vocabulary),
    seeded by the batch size."""
    import torch

    return torch.randint(0, 256, (batch, 40), generator=torch.Generator().manual_seed(batch)).to("cuda")


def greedy_decode(model, batch: int, graphed: bool, num_steps: int, after_capture=None):
    """(ids, per-step logits), both on the CPU, of ``num_steps`` greedy decode steps after a 40-token seeded
    prompt of token ids below 256 (the tiny routed MoE models' vocabulary), eager or replayed from a captured
    graph; ``after_capture``: called after the capture (or where it would be), before the steps."""
    import torch

    from runtime.graph import DecodeLoop

    loop = DecodeLoop(model, batch=batch, max_cache_tokens=40 + num_steps + 16, device=torch.device("cuda"),
                      steps_per_call=1)
    loop.prefill(seeded_prompt(batch))
    if graphed:
        loop.capture()
    if after_capture is not None:
        after_capture()
    ids, logits = loop.generate(num_steps)
    return ids.cpu(), [out.cpu() for out in logits]
