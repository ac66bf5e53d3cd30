"""One module per command; ``offload_plan.app`` registers them all."""
