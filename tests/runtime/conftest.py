"""Fixtures and helpers that more than one runtime test file uses: tiny checkpoints of several families, the
host pieces an engine pinned, a placement not yet pinned, a stand-in whose page-locking refuses part way."""

from pathlib import Path

import pytest
import torch

from runtime.backend import CpuStandIn, pin_error
from tests.runtime_models import save_tiny_llama, save_tiny_moe, skeleton


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def save_family(folder: Path, family: str) -> Path:
    """A sharded checkpoint of one family, random weights everywhere (norms too)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)
    configs = {
        "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
        "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
        "qwen3-moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                             head_dim=16)),
        "qwen2": ("Qwen2Config", {}),
        "mistral": ("MistralConfig", {}),
    }
    config_name, extra = configs[family]
    import transformers

    config = getattr(transformers, config_name)(**common, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


FAMILIES = ["llama", "llama-bf16", "moe", "llama-tied", "mixtral", "qwen3-moe", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Family name -> checkpoint folder, written once per module."""
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            if family == "llama":
                made[family] = save_tiny_llama(folder)
            elif family == "llama-bf16":
                made[family] = save_tiny_llama(folder, dtype=torch.bfloat16)
            elif family == "moe":
                made[family] = save_tiny_moe(folder)
            else:
                made[family] = save_family(folder / family, family)
        return made[family]

    return get


def engine_pieces(engine) -> dict[int, int]:
    """The engine's per-layer host pieces as CpuStandIn.pinned records them (start -> bytes)."""
    return {piece.data_ptr(): piece.numel() for piece in engine.host_buffers if piece.numel() > 0}


def resident_plan(folder: Path):
    """A plan the search makes when everything fits: nothing offloaded."""
    from planner.make.make_plan import make_plan
    from planner.plan.schema import Inputs

    inputs = Inputs(model=str(folder), revision=None, gpu="h100-sxm", budget="1GiB", trigger=None, tokens=16,
                    sequences=1, context=0, params=(), stack=None, group_size=None, num_in_group=None,
                    prefetch_step=None, cuda_graph=False)
    return make_plan(inputs).plan


def unpinned_placement(folder: Path, plan, backend):
    """place_plan over the checkpoint's meta skeleton, nothing pinned yet."""
    from runtime.placement import place_plan

    return place_plan(skeleton(folder), plan, backend, pin=False)


class RefusesPiece(CpuStandIn):
    """Page-locking succeeds for the first ``num_allowed`` pieces, then the memlock limit refuses."""

    def __init__(self, num_allowed):
        super().__init__()
        self.num_allowed = num_allowed
        self.events = []

    def pin(self, tensor):
        if self.num_allowed == 0:
            self.events.append("refused")
            raise pin_error(tensor.numel(), 2)
        self.num_allowed -= 1
        self.events.append("pin")
        return super().pin(tensor)
