"""runtime.step_masks: a decode step's eager attention masks made from the cache's device length, equal to the
masks transformers makes (full and sliding layers, before, at and past a ring's wrap), and a step that never
reaches transformers' mask builders or makes a tensor on the host (what a CUDA-graph capture refuses;
transformers 5.17's eager_mask does). Run on the installed transformers and on 5.17 alike."""

import sys

import pytest
import torch

from runtime.graph import DecodeLoop
from runtime.static_cache import static_cache
from runtime.step_masks import StepMasks
from tests.runtime_models import save_tiny_gemma3, save_tiny_gpt_oss

CPU = torch.device("cpu")
WINDOW = 8


def _config(family: str, dtype: torch.dtype):
    """A tiny eager-attention config: gpt-oss (sliding and full alternating), Mistral with a window (every layer
    slides), Qwen3 (every layer full) and Gemma-3 (two sliding to one full)."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16)
    if family == "gpt_oss":
        config = transformers.GptOssConfig(**common, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1)
    elif family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=WINDOW)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common)
    else:
        types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(4)]
        config = transformers.Gemma3TextConfig(**common, sliding_window=WINDOW, layer_types=types)
    config._attn_implementation = "eager"
    config.dtype = dtype
    return config


class _Model:
    """What StepMasks.for_model reads of a model: its config and its parameters' dtype."""

    def __init__(self, config, dtype):
        self.config = config
        self._weight = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def parameters(self):
        return iter([self._weight])


def _cache_at(config, cache_tokens: int, position: int, batch: int, dtype: torch.dtype):
    """A static cache (rings for sliding layers) whose every layer has seen ``position`` tokens."""
    cache = static_cache(config, cache_tokens)
    cache.early_initialization(batch, config.num_key_value_heads, config.head_dim, dtype, CPU)
    for layer in cache.layers:
        layer.cumulative_length.fill_(position)
    return cache


def _layer_types(config) -> set:
    from runtime.static_cache import layer_types_of

    return set(layer_types_of(config))


def _transformers_masks(config, cache, batch: int, dtype: torch.dtype) -> dict:
    """The masks transformers' models build for a one-token step over ``cache`` (eager: additive, of dtype), for
    each layer type the config has."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    embeds = torch.zeros(batch, 1, config.hidden_size, dtype=dtype)
    builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    # positional: 5.17 names the cache past_key_values, 5.24 cache
    return {layer_type: builders[layer_type](config, embeds, None, cache) for layer_type in _layer_types(config)}


#: the layer type each family lacks
DROPPED = {"mistral": "full_attention", "qwen3": "sliding_attention"}
# positions before the window fills, at it, one past, and past the ring's first and second wrap
POSITIONS = [0, 1, WINDOW - 2, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW - 1, 2 * WINDOW + 3, 38]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gpt_oss", "mistral", "qwen3", "gemma3"])
def test_step_masks_equal_transformers_masks(family, dtype):
    """Every layer type's mask equals transformers' own, bit for bit, at each position of a 40-token cache."""
    config = _config(family, dtype)
    batch = 3
    for position in POSITIONS:
        cache = _cache_at(config, 40, position, batch, dtype)
        masks = StepMasks.for_model(_Model(config, dtype), cache, batch, CPU)
        ours = masks.update()
        expected = _transformers_masks(config, cache, batch, dtype)
        if not isinstance(ours, dict):  # one layer type: one 4-D mask
            assert len(expected) == 1
            ours = {next(iter(expected)): ours}
        assert set(ours) == set(expected) == {"sliding_attention", "full_attention"} - {DROPPED.get(family)}
        for layer_type, mask in ours.items():
            assert mask.dtype == dtype and mask.shape == expected[layer_type].shape, (layer_type, position)
            assert torch.equal(mask, expected[layer_type]), (family, layer_type, position)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_a_cache_shorter_than_the_window(family):
    """A cache of 5 tokens under a window of 8: the ring holds 5 slots, and the masks still equal transformers'."""
    config = _config(family, torch.float32)
    for position in range(5):
        cache = _cache_at(config, 5, position, 2, torch.float32)
        ours = StepMasks.for_model(_Model(config, torch.float32), cache, 2, CPU).update()
        expected = _transformers_masks(config, cache, 2, torch.float32)
        assert all(torch.equal(mask, expected[layer_type]) for layer_type, mask in ours.items()), position


def test_sdpa_models_keep_transformers_masks(tmp_path):
    """Gemma-3 under SDPA (its default) builds its own boolean masks on the device, capturable on 5.17 and 5.24:
    the loop leaves them alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(save_tiny_gemma3(tmp_path)), attn_implementation="sdpa")
    assert DecodeLoop(model, batch=2, max_cache_tokens=16, device=CPU, steps_per_call=1).step_masks is None


# --- the step never builds a mask on the host -----------------------------------------------------------------

class HostTensorMade(AssertionError):
    """What the guarded calls raise."""


MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "sdpa_mask", "eager_mask")


def guard_host_tensors(monkeypatch) -> None:
    """Make transformers' mask builders (wherever a module imported them) and host tensor constructors raise."""
    import transformers.masking_utils as masking_utils

    originals = {name: getattr(masking_utils, name) for name in MASK_BUILDERS if hasattr(masking_utils, name)}

    def refuse(name):
        def raiser(*args, **kwargs):
            raise HostTensorMade(f"{name} called in a decode step")
        return raiser

    for module in [module for name, module in sys.modules.items() if name.startswith("transformers")]:
        for name, original in originals.items():
            if vars(module).get(name) is original:  # vars: a lazy module's getattr would import its submodules
                monkeypatch.setattr(module, name, refuse(name))
    for name in ("tensor", "as_tensor", "scalar_tensor"):
        monkeypatch.setattr(torch, name, refuse(f"torch.{name}"))
    monkeypatch.setattr(torch.Tensor, "item", refuse("Tensor.item"))


def _loop(path, dtype, attn="eager"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn).eval()
    loop = DecodeLoop(model, batch=2, max_cache_tokens=24, device=CPU, steps_per_call=2)
    prompt = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(4))
    loop.prefill(prompt)
    return loop


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_the_step_body_builds_no_mask_and_no_host_tensor(family, tmp_path, monkeypatch):
    """The body a replay runs (two steps, crossing the ring's wrap) calls none of transformers' mask builders and
    makes no tensor from host values; without the step masks the same guard trips (the model builds its own)."""
    path = {"gemma3": save_tiny_gemma3, "gpt_oss": save_tiny_gpt_oss}[family](tmp_path)
    loop = _loop(path, torch.float32)
    assert loop.step_masks is not None
    saved = loop.save_state()
    with monkeypatch.context() as guarded:
        guard_host_tensors(guarded)
        for _ in range(4):
            loop.step()
    loop.restore_state(saved)
    loop.step_masks = None
    with monkeypatch.context() as guarded, pytest.raises(HostTensorMade):
        guard_host_tensors(guarded)
        loop.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_steps_with_step_masks_equal_transformers_masks_bitwise(family, dtype, tmp_path):
    """Decode past the window with the loop's masks and with the masks the model builds itself: the same ids and
    logits bit for bit."""
    saver = {"gemma3": save_tiny_gemma3, "gpt_oss": save_tiny_gpt_oss}[family]
    path = saver(tmp_path, dtype=dtype)
    ours = _loop(path, dtype).generate(12)
    theirs_loop = _loop(path, dtype)
    theirs_loop.step_masks = None
    theirs = theirs_loop.generate(12)
    assert torch.equal(ours[0], theirs[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_the_measure_model_of_the_gpt_oss_point_takes_the_step_masks(tmp_path, monkeypatch):
    """make --measure's graphed timing (runtime.measure._time_graphed) decodes the measure model, one layer per
    kind and aliases elsewhere: bench_serving's gpt-oss point, narrowed, gets the step masks there too, and its
    steps make no host tensor."""
    import json

    from runtime.measure import build_measure_model
    from scripts import bench_serving

    point = bench_serving.POINTS["gpt-oss-16g-8k"]
    config = json.loads(bench_serving.point_config(point, tmp_path).read_text())
    config.update(hidden_size=64, intermediate_size=64, head_dim=16, vocab_size=512, pad_token_id=0,
                  num_key_value_heads=1, num_attention_heads=8)
    kinds = (tuple(range(0, 12, 2)), tuple(range(1, 12, 2)))  # sliding, full
    model = build_measure_model(config, kinds, "model.layers", device="cpu")
    loop = DecodeLoop(model, batch=2, max_cache_tokens=300, device=CPU, steps_per_call=1)
    loop.fill(200)
    assert loop.step_masks is not None
    with monkeypatch.context() as guarded:
        guard_host_tensors(guarded)
        ids, logits = loop.generate(3)
    assert ids.shape == (2, 3) and all(torch.isfinite(step.float()).all() for step in logits)
