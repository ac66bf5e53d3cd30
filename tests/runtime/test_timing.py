"""runtime.timing: the random inputs, forward step and CUDA-event timer that run --bench, serving, the decode
loop and the benchmarks share."""

from types import SimpleNamespace

import pytest
import torch

from runtime.timing import forward_step, random_ids, time_calls


def _model_of_vocab(vocab_size: int):
    return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=vocab_size)))


def test_random_ids_are_reproducible_and_in_the_vocabulary():
    model = _model_of_vocab(7)
    ids = random_ids(model, (3, 50), torch.device("cpu"), seed=4)
    assert ids.shape == (3, 50) and ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 7
    assert torch.equal(ids, random_ids(model, (3, 50), torch.device("cpu"), seed=4))
    assert not torch.equal(ids, random_ids(model, (3, 50), torch.device("cpu"), seed=5))


def test_forward_step_keeps_the_last_tokens_logits():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = random_ids(model, (2, 5), torch.device("cpu"))
    with torch.inference_mode():
        logits = forward_step(model, ids)
        full = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (2, 1, 64)
    torch.testing.assert_close(logits, full[:, -1:], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_calls_times_each_call():
    calls = []
    step_ms = time_calls(lambda: calls.append(torch.ones(256, 256, device="cuda") @ torch.ones(256, 256,
                                                                                             device="cuda")), 4)
    assert len(step_ms) == 4 == len(calls) and all(ms >= 0 for ms in step_ms)


def _plan_with_layers(*regimes: str):
    rows = tuple(SimpleNamespace(routed=regime == "routed") for regime in regimes)
    return SimpleNamespace(experts=SimpleNamespace(layers=rows) if regimes else None)


def test_a_routed_plans_steps_are_held_as_their_mean_over_more_steps():
    """A plan that fetches routed experts predicts the expected step over the routing: its steps are timed longer
    and summed by their mean (whole experts make the times jump, and a median of few picks one of the jumps);
    a dense, whole-layer or all-resident plan keeps the median of the default count."""
    from runtime.timing import NUM_TIMED_ROUTED_STEPS, step_figure, timed_step_count

    steps = [10.0, 10.0, 10.0, 24.0, 31.0]
    routed = _plan_with_layers("whole_layer", "routed")
    assert step_figure(routed, steps) == (pytest.approx(17.0), "mean")
    assert timed_step_count(routed, 10) == NUM_TIMED_ROUTED_STEPS > 10
    for plan in (_plan_with_layers(), _plan_with_layers("whole_layer", "whole_layer")):
        assert step_figure(plan, steps) == (10.0, "median")
        assert timed_step_count(plan, 10) == 10
