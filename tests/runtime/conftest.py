"""Fixtures that more than one runtime test file uses."""

import pytest

from tests.runtime_models import save_tiny_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))
