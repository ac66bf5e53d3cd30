"""planner.source.header_checkpoint: header-only checkpoints, and the folders it will and will not touch.

Most tests write a given tensor list (no torch); two build the list from a tiny Llama config.json with
transformers, as ``offload-plan header-checkpoint`` and scripts/header_checkpoint.py do.
"""

import json
import subprocess
import sys

import pytest

from planner.source.checkpoint import load_checkpoint
from planner.errors import UsageError
from planner.source.header_checkpoint import HEADER_ONLY, MARKER_NAME, marker_kind, write_checkpoint_folder
from tests.conftest import ERROR_PREFIX, REPO_ROOT, TINY_LLAMA, cli_env

SPECS = [("model.embed_tokens.weight", "BF16", [256, 64]), ("model.layers.0.mlp.down_proj.weight", "BF16", [64, 128]),
         ("model.layers.0.mlp.up_proj.weight", "BF16", [128, 64]), ("model.norm.weight", "F32", [64])]
SPECS_BYTES = 256 * 64 * 2 + 2 * 64 * 128 * 2 + 64 * 4


def test_writes_index_sparse_shards_config_and_marker(tmp_path, config_path):
    written = write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=tmp_path / "out",
                                      shard_bytes=40_000)
    folder = tmp_path / "out"
    assert written.num_tensors == 4 and written.tensor_bytes == SPECS_BYTES
    assert written.num_shards == 2  # the embedding (32 KiB) fills the first 40 kB shard
    assert json.loads((folder / "config.json").read_text()) == TINY_LLAMA
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == SPECS_BYTES and len(index["weight_map"]) == 4
    assert marker_kind(folder) == HEADER_ONLY
    assert sorted(json.loads((folder / MARKER_NAME).read_text())["files"]) == sorted(
        p.name for p in folder.iterdir() if p.name != MARKER_NAME)
    checkpoint = load_checkpoint(str(folder))  # the planner reads it as a complete checkpoint
    assert {t.name for t in checkpoint.tensors} == {spec[0] for spec in SPECS}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "the staging folder is gone"


def test_refuses_a_folder_it_did_not_make_and_leaves_it_alone(tmp_path, config_path):
    folder = tmp_path / "real-model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(UsageError, match="not made by offload-plan"):
        write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=folder)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real-model", "src"], "no staging folder left"


def test_refuses_a_file(tmp_path, config_path):
    target = tmp_path / "file"
    target.write_text("mine")
    with pytest.raises(UsageError, match="not a folder"):
        write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=target)
    assert target.read_text() == "mine"


def test_writes_into_an_empty_folder_and_keeps_it(tmp_path, config_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    inode = folder.stat().st_ino
    write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=folder)
    assert folder.stat().st_ino == inode, "the user's folder is written into, not replaced"
    assert (folder / "model.safetensors.index.json").is_file()


def test_rewrites_its_own_folder_and_drops_its_stale_shards(tmp_path, config_path):
    folder = tmp_path / "out"
    write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=folder, shard_bytes=40_000)
    assert len(list(folder.glob("*.safetensors"))) == 2
    write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=folder)
    assert [p.name for p in folder.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]


def test_refuses_its_own_folder_once_someone_else_added_files(tmp_path, config_path):
    folder = tmp_path / "out"
    write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=folder)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt"):
        write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=folder)
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "model.safetensors.index.json").is_file()


def test_a_forged_marker_naming_paths_is_refused(tmp_path, config_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "data.bin").write_text("mine")
    (folder / MARKER_NAME).write_text(json.dumps({"files": ["../src/config.json", "data.bin"]}))
    with pytest.raises(UsageError, match="not a marker"):
        write_checkpoint_folder(config_path=config_path, specs=SPECS, out_dir=folder)
    assert (folder / "data.bin").read_text() == "mine" and config_path.is_file()


def test_script_wrapper_writes_then_refuses_in_one_line(tmp_path, config_path):
    script = [sys.executable, str(REPO_ROOT / "scripts" / "header_checkpoint.py"), str(config_path)]
    done = subprocess.run(script + [str(tmp_path / "out")], capture_output=True, text=True, env=cli_env(),
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    refused = subprocess.run(script + [str(config_path.parent)], capture_output=True, text=True, env=cli_env(),
                             timeout=300)
    assert refused.returncode == UsageError.exit_code
    assert refused.stderr.startswith(ERROR_PREFIX) and len(refused.stderr.strip().splitlines()) == 1
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in config_path.parent.iterdir()) == ["config.json"]
