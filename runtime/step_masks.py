"""A decode step's attention masks, computed from the cache's GPU length by device ops alone.

transformers builds a step's masks inside the model's forward (masking_utils.create_causal_mask and
create_sliding_window_causal_mask). For eager attention, 5.17's ``eager_mask`` turns the boolean mask into the
additive one with ``torch.where(mask, torch.tensor(0.0, device=mask.device, dtype=dtype), min_dtype)``: the 0-d
tensor is made on the host and copied to the GPU on every step, which a CUDA-graph capture refuses (5.24 makes it
with ``torch.zeros((), device=...)`` instead). gpt-oss has no SDPA path (its attention sinks), so on 5.17 its
decode step could not be graphed at all.

``StepMasks`` makes those masks itself for eager attention and hands them to the model as transformers' models
take a prepared mask: a dict from layer type to mask where the layers differ (gpt-oss, Gemma 2/3; their forward
skips mask creation for a dict), else one 4-D mask (the create_*_mask functions return a 4-D mask as it comes).
Each step writes the masks in place into buffers allocated before any capture: allowed where the key's position
is at most the query's and, for a sliding layer, after the query's minus the window, with the key positions
of a ring offset as runtime.static_cache.RingSlidingLayer lays them out. The values are transformers' own
(0 where allowed, the dtype's minimum elsewhere), so a step's logits are bit for bit those of the masks
transformers would build; tests/runtime/test_step_masks.py holds them equal at positions before, at and past the
window's wrap.
"""

import torch

from runtime.static_cache import SLIDING, RingSlidingLayer, layer_types_of, sliding_window_of

FULL = "full_attention"
#: attention implementations whose step masks are made here: eager, the one whose 5.17 mask is not capturable
#: (SDPA's boolean masks are made on the GPU by transformers already, and Gemma-3's graphed steps use them)
ADDITIVE_IMPLEMENTATIONS = ("eager",)


class _TypeMask:
    """The mask of one layer type: [batch, 1, 1, keys] of ``dtype``, rewritten each step from ``layer``'s length."""

    def __init__(self, layer, window: int | None, batch: int, dtype: torch.dtype, device: torch.device):
        self.layer, self.window = layer, window
        self.num_keys = layer.keys.shape[-2]
        #: each key slot's index: its position in a full layer, its offset from the ring's first held position
        self.slots = torch.arange(self.num_keys, device=device)
        self.mask = torch.empty(batch, 1, 1, self.num_keys, dtype=dtype, device=device)
        # 0-d device tensors made before any capture: a step's torch.where takes them without a host copy
        self.allowed_value = torch.zeros((), dtype=dtype, device=device)
        self.masked_value = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)

    def update(self) -> None:
        query = self.layer.cumulative_length  # the step's position (0-d, on the device): tokens seen so far
        keys = self.slots
        if isinstance(self.layer, RingSlidingLayer):  # slot i holds position first + i, first as the ring says
            keys = keys + (query - (self.num_keys - 1)).clamp(min=0)
        allowed = keys <= query
        if self.window is not None:
            allowed = allowed & (keys > query - self.window)
        self.mask.copy_(torch.where(allowed, self.allowed_value, self.masked_value))  # the same for every sequence


class StepMasks:
    """The attention masks of a one-token decode step over ``cache``, per layer type, updated in place."""

    def __init__(self, types: dict[str, _TypeMask], by_type: bool):
        self._types, self._by_type = types, by_type

    @classmethod
    def for_model(cls, model, cache, batch: int, device: torch.device) -> "StepMasks | None":
        """The step masks ``model``'s decode steps need, or None where transformers' own masks can be captured
        (another attention implementation) or the layers are of a type this does not mask."""
        from runtime.quantized import compute_dtype

        text = model.config.get_text_config(decoder=True)
        if getattr(text, "_attn_implementation", None) not in ADDITIVE_IMPLEMENTATIONS:
            return None
        if not getattr(text, "is_causal", True):
            return None
        layer_types = layer_types_of(text)
        if not set(layer_types) <= {FULL, SLIDING} or len(cache.layers) != len(layer_types):
            return None
        window = sliding_window_of(text)
        types = {}
        for layer_type, layer in zip(layer_types, cache.layers):
            if layer_type not in types:
                if layer_type == SLIDING and (window is None or not isinstance(layer, RingSlidingLayer)):
                    return None
                if layer_type == FULL and getattr(layer, "is_sliding", False):  # keys not from position 0
                    return None
                types[layer_type] = _TypeMask(layer, window if layer_type == SLIDING else None, batch,
                                              compute_dtype(model), device)
        return cls(types, by_type=len(types) > 1)

    def update(self):
        """Write this step's masks (device ops only) and return the model's ``attention_mask`` argument."""
        for mask in self._types.values():
            mask.update()
        if self._by_type:
            return {layer_type: mask.mask for layer_type, mask in self._types.items()}
        return next(iter(self._types.values())).mask
