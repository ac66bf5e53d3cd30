"""What a model is and what it costs: the config record, the layer layout, the KV cache, activations, experts,
adapters, tensor-parallel shards, compute cost and the memory besides the weights."""
