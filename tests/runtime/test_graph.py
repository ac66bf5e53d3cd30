"""runtime.graph.DecodeLoop's static cache allocated before the first step, for every attention kind it serves."""

import torch

from runtime.graph import DecodeLoop


def test_a_latent_attention_cache_is_allocated_at_its_two_widths_and_decodes():
    """DeepSeek-V2's attention caches the compressed latent as keys and the rope key as values: allocated up
    front at those widths, a prefill and decode steps run over it and equal a growing cache's logits."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    config = DeepseekV2Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    loop = DecodeLoop(model, batch=2, max_cache_tokens=24, device=torch.device("cpu"), steps_per_call=1)
    assert [tuple(layer.keys.shape) for layer in loop.cache.layers] == [(2, 1, 24, 16)] * 2
    assert [tuple(layer.values.shape) for layer in loop.cache.layers] == [(2, 1, 24, 4)] * 2
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    loop.prefill(prompt)
    ids, logits = loop.generate(3)
    with torch.inference_mode():
        grown = model(input_ids=torch.cat([prompt, ids[:, :3]], dim=1)).logits[:, -1, :]
    assert torch.allclose(grown, logits[-1], atol=1e-5)


def test_an_op_the_capture_forbids_is_one_line(monkeypatch):
    """A model whose step does what a CUDA-graph capture forbids (transformers 5.17's eager attention mask copies a
    CPU scalar to the GPU each step) gets one line naming the model and the way out; running out of memory is
    left to the caller's handling."""
    import contextlib

    import pytest

    from planner.errors import RuntimeUnavailableError
    from runtime.graph import capture_steps

    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **options: contextlib.nullcontext())

    def forbidden():
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                           "tensor is pinned.\nsecond line")

    with pytest.raises(RuntimeUnavailableError) as caught:
        capture_steps(object(), forbidden, "GptOssForCausalLM")
    message = str(caught.value)
    assert "\n" not in message and len(message) <= 300
    assert "GptOssForCausalLM" in message and "--cuda-graph" in message and "second line" not in message

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        capture_steps(object(), out_of_memory, "GptOssForCausalLM")
