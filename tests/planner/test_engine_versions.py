"""planner.engines.versions: the pinned releases' accepted flags and wiring, and what export takes from them
(the block size vLLM's MLA backends take, the version picked by --engine-version)."""

import json

import pytest

from planner.engines.versions import ENGINE_VERSIONS, MLA_ARCHITECTURES, FlagSpec, engine_version, split_flags
from planner.errors import UsageError
from tests.conftest import invoke, make_checkpoint
from tests.plan_cli import MOE, cli_make


def test_the_newest_pinned_version_is_the_default():
    assert engine_version("vllm").version == "0.33.0" and engine_version("sglang").version == "0.5.23"
    assert engine_version("vllm", "0.33.0") is ENGINE_VERSIONS["vllm"][-1]
    with pytest.raises(UsageError, match="pins sglang 0.5.23"):
        engine_version("sglang", "0.4.0")


def test_every_pinned_flag_names_its_source_and_a_known_kind():
    for versions in ENGINE_VERSIONS.values():
        for version in versions:
            assert version.wheel.startswith(f"{version.engine}-{version.version}-")
            flags = [spec.flag for spec in version.flags]
            assert len(flags) == len(set(flags)) and all(flag.startswith("--") for flag in flags)
            assert all(spec.source.startswith(version.engine) for spec in version.flags)
    with pytest.raises(ValueError, match="FlagSpec.kind"):
        FlagSpec(flag="--x", kind="bool", source="x")


def test_sglang_wires_its_prefetch_offloader_for_deepseek_only():
    sglang, vllm = engine_version("sglang"), engine_version("vllm")
    assert sglang.prefetch_wired("DeepseekV3ForCausalLM") and not sglang.prefetch_wired("LlamaForCausalLM")
    assert sglang.read_at_use_wired("LlamaForCausalLM") and sglang.spec("--offload-param-names") is None
    assert vllm.prefetch_wired("LlamaForCausalLM") and vllm.spec("--offload-params") is not None
    assert sglang.spec("--cpu-offload-gb").kind == "int"  # SGLang's field is an int: whole GiB


def test_split_flags():
    assert split_flags(["--a", "1", "--b", "--c", "x", "y"]) == [("--a", ["1"]), ("--b", []), ("--c", ["x", "y"])]


def test_vllm_block_size_of_an_mla_model_is_64(workdir, test_gpu):
    """vLLM 0.33.0's first-choice MLA backends (FlashAttention-MLA on Hopper, FlashInfer-MLA on Blackwell) and
    FlashMLA take 64; 16 would rule FlashInfer-MLA and FlashMLA out. Other models keep 16."""
    assert "DeepseekV3ForCausalLM" in MLA_ARCHITECTURES
    roomy = (workdir / "roomy.yaml")
    roomy.write_text((workdir / test_gpu).read_text().replace("value: 1000000000", "value: 4000000000", 1))
    for architecture, block in (("DeepseekV3ForCausalLM", "64"), ("Qwen3MoeForCausalLM", "16")):
        make_checkpoint(workdir / architecture, num_layers=4, num_shards=2, moe=MOE,
                        extra_config={"architectures": [architecture]})
        cli_make(["--gpu", "roomy.yaml", "--concurrency", "2", "--context", "100"], model=architecture,
              output=f"{architecture}.yaml")
        data = json.loads(invoke(["export", f"{architecture}.yaml", "--to", "vllm", "--json"]).stdout)
        flags = data["flags"]
        assert flags[flags.index("--block-size") + 1] == block
        assert any(f"blocks of {block} x" in note for note in data["notes"])
