"""FP8 block-quantized checkpoints on a CUDA GPU (issue 23): run's loader with offloaded layers against the
all-resident FP8 model, prefill and graphed decode, bit for bit; the link carries the FP8 pieces.

Skipped without a GPU (CI); run on the device: PYTHONPATH=. python3 -m pytest -q tests/runtime/test_quantized_gpu.py
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.backend import CudaBackend  # noqa: E402
from runtime.load import stream_model  # noqa: E402
from tests.runtime_models import plan_with  # noqa: E402
from tests.runtime.test_quantized import TINY_FP8_CONFIG, resident_plan, write_fp8_checkpoint  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: 128x128 blocks (the released format) on layers of a few MB, so a copy is still in flight when compute starts
GPU_FP8_CONFIG = dict(TINY_FP8_CONFIG, hidden_size=1024, intermediate_size=3072, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=128, num_hidden_layers=7,
                      quantization_config=dict(TINY_FP8_CONFIG["quantization_config"], weight_block_size=[128, 128]))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8-gpu"), GPU_FP8_CONFIG)


def _load(checkpoint, plan):
    return stream_model(checkpoint, plan, CudaBackend(torch.device("cuda")))


def _prefill(model) -> list[torch.Tensor]:
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.inference_mode():
        return [model(ids).logits.cpu() for _ in range(3)]


@pytest.fixture(scope="module")
def reference(fp8_checkpoint):
    model, engine = _load(fp8_checkpoint, resident_plan(fp8_checkpoint))
    assert engine.offloaded == ()
    logits = _prefill(model)[0]
    decoded = {graphed: _decode(model, None, graphed) for graphed in (False, True)}  # each computed the same way
    engine.close()
    return logits, decoded


def _decode(model, engine, graphed: bool = False):
    from runtime.graph import DecodeLoop, cache_tokens_for

    loop = DecodeLoop(model, batch=2, max_cache_tokens=cache_tokens_for(64), device=torch.device("cuda"),
                      engine=engine, steps_per_call=1)
    prompt = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2)).cuda()
    loop.prefill(prompt)
    if graphed:
        loop.capture()
    ids, logits = loop.generate(6)
    return ids.cpu(), [out.cpu() for out in logits]


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 2), (7, 5, 2), (3, 2, 1)])
def test_fp8_prefill_bitwise_equal_to_all_resident_on_gpu(fp8_checkpoint, reference, shape):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    plan = plan_with(fp8_checkpoint, *shape)
    model, engine = _load(fp8_checkpoint, plan)
    q_proj = model.model.layers[plan.offload.layers[0]].self_attn.q_proj
    assert isinstance(q_proj, FP8Linear) and q_proj.weight.dtype == torch.float8_e4m3fn
    assert q_proj.weight.device.type == "cuda" and q_proj.weight_scale_inv.dtype == torch.float32
    outputs = _prefill(model)
    stored = sum(plan.layers[i].offloaded_bytes for i in plan.offload.layers)
    packed = sum(sum(item.num_bytes for item in layout) for layout in engine.layouts)
    engine.close()
    assert all(torch.equal(out, reference[0]) for out in outputs)
    assert packed == stored  # the pieces hold the stored FP8 bytes and scales, nothing widened
    assert packed <= engine.copy_bytes_per_step <= sum(engine.layer_bytes)


@pytest.mark.parametrize("graphed", [False, True])
def test_fp8_decode_bitwise_equal_to_all_resident_on_gpu(fp8_checkpoint, reference, graphed):
    # a graphed plan is made for decode steps: one new token per sequence of the loop's batch of 2
    batch = {"tokens": 2, "sequences": 2} if graphed else {}
    plan = plan_with(fp8_checkpoint, 3, 2, 1, cuda_graph=graphed, **batch)
    model, engine = _load(fp8_checkpoint, plan)
    ids, logits = _decode(model, engine, graphed=graphed)
    engine.close()
    expected_ids, expected_logits = reference[1][graphed]
    assert torch.equal(ids, expected_ids)
    assert all(torch.equal(a, b) for a, b in zip(logits, expected_logits))
