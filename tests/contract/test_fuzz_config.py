"""Fuzz regressions, class: a config file's field of the wrong type, out of range, or against the tensors and the
other fields it describes: config.json read by make, header-checkpoint (which takes make's bounds) and trace, and an
adapter's adapter_config.json against the model.
"""

import pytest

from tests.fuzz import BASE_ARGS
from tests.fuzz.adapters import ADAPTER_CONFIG, adapter_files
from tests.fuzz.regression import CONFIG, Refusal, assert_refused, config_file, json_file, make_args

SERVING = ("--context", "64", "--concurrency", "8")
HEADER_CHECKPOINT = ["header-checkpoint", "config.json", "hc"]
TRACE = ["trace", "--model", "ckpt", "--prompts", "prompts.txt"]


def _root_config(edit) -> dict:
    """config.json beside the base files, for header-checkpoint, edited in place by ``edit``."""
    return config_file(edit, path="config.json")


def _text_config_layers(config: dict) -> None:
    """A text_config that repeats the config but for its number of layers."""
    config.update(text_config={**{k: v for k, v in config.items() if k != "architectures"}, "num_hidden_layers": 5})


# name -> the refusal
CASES = {
    # issue 16: KeyError and TypeError in _model_section; TypeError in geometry_from_config; OverflowError in
    # layer_cost; a hang on huge geometry
    "config-architectures-mapping": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(architectures={"a": 1})),
                                            "architectures is"),
    "config-architectures-number": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(architectures=5)),
                                           "architectures is"),
    "config-hidden-size-text": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(hidden_size="x")),
                                       "hidden_size is 'x'"),
    "config-huge-head-dim": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(head_dim=10**20)),
                                    "head_dim is"),
    "config-huge-layers": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(num_hidden_layers=10**18)),
                                  "num_hidden_layers is"),
    "config-bool-heads": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(num_attention_heads=True)),
                                 "num_attention_heads is True"),
    "config-nan-hidden": Refusal(make_args(), json_file(CONFIG, raw=b'{"hidden_size": NaN}'), "hidden_size is nan"),
    "config-text-config-not-object": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(text_config=5)),
                                             "text_config is 5"),
    "config-top-k-above-experts": Refusal(make_args(), json_file(CONFIG, lambda d: d.update(num_experts_per_tok=9),
                                                                 moe=True), "routes each token to 9 experts"),
    # issue 25: fields of the wrong JSON type
    "model-type-list": Refusal([*BASE_ARGS, *SERVING], config_file(lambda c: c.update(model_type=["llama"])),
                               "model_type is"),
    "shared-expert-string": Refusal([*BASE_ARGS, *SERVING], config_file(
        lambda c: c.update(shared_expert_intermediate_size="8"), moe=True), "shared_expert_intermediate_size"),
    "shared-expert-negative": Refusal([*BASE_ARGS, *SERVING], config_file(lambda c: c.update(n_shared_experts=-1),
                                                                          moe=True), "n_shared_experts"),
    # issue 39: header-checkpoint takes make's bounds
    "hc-text-config-string": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(text_config="x")),
                                     "text_config"),
    "hc-text-config-list": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(text_config=[1])),
                                   "text_config"),
    "hc-vocab-1e13": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(vocab_size=10**13)), "vocab_size"),
    "hc-hidden-2-31": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(hidden_size=2**31)), "hidden_size"),
    "hc-million-layers": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(num_hidden_layers=1_000_000)),
                                 "num_hidden_layers"),
    "hc-zero-heads": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(num_attention_heads=0)),
                             "num_attention_heads"),
    "hc-negative-head-dim": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(head_dim=-4)), "head_dim"),
    "hc-tie-no": Refusal(HEADER_CHECKPOINT, _root_config(lambda c: c.update(tie_word_embeddings="no")),
                         "tie_word_embeddings"),
    # issue 39: fields against the tensors they describe, and against each other
    "kv-heads-half-of-k-proj": Refusal([*BASE_ARGS], config_file(lambda c: c.update(num_key_value_heads=2)),
                                       "KV heads"),
    "quant-fp8-over-bf16": Refusal([*BASE_ARGS], config_file(
        lambda c: c.update(quantization_config={"quant_method": "fp8"})), "F8_E4M3"),
    "text-config-layers-disagree": Refusal([*BASE_ARGS], config_file(_text_config_layers), "num_hidden_layers"),
    "adapter-layers-to-transform": Refusal([*BASE_ARGS, "--adapter", "a=ad"], adapter_files(
        {**ADAPTER_CONFIG, "layers_to_transform": [0, 1]}), "layers_to_transform"),
    "adapter-layers-to-transform-junk": Refusal([*BASE_ARGS, "--adapter", "a=ad"], adapter_files(
        {**ADAPTER_CONFIG, "layers_to_transform": "all"}), "layers_to_transform"),
    # issue 39: fields read for their type
    "make-tie-no": Refusal([*BASE_ARGS], config_file(lambda c: c.update(tie_word_embeddings="no")),
                           "tie_word_embeddings"),
    "make-layer-types-longer": Refusal([*BASE_ARGS], config_file(
        lambda c: c.update(layer_types=["full_attention"] * 7)), "layer_types"),
    # issue 39: trace reads the model folder's config before it loads the model
    "trace-no-model-type": Refusal([*TRACE, "--device", "cpu"], {"prompts.txt": b"hello world\n"}, "model_type",
                                   moe=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_refused(name):
    assert_refused(name, CASES[name])
