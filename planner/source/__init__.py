"""What the planner reads and where it writes: safetensors headers, checkpoints local and on the hub, header-only
checkpoints, release formats, hardware profiles, routing traces, untrusted JSON/YAML and the output-path check."""
