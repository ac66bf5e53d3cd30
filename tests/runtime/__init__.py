"""Tests of runtime/, one file per module: tests/runtime/test_<module>.py (GPU twins end in _gpu.py)."""
