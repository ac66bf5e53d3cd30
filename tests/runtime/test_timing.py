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
