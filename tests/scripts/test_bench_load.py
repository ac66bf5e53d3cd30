"""scripts/bench_load.py's logic on a tiny model (the H100 run uses a 42.7 GB one): checkpoint, rates, plans,
a confined child load compared bit for bit with from_pretrained, the table."""

import json
from pathlib import Path

import pytest

bench_load = pytest.importorskip("scripts.bench_load")


def test_tiny_bench_loads_equal_logits_and_reports(tmp_path, capsys):
    config = bench_load.TINY_CONFIG
    checkpoint = tmp_path / "checkpoint"
    total = bench_load.write_checkpoint(checkpoint, config, 64 << 10, "cpu")
    files = sorted(checkpoint.glob("*.safetensors"))
    assert len(files) >= 4 and total == sum(f.stat().st_size for f in files) - sum(_header_bytes(f) for f in files)
    results = {"device": "cpu", "checkpoint_bytes": total, "runs": []}
    bench_load.measure_rates(results, files, tiny=True)
    assert results["disk_read_bytes_per_s"] > 0 and results["memcpy_bytes_per_s"] > 0
    logits = tmp_path / "reference.pt"
    reference = bench_load.run_child({"mode": "reference", "model": str(checkpoint), "logits": str(logits),
                                      "vocab": config["vocab_size"]}, None, 300)
    assert reference["ok"], reference
    plan = bench_load.make_plan_file(checkpoint, "300KB", tmp_path / "plan-300KB.yaml")
    assert plan["offload"]["layers"]
    args = type("Args", (), {"no_cgroup": not _memory_cgroup_usable()})()
    row = bench_load.measure_load(args, checkpoint, "300KB", plan, tmp_path, logits, config, "cold", files)
    assert row["ok"], row
    assert row["logits_equal"] and row["pinned_bytes"] >= plan["memory"]["host_pinned_bytes"]
    assert row["vm_hwm_load_bytes"] > 0 and "fadvise" in row["evicted_by"]
    phases = row["load_phases"]  # where the load's time went, for the H100 run
    assert phases["num_pieces_pinned"] == len(plan["offload"]["layers"])
    assert phases["host_reads_done_s"] <= phases["last_pin_done_s"] <= phases["streamed_s"]
    results["runs"].append(row)
    results["disk_read_method"] = "test"
    bench_load.print_table(results)
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("targets:") and "| cold |" in table[-2] and table[-2].endswith("equal")
    json.dumps(results)  # the JSON written under $OUT


def _header_bytes(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _memory_cgroup_usable() -> bool:
    """Only where a memory cgroup can be made without moving anyone's processes (v1, or v2 with the memory
    controller already enabled for children)."""
    import os

    root = Path("/sys/fs/cgroup")
    if not os.access(root, os.W_OK):
        return False
    if (root / "cgroup.subtree_control").exists():
        return "memory" in (root / "cgroup.subtree_control").read_text().split()
    return os.access(root / "memory", os.W_OK)


def test_tiny_moe_bench_writes_the_hubs_per_expert_tensors_and_loads_them_equal(tmp_path):
    """--moe: the checkpoint ships one tensor per expert (as releases do, not transformers' fused params), and
    a plan offloading only the experts loads it bit for bit, with no conversion buffers."""
    from runtime.checkpoint_reader import read_sources

    config = bench_load.TINY_MOE_CONFIG
    checkpoint = tmp_path / "checkpoint"
    bench_load.write_checkpoint(checkpoint, config, 64 << 10, "cpu")
    names = set(read_sources(sorted(checkpoint.glob("*.safetensors"))))
    assert "model.layers.3.mlp.experts.11.down_proj.weight" in names
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in names)
    logits = tmp_path / "reference.pt"
    assert bench_load.run_child({"mode": "reference", "model": str(checkpoint), "logits": str(logits),
                                 "vocab": config["vocab_size"]}, None, 300)["ok"]
    label, budget, params = bench_load.TINY_MOE_RUNS[-1]
    plan = bench_load.make_plan_file(checkpoint, budget, tmp_path / f"plan-{label}.yaml", params)
    assert plan["offload"]["layers"] and plan["offload"]["params"] == ["experts"]
    args = type("Args", (), {"no_cgroup": True})()
    row = bench_load.measure_load(args, checkpoint, label, plan, tmp_path, logits, config, "hot", [])
    assert row["ok"] and row["logits_equal"], row
