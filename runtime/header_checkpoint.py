"""Header-only checkpoints of a config.json's model: the tensor list is the release's own where
planner.source.release_format knows the family (quantized tensors and scales, one tensor per expert, multimodal towers),
else transformers' (a model built on the meta device); the files come from planner.source.header_checkpoint (sparse
shards that declare every tensor and hold none).

In the runtime because listing a model's tensors needs torch and transformers; ``offload-plan header-checkpoint``
reaches it through offload_plan.runtime_seam.
"""

from __future__ import annotations

from pathlib import Path

from planner.errors import ModelInputError, RuntimeUnavailableError, brief, shown
from planner.model.model_config import model_config
from planner.source.release_format import LAYERS, knows, release_specs
from planner.source.header_checkpoint import (DEFAULT_SHARD_BYTES, HeaderCheckpoint, TensorSpec, dtype_for, owned_files,
                                              read_config, write_checkpoint_folder)


def write_header_checkpoint(config_path: str | Path, out_dir: str | Path, *, dtype: str | None = None,
                            shard_bytes: int = DEFAULT_SHARD_BYTES) -> HeaderCheckpoint:
    """Write a header-only checkpoint of ``config_path``'s model into ``out_dir`` (see the module docstring).

    ``dtype`` is a config.json dtype name (bfloat16, float16, float32) for the unquantized tensors; default: the
    config's own.
    """
    config_path, out_dir = Path(config_path), Path(out_dir)
    owned_files(out_dir)  # refuse someone else's folder before the slow part (transformers)
    config = read_config(config_path)
    record = model_config(config)
    safetensors_dtype = dtype_for(dtype or record.dtype or "bfloat16")
    if knows(config):
        specs = release_specs(config, dtype=dtype)
    elif record.quantization is not None:
        raise ModelInputError(f"{config_path}: {shown(record.quantization.method)}-quantized "
                              f"{shown(record.model_type)}: header-checkpoint knows the quantized layouts of "
                              f"{len(LAYERS)} families only (not silent bf16); plan from the release's own headers "
                              "(--model ORG/NAME)")
    else:
        specs = tensor_specs(config_path, safetensors_dtype, config=config)
    return write_checkpoint_folder(config_path=config_path, specs=specs, out_dir=out_dir, shard_bytes=shard_bytes)


def tensor_specs(config_path: Path, dtype: str, *, config: dict | None = None) -> list[TensorSpec]:
    """(name, dtype, shape) of every parameter the model has, as transformers names them in checkpoints;
    ``config``: config_path's mapping where the caller has read it (else read here, once)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from runtime.skeleton import transformers_config
    except ImportError as error:
        raise RuntimeUnavailableError(
            f"building a header checkpoint needs torch and transformers ({error}); "
            "install them with: pip install 'offload-plan[runtime]'") from None
    try:
        config = transformers_config(read_config(config_path) if config is None else config, config_path.parent)
    except (ValueError, KeyError, OSError) as error:
        raise ModelInputError(f"{config_path}: transformers cannot build this config ({brief(error)})") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as error:  # no causal-LM class for this config (T5, BERT, ...): its message
        # lists every config class transformers knows, so the line names the model type instead
        raise ModelInputError(
            f"{config_path}: transformers has no causal language model for model_type "
            f"{getattr(config, 'model_type', '?')!r} ({type(config).__name__}, {type(error).__name__}); "
            "header-checkpoint builds decoder-only causal LMs: give such a model's config.json") from None
    tied = getattr(config, "tie_word_embeddings", False)
    # tied: checkpoints store the embedding only
    specs = [(name, dtype, list(tensor.shape)) for name, tensor in model.state_dict().items()
             if not (tied and name == "lm_head.weight")]
    return sorted(specs)
