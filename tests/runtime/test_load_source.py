"""runtime.load_source: the checkpoint run loads, a local folder or a hub repo's snapshot in the local cache (never the
network)."""

import pytest

from planner.errors import ModelInputError
from runtime.load_source import local_weights

pytest.importorskip("transformers")


def test_a_hub_repo_not_in_the_cache_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelInputError) as error:
        local_weights("offload-plan-tests/never-cached", "main")
    message = str(error.value)
    assert "\n" not in message
    assert "`hf download offload-plan-tests/never-cached --revision main`" in message
    assert "huggingface-cli download" in message


def test_a_hub_repo_in_the_cache_loads_from_its_snapshot(checkpoints, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from tests.helpers import HUB_COMMIT, cache_hub_repo

    cache = tmp_path / "hub"
    snapshot = cache_hub_repo(cache, "org/tiny", checkpoints("llama"), blobs=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert local_weights("org/tiny", HUB_COMMIT) == snapshot
