"""runtime.skeleton.transformers_config: the transformers config run builds from config.json's mapping as the
planner parsed it is the one AutoConfig.from_pretrained builds from the file (the file is then read once per
load; tests/runtime/test_load_reads.py counts the opens)."""

import json
from pathlib import Path

import pytest

from planner.source.checkpoint import check_config
from planner.errors import ModelInputError

REPO = Path(__file__).resolve().parents[2]
#: every public config.json in the repo: dense, MoE, FP8 and MXFP4 releases, and Gemma-3's multimodal one
CONFIGS = sorted({*REPO.glob("plans/models/*/config.json"), *REPO.glob("examples/*/config.json")})


def _parsed(path: Path) -> dict:
    config = json.loads(path.read_text())
    check_config(config, str(path))
    return config


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.parent.name)
def test_the_config_built_from_the_record_is_from_pretrained_s(path):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from runtime.skeleton import transformers_config

    config = _parsed(path)
    if config["model_type"] not in CONFIG_MAPPING:  # a model this transformers does not ship: one line
        with pytest.raises(ModelInputError, match="model_type"):
            transformers_config(config, path.parent)
        return
    before = json.dumps(config, sort_keys=True)
    built = transformers_config(config, path.parent)
    expected = AutoConfig.from_pretrained(path.parent)
    assert type(built) is type(expected)
    assert built.to_dict() == expected.to_dict()
    assert json.dumps(config, sort_keys=True) == before  # the planner's mapping is left as parsed


def test_multimodal_configs_build_their_text_config():
    from runtime.skeleton import transformers_config

    path = REPO / "examples" / "gemma-3-27b-it" / "config.json"
    text = transformers_config(_parsed(path), path.parent).get_text_config()
    assert (text.model_type, text.num_hidden_layers) == ("gemma3_text", 62)


def test_mistral_with_layer_types_is_ministral_as_autoconfig_reads_it(tmp_path):
    from transformers import AutoConfig

    from runtime.skeleton import transformers_config

    config = {"model_type": "mistral", "layer_types": ["full_attention", "sliding_attention"],
              "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    built = transformers_config(config, tmp_path)
    assert built.model_type == AutoConfig.from_pretrained(tmp_path).model_type == "ministral"
    assert config["model_type"] == "mistral"


@pytest.mark.parametrize("config", [None, {"hidden_size": 64}, {"model_type": "no_such_model"},
                                    {"model_type": ["llama"]}])
def test_a_config_transformers_cannot_build_is_one_line(config, tmp_path):
    from runtime.skeleton import transformers_config

    with pytest.raises(ModelInputError) as error:
        transformers_config(config, tmp_path)
    assert "\n" not in str(error.value) and str(tmp_path) in str(error.value)
