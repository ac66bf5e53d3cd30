"""planner.source.hub: repo ids served from a Hugging Face cache written by hand (HF_HUB_OFFLINE=1: never the
network), and the hub without a network, in one line within seconds."""

import os
import time

import pytest
import yaml

from tests.conftest import TEST_GPU, assert_one_line_error, cli_env, invoke, make_checkpoint, run_cli
from tests.helpers import HUB_COMMIT, cache_hub_repo


def _plan(workdir, args, env):
    proc = run_cli(["make", *args, "--gpu", TEST_GPU, "--budget", "400KB", "-o", "plan.yaml"], cwd=workdir, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return yaml.safe_load((workdir / "plan.yaml").read_text()), (workdir / "plan.yaml").read_text()


def test_hub_repo_from_cache(workdir, tmp_path_factory):
    local = make_checkpoint(workdir / "ckpt", num_layers=6, num_shards=3).path
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache_hub_repo(cache, "org/name", local)
    env = cli_env(HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent))

    hub_plan, hub_text = _plan(workdir, ["--model", "org/name"], env)
    assert hub_plan["model"]["source"] == "org/name"
    assert hub_plan["model"]["revision"] == HUB_COMMIT
    assert hub_plan["inputs"]["model"] == "org/name"
    assert str(cache) not in hub_text, "plans must not hold machine paths"

    local_plan, _ = _plan(workdir, ["--model", "ckpt"], env)
    assert local_plan["model"]["source"] == "ckpt" and local_plan["model"]["revision"] is None
    assert hub_plan["model"]["fingerprint"] == local_plan["model"]["fingerprint"]
    for section in ("offload", "memory", "prediction", "layers"):
        assert hub_plan[section] == local_plan[section], section

    # pinning the commit explicitly reads the same snapshot
    pinned_plan, _ = _plan(workdir, ["--model", "org/name", "--revision", HUB_COMMIT], env)
    assert pinned_plan["model"]["revision"] == HUB_COMMIT
    assert pinned_plan["inputs"]["revision"] == HUB_COMMIT
    assert pinned_plan["model"]["fingerprint"] == local_plan["model"]["fingerprint"]


def test_hub_cache_with_blob_symlinks(workdir, tmp_path_factory):
    local = make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2).path
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache_hub_repo(cache, "org/linked", local, blobs=True)
    env = cli_env(HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent))
    plan, _ = _plan(workdir, ["--model", "org/linked"], env)
    assert plan["model"]["revision"] == HUB_COMMIT
    result = invoke(["make", "--model", "ckpt", "--gpu", TEST_GPU, "--budget", "400KB"])
    assert yaml.safe_load(result.stdout)["model"]["fingerprint"] == plan["model"]["fingerprint"]


def test_hub_repo_not_in_cache_offline(workdir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache.mkdir()
    (workdir / "out.yaml").write_text("keep me\n")
    env = cli_env(HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent))
    proc = run_cli(["make", "--model", "org/absent", "--gpu", TEST_GPU, "-o", "out.yaml"], cwd=workdir, env=env)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout,
                          ("org/absent", "not in the local Hugging Face cache"))
    assert proc.returncode == 2
    assert (workdir / "out.yaml").read_text() == "keep me\n"
    assert sorted(p.name for p in workdir.iterdir()) == ["out.yaml", "tests"]


def test_hub_shard_missing_from_cache_offline(workdir, tmp_path_factory):
    """Index and config cached but a shard not: offline, its header cannot be fetched: one line."""
    local = make_checkpoint(workdir / "ckpt", num_layers=4, num_shards=2).path
    cache = tmp_path_factory.mktemp("hf") / "hub"
    snapshot = cache_hub_repo(cache, "org/partial", local)
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    env = cli_env(HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent))
    proc = run_cli(["make", "--model", "org/partial", "--gpu", TEST_GPU], cwd=workdir, env=env)
    assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, ("org/partial", "model-00002-of-00002"))


@pytest.mark.parametrize("model", ["org/x..y", "org--x/y", "org/name\n"])
def test_a_malformed_repo_id_is_one_line(model, tmp_path, monkeypatch):
    """The hub's own id rules are checked before any request (org/x..y once reached huggingface_hub and came
    back as the "this is a bug" line); a trailing newline is not an id at all."""
    from tests.conftest import invoke

    monkeypatch.chdir(tmp_path)
    result = invoke(["make", "--model", model, "--gpu", "h100-sxm", "--budget", "10GiB"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "repo id" in result.stderr


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["offline", "unreachable"])
def test_hub_without_network_fails_in_one_line_within_seconds(tmp_path, env):
    started = time.monotonic()
    proc = run_cli(["make", "-m", "some-org/some-model", "-g", "h100-sxm"], tmp_path,
                   env=cli_env(HF_HOME=str(tmp_path / "hf"), **env))
    elapsed_s = time.monotonic() - started
    line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, contains=("some-org/some-model",))
    assert ("HF_HUB_OFFLINE is set" if env["HF_HUB_OFFLINE"] == "1" else "127.0.0.1 cannot be reached") in line
    assert elapsed_s < 15, f"took {elapsed_s:.1f} s"
    assert "Retry" not in proc.stderr and os.environ.get("HF_HUB_OFFLINE") != "0"


@pytest.mark.parametrize(("text", "is_repo_id"), [
    ("org/name", True), ("Qwen/Qwen3-30B-A3B", True), ("./org/name", False), ("/abs/path", False),
    ("org", False), ("org/name/extra", False), (".hidden/name", False)])
def test_looks_like_repo_id_tells_a_repo_id_from_a_path(text, is_repo_id):
    from planner.source.hub import looks_like_repo_id

    assert looks_like_repo_id(text) is is_repo_id


def test_commit_of_reads_the_snapshot_folder(tmp_path):
    from planner.source.hub import commit_of

    assert commit_of(tmp_path / "models--org--name" / "snapshots" / HUB_COMMIT / "config.json") == HUB_COMMIT
    assert commit_of(tmp_path / "config.json") is None
