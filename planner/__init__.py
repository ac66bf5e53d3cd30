"""offload-plan's planner: pure Python (no torch), so plans for any GPU can be made on a laptop."""

__version__ = "0.1.0"
