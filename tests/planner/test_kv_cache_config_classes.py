"""planner.model.kv_cache held to transformers' own caches over every decoder architecture the installed transformers
ships as a config class (tests.config_classes): the tiny model runs a prompt on the CPU with a DynamicCache, and
the bytes of every tensor the cache holds equal the planner's cache_bytes, less the differences stated in
tests.planner.test_kv_cache (sliding windows: transformers keeps window - 1 tokens); or the planner refuses the
cache in one line that names its kind. Sliding windows are cut to WINDOW_TOKENS so the prompt passes them.

    PYTHONPATH=. python3 -m tests.planner.test_kv_cache_config_classes   # the outcome of each class
"""

import sys

import pytest

from planner.errors import ModelInputError
from planner.model.kv_cache import kv_cache_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.config_classes import causal_lm_model_types, tiny_config, written  # noqa: E402
from tests.helpers import cache_tensors, transformers_cache_difference  # noqa: E402

WINDOW_TOKENS = 4
PROMPT_TOKENS = 6
NUM_SEQUENCES = 2


class NotRun(Exception):
    """transformers does not build or run the tiny config (its own checks refuse the sizes)."""


def _cache_of(config):
    """The DynamicCache transformers fills over a prompt of PROMPT_TOKENS tokens, in bf16."""
    from transformers import AutoModelForCausalLM

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        ids = torch.randint(1, 100, (NUM_SEQUENCES, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=True).past_key_values
    except Exception as error:  # noqa: BLE001 - transformers' own refusal of the tiny sizes, whatever its type
        raise NotRun(f"{type(error).__name__}: {str(error)[:160]}") from None


def compare(model_type: str) -> str:
    """"equal (N bytes)", "refused: LINE" or "not run: WHY"; an AssertionError where the bytes differ."""
    try:
        config = tiny_config(model_type, window_tokens=WINDOW_TOKENS, tiny_only=True)
    except Exception as error:  # noqa: BLE001 - the class's own checks refuse the tiny sizes
        return f"not run: {type(error).__name__}: {str(error)[:160]}"
    text = {**written(config), "dtype": "bfloat16"}
    try:
        planned = kv_cache_model(text)
    except ModelInputError as error:
        line = str(error)
        assert "\n" not in line, line
        return f"refused: {line}"
    try:
        cache = _cache_of(config)
    except NotRun as error:
        return f"not run: {error}"
    tensors = cache_tensors(cache) if hasattr(cache, "layers") else []
    held = sum(t.numel() * t.element_size() for _, _, t in tensors)
    expected = planned.cache_bytes(num_sequences=NUM_SEQUENCES, context_tokens=PROMPT_TOKENS, kv_dtype="auto")
    difference = transformers_cache_difference(planned, cache, NUM_SEQUENCES, PROMPT_TOKENS) if tensors else 0
    assert held + difference == expected, (model_type, held, difference, expected, type(cache).__name__,
                                           [(i, n, tuple(t.shape)) for i, n, t in tensors][:6])
    return f"equal ({expected} bytes)"


@pytest.mark.parametrize("model_type", causal_lm_model_types())
def test_the_cache_model_is_transformers_cache_or_a_named_refusal(model_type):
    outcome = compare(model_type)
    if outcome.startswith("not run"):
        pytest.skip(outcome)


def main() -> None:
    for model_type in sys.argv[1:] or causal_lm_model_types():
        try:
            print(model_type, "|", compare(model_type), flush=True)
        except AssertionError as error:
            print(model_type, "| DIFFERS", str(error)[:400], flush=True)


if __name__ == "__main__":
    main()
