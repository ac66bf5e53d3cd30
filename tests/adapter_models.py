"""Random PEFT LoRA adapters for a base checkpoint, and PEFT's own outputs as the reference (CPU and GPU tests
and the adapter benchmark share them)."""

from pathlib import Path

import torch

#: every linear layer of a Llama/Qwen-style decoder layer
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_adapters(base_model, folder: Path, names: list[str], *, rank: int, alpha: float = 16.0,
                         targets=ALL_LINEAR, seed: int = 0, scale: float = 0.05) -> dict[str, Path]:
    """PEFT adapters with random A and B (PEFT starts B at zero, which would hide a wrong adapter), saved with
    PEFT's save_pretrained; returns name -> folder. ``base_model`` is left as it was."""
    from peft import LoraConfig, get_peft_model

    folders = {}
    for number, name in enumerate(names):
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
        peft_model = get_peft_model(base_model, config, autocast_adapter_dtype=False)
        device = next(base_model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed * 1000 + number)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_" in param_name:
                    values = torch.randn(param.shape, generator=generator, device=device) * scale
                    param.copy_(values.to(param.dtype))
        peft_model.save_pretrained(folder / name)
        peft_model.unload()  # the base layers back as they were, for the next adapter
        folders[name] = folder / name
    return folders


def peft_reference(base_model, folders: dict[str, Path]):
    """The base model wrapped by PEFT with every adapter loaded in the model's dtype."""
    from peft import PeftModel

    names = list(folders)
    model = PeftModel.from_pretrained(base_model, folders[names[0]], adapter_name=names[0],
                                      autocast_adapter_dtype=False)
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name, autocast_adapter_dtype=False)
    return model.eval()


def peft_logits(model, ids: torch.Tensor, adapters: list[str]) -> torch.Tensor:
    """Last-token logits of a forward over ``ids`` ([rows, tokens]) whose rows use ``adapters`` (one per row):
    PEFT's single-adapter forward when all rows share one, its mixed-batch forward otherwise."""
    with torch.inference_mode():
        if len(set(adapters)) == 1:
            model.set_adapter(adapters[0])
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
        else:
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1, adapter_names=list(adapters))
    return out.logits[:, -1]
