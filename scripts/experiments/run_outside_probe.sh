#!/usr/bin/env bash
# What run --bench holds outside the allocator on a Qwen2-MoE-shaped serving plan, routed and whole layers (issue 36).
set -u
python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                              shared_expert_intermediate_size=5632, num_hidden_layers=6, num_attention_heads=16,
                              num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, vocab_size=151936)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained("/tmp/q2moe", max_shard_size="2GB")
PY
for mode in "--concurrency 1" "--concurrency 4"; do
  PYTHONPATH=. python3 -m offload_plan make --model /tmp/q2moe --gpu h100-sxm --gpu-memory 5GiB $mode --context 4096 --cuda-graph -o /tmp/p.yaml 2>&1 | tail -1
  grep -E "regime|total_gpu_bytes|cuda_context" /tmp/p.yaml | head -5
  PYTHONPATH=. python3 -m offload_plan run /tmp/p.yaml --bench --json 2>&1 | python3 -c "import json,sys; t=sys.stdin.read(); i=t.find('{'); d=json.loads(t[i:]) if i>=0 else {}; print({k:d.get(k) for k in ('peak_gpu_bytes','predicted_total_gpu_bytes','outside_allocator_bytes','reserved_bytes_by_phase','decode_step_ms','predicted_decode_step_ms')} if d else t[-800:])"
done
