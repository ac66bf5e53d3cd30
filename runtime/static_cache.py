"""A static KV cache that CUDA graphs can replay for sliding-window and hybrid models.

transformers' StaticCache gives a sliding-window layer a ``StaticSlidingWindowLayer`` (cache_utils.py, 5.17 and
5.24 alike): it holds min(window, max_cache_len) tokens, but decides with a Python int (``cumulative_length_int``)
whether the window is full, shifts the window with a roll, and reports the mask's offset and the sequence length
(which sets the positions of Gemma 2/3, gpt-oss and Mistral, whose first layer slides) as Python ints. A CUDA
graph freezes all of those at capture, so a replay would attend at the captured positions forever.

``RingSlidingLayer`` holds the same min(window, max_cache_len) tokens as a ring: token p lives in slot
p mod held, written by ``index_copy_`` at an index computed on the GPU from the layer's tensor length. A decode
step's keys are the whole ring and its mask offset is a GPU tensor, max(0, p - held + 1): with it transformers'
sliding mask (kv_idx > q_idx - window, kv_idx <= q_idx; masking_utils.sdpa_mask) lets exactly the slots that
hold tokens of the window through, in ring order, since once full every slot holds one of the window's last
tokens. Nothing in a step reads a Python value that changes between steps. Prefill chunks (several tokens,
never graphed) read the length once and attend over the window's tokens in order followed by the chunk's.

The ring order changes the order of the attention's sums against a rolled window, so a graphed step equals
the same cache run eagerly or all-resident bit for bit, and a dynamic cache to rounding.
"""

import torch
from transformers.cache_utils import StaticLayer

#: the layer type transformers' config classes give a sliding-window layer (config.layer_types)
SLIDING = "sliding_attention"


class RingSlidingLayer(StaticLayer):
    """A sliding-window layer of ``min(sliding_window, max_cache_len)`` slots whose length lives on the GPU.

    keys/values: [batch, kv heads, held tokens, head dim]; ``cumulative_length``: tokens seen (a 0-d GPU
    tensor), so token p sits in slot p % held."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs):
        super().__init__(max_cache_len=min(sliding_window, max_cache_len))
        #: the model's window in tokens (the slots held are at most this many)
        self.sliding_window = sliding_window

    @property
    def held_tokens(self) -> int:
        """Slots of the ring: tokens of one sequence this layer holds."""
        return self.max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new keys/values [batch, kv heads, new tokens, head dim]; return what the layer attends over."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1:  # a decode step (a shape, fixed in a graph)
            return self._append_one(key_states, value_states)
        return self._append_chunk(key_states, value_states)

    def _append_one(self, key_states: torch.Tensor, value_states: torch.Tensor):
        slot = torch.remainder(self.cumulative_length, self.held_tokens).reshape(1)  # computed on the GPU
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.cumulative_length.add_(1)
        return self.keys, self.values  # the whole ring: the mask lets the window's slots through

    def _append_chunk(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A prefill chunk (eager only: reads the length on the host): the window's held tokens in order, then
        the chunk's; the last ``held_tokens`` of them stay in their slots."""
        start, num_new = int(self.cumulative_length), key_states.shape[-2]
        num_previous = min(start, self.held_tokens)
        previous = self._slots(start - num_previous, start)
        keys = torch.cat((self.keys.index_select(2, previous), key_states), dim=-2)
        values = torch.cat((self.values.index_select(2, previous), value_states), dim=-2)
        num_kept = min(self.held_tokens, num_previous + num_new)
        kept = self._slots(start + num_new - num_kept, start + num_new)
        self.keys.index_copy_(2, kept, keys[:, :, -num_kept:])
        self.values.index_copy_(2, kept, values[:, :, -num_kept:])
        self.cumulative_length.add_(num_new)
        return keys, values

    def _slots(self, first_position: int, end_position: int) -> torch.Tensor:
        return torch.arange(first_position, end_position, device=self.device) % self.held_tokens

    def get_mask_sizes(self, query_length: int) -> tuple:
        """(kv length, kv offset) of the mask: for a decode step the ring and a GPU offset that lines the
        sliding mask up with the slots that hold the window; for a chunk, the ordered keys _append_chunk returns."""
        if query_length == 1:
            return self.held_tokens, (self.cumulative_length - (self.held_tokens - 1)).clamp(min=0)
        start = int(self.cumulative_length)
        num_previous = min(start, self.held_tokens)
        return num_previous + query_length, start - num_previous

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a ring sliding-window cache cannot give back tokens it has overwritten")


def sliding_window_of(text_config) -> int | None:
    """The window of a config's sliding layers, None where it sets none."""
    window = getattr(text_config, "sliding_window", None)
    if getattr(text_config, "use_sliding_window", True) is False:  # Qwen2/3 switch their window off so
        return None
    return window if isinstance(window, int) and window > 0 else None


def layer_types_of(text_config) -> list[str]:
    """"full_attention" or "sliding_attention" (or another type) per decoder layer, as the config classes give
    them; a config with a window and no layer_types (Mistral) slides everywhere, as transformers' caches read it."""
    num_layers = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    if types is not None:
        return list(types)[:num_layers]
    return [SLIDING if sliding_window_of(text_config) else "full_attention"] * num_layers


def static_cache(config, max_cache_tokens: int):
    """transformers' StaticCache of ``max_cache_tokens`` tokens per sequence, with every sliding-window layer
    a RingSlidingLayer: full-attention layers hold ``max_cache_tokens``, sliding ones min(window, that)."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=max_cache_tokens)
    text = config.get_text_config(decoder=True)
    window = sliding_window_of(text)
    for index, layer_type in enumerate(layer_types_of(text)):
        if layer_type == SLIDING and window is not None and index < len(cache.layers):
            cache.layers[index] = RingSlidingLayer(max_cache_len=max_cache_tokens, sliding_window=window)
    return cache


def is_graph_safe(layer) -> bool:
    """Whether a decode step over ``layer`` reads nothing but GPU tensors: a full-attention static layer or a
    ring (transformers' own sliding layers keep a Python length)."""
    if isinstance(layer, RingSlidingLayer):
        return True
    return not getattr(layer, "is_sliding", False) and hasattr(layer, "cumulative_length") \
        and not hasattr(layer, "cumulative_length_int")
