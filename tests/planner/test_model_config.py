"""planner.model.model_config: config.json parsed once into the model record, defaults applied as transformers applies
them, the context limit as vLLM computes it, and the record checked against the checkpoint's tensors."""

import json

import pytest

from planner.errors import ModelInputError
from planner.model.model_config import check_against_tensors, context_limit, model_config, text_config
from tests.conftest import REPO_ROOT, assert_one_line_error, invoke, make_checkpoint


def _public(name: str) -> dict:
    for folder in ("examples", "plans/models"):
        path = REPO_ROOT / folder / name / "config.json"
        if path.is_file():
            return json.loads(path.read_text())
    raise FileNotFoundError(name)


def test_gemma3_text_config_resolved_with_transformers_defaults():
    """Gemma-3-27B's public config nests the language model and names no vocab_size: Gemma3TextConfig's
    262,208 applies, and the top-level torch_dtype reaches the language model."""
    record = model_config(_public("gemma-3-27b-it"))
    assert record.multimodal and record.model_type == "gemma3_text" and record.outer_model_type == "gemma3"
    assert (record.hidden_size, record.num_layers, record.num_heads, record.num_kv_heads, record.head_dim) == (
        5376, 62, 32, 16, 128)
    assert record.vocab_size == 262_208 and record.dtype == "bfloat16" and record.sliding_window_tokens == 1024
    # Gemma-3's max_position_embeddings is already the linearly scaled length (vLLM does not multiply it)
    assert record.context.max_tokens == 131_072


@pytest.mark.parametrize("name, tokens, source", [
    ("deepseek-v3", 163_840, "original_max_position_embeddings 4096 x rope_scaling yarn factor 40"),
    ("gpt-oss-120b", 131_072, "original_max_position_embeddings 4096 x rope_scaling yarn factor 32"),
    ("qwen3-30b-a3b", 40_960, "max_position_embeddings 40960"),
    ("llama-3.1-70b", 131_072, "max_position_embeddings 131072"),  # rope type llama3: positions already extended
    ("mixtral-8x7b", 32_768, "max_position_embeddings 32768"),
])
def test_context_limit_as_vllm_computes_it(name, tokens, source):
    limit = model_config(_public(name)).context
    assert (limit.max_tokens, limit.source) == (tokens, source)


def test_linear_rope_scaling_multiplies_and_no_positions_means_no_limit():
    scaled = context_limit({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert scaled.max_tokens == 8192 and "linear factor 2" in scaled.source
    assert context_limit({"n_positions": 1024, "max_position_embeddings": 2048}).max_tokens == 1024
    assert context_limit({"hidden_size": 8}) is None


def test_quantization_configs():
    fp8 = model_config(_public("deepseek-v3")).quantization
    assert (fp8.method, fp8.weight_block, fp8.known) == ("fp8", (128, 128), True)
    mxfp4 = model_config(_public("gpt-oss-120b")).quantization
    assert mxfp4.method == "mxfp4" and "lm_head" in mxfp4.not_converted
    assert model_config(_public("mixtral-8x7b")).quantization is None
    assert not model_config({"quantization_config": {"quant_method": "awq"}}).quantization.known
    for bad in ({"bits": 4}, {"quant_method": "fp8", "weight_block_size": [128]}, "fp8"):
        with pytest.raises(ModelInputError, match="quantization_config"):
            model_config({"quantization_config": bad})


def test_text_config_of_text_only_configs_is_the_config_itself():
    config = {"model_type": "llama", "hidden_size": 8}
    assert text_config(config) is config and text_config(None) == {}
    assert text_config({"model_type": ["x"], "text_config": {"hidden_size": 8}}) == {"hidden_size": 8}


@pytest.mark.parametrize("field, value, words", [
    ("embedding_width", 128, "hidden_size is 64 but the embedding is 128 wide"),
    ("num_stack_layers", 3, "says 4 layers but the checkpoint's stack has 3"),
    ("num_experts_present", 6, "says 8 experts but the checkpoint's layers hold 6"),
])
def test_cross_check_against_tensors(field, value, words):
    record = model_config({"hidden_size": 64, "num_hidden_layers": 4, "num_experts": 8})
    figures = {"embedding_width": 64, "num_stack_layers": 4, "num_experts_present": 8, field: value}
    with pytest.raises(ModelInputError, match=words):
        check_against_tensors(record, source="ckpt", **figures)
    check_against_tensors(record, source="ckpt", embedding_width=64, num_stack_layers=5, num_experts_present=8)


@pytest.mark.parametrize("edit, words", [
    ({"hidden_size": 32}, "hidden_size is 32 but the embedding is 64 wide"),
    ({"num_hidden_layers": 6}, "says 6 layers but the checkpoint's stack has 4"),
])
def test_make_refuses_a_config_unlike_its_tensors(tmp_path, test_gpu, edit, words):
    folder = make_checkpoint(tmp_path / "ckpt", num_layers=4, hidden=64, extra_config=edit).path
    result = invoke(["make", "--model", folder, "--gpu", test_gpu, "--budget", "1MB"])
    assert_one_line_error(result.exit_code, result.stderr, result.stdout, contains=(words,))


def test_make_refuses_experts_unlike_the_checkpoint(tmp_path, test_gpu):
    folder = make_checkpoint(tmp_path / "ckpt", num_layers=2, moe={"num_experts": 4, "top_k": 2},
                             extra_config={"num_experts": 6}).path
    result = invoke(["make", "--model", folder, "--gpu", test_gpu, "--budget", "1MB"])
    assert_one_line_error(result.exit_code, result.stderr, result.stdout,
                          contains=("says 6 experts but the checkpoint's layers hold 4",))


def test_context_beyond_the_model_is_one_line_naming_the_limit(tmp_path, test_gpu):
    folder = make_checkpoint(tmp_path / "ckpt", num_layers=2,
                             extra_config={"max_position_embeddings": 2048,
                                           "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 1024}}).path
    args = ["make", "--model", folder, "--gpu", test_gpu, "--concurrency", "2"]
    result = invoke([*args, "--context", "4097"])
    assert_one_line_error(result.exit_code, result.stderr, result.stdout, contains=(
        "--context 4097 is beyond the model's 4096 tokens",
        "original_max_position_embeddings 1024 x rope_scaling yarn factor 4"))
    assert invoke([*args, "--context", "4096"]).exit_code == 0


def test_ernie_moe_names_its_top_k_moe_k():
    """Ernie 4.5's MoE config writes its top-k as moe_k and its expert count as moe_num_experts (transformers'
    Ernie4_5_MoeConfig, as ERNIE-4.5-21B-A3B's config.json): read as 6 of 64, not a default top-k."""
    import transformers

    written = json.loads(transformers.Ernie4_5_MoeConfig(moe_k=6, moe_num_experts=64).to_json_string(use_diff=False))
    record = model_config(written)
    assert (record.num_experts, record.top_k) == (64, 6)


def test_a_mistral_config_silent_on_its_window_gets_mistral_configs():
    """transformers' MistralConfig attends over a 4096-token window where config.json names none, so the cache and
    the step are planned over it; a config that states null (Mistral-Nemo) keeps full attention."""
    silent = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 512,
              "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024}
    assert model_config(silent).sliding_window_tokens == 4096
    assert model_config({**silent, "sliding_window": None}).sliding_window_tokens is None
