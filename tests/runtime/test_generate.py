"""runtime.generate: run --prompt's greedy generation (on the GPU in runtime/test_adapters_generate.py and
runtime/test_engine_gpu.py); here what it refuses before any GPU work."""

from types import SimpleNamespace

import pytest

from planner.errors import UsageError
from runtime.generate import generate


def test_a_folder_without_a_tokenizer_is_one_line_before_any_gpu_work(tmp_path):
    loaded = SimpleNamespace(model=None, plan=None, engine=None)  # touched only after the tokenizer loads
    with pytest.raises(UsageError) as error:
        generate(loaded, "Hello", str(tmp_path), max_new_tokens=4)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{tmp_path} has no tokenizer") and "--bench" in message
