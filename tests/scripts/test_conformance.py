"""scripts/conformance.py on the CPU: the arm list, the checkpoints' release format, make and the plan readers of
a few arms at tiny widths (run skipped: it needs the GPU), and the verdicts on made-up run figures."""

import json

import pytest

from scripts import conformance


def test_list_covers_the_issue_targets(capsys):
    """At least 60 arms over at least 10 architectures, 4 of them MoE; every mode and both caps; each model's
    serving arms at concurrency 1 with --measure first."""
    assert conformance.main(["--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = lines[:-1]
    assert lines[-1] == f"{len(names)} arms over {len(conformance.MODELS)} models" and len(names) >= 60
    assert len(conformance.MODELS) >= 10 and sum(model.moe for model in conformance.MODELS.values()) >= 4
    modes = {name.split("/")[1] for name in names}
    assert modes == set(conformance.MODE_NAMES)
    assert {name.split("/")[2] for name in names} == {"loose", "tight"}
    assert {name for name in names if name.endswith("whole-layer")} and any("/measure" in n for n in names)
    for model in conformance.MODELS:
        own = [name for name in names if name.startswith(model + "/")]
        assert own[0] == f"{model}/serving-1/loose/measure"
    everything = [arm.name for model in conformance.MODELS.values() for arm in conformance.arms_for(model, None,
                                                                                                    True)]
    assert set(names) < set(everything) and len(set(everything)) == len(everything)


def test_filters_and_unknown_names(capsys):
    assert conformance.main(["--list", "--models", "mixtral,phi3", "--modes", "decode,serving-4"]) == 0
    names = capsys.readouterr().out.strip().splitlines()[:-1]
    assert names and {n.split("/")[0] for n in names} == {"mixtral", "phi3"}
    assert {n.split("/")[1] for n in names} <= {"decode", "serving-4"}
    with pytest.raises(SystemExit, match="unknown model or mode no-such"):
        conformance.main(["--list", "--models", "no-such"])


def test_tiny_sweep_makes_and_reads_plans_on_the_cpu(tmp_path):
    """Two MoE models, one in planner.source.release_format's layout (Mixtral's w1/w2/w3), one through transformers'
    save_pretrained (OLMoE): per-expert tensors, a tokenizer; every command of every arm exits 0 or its row
    holds a one-line error; rows.jsonl and table.md are written."""
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    args = ["--tiny", "--no-run", "--out", str(out), "--checkpoints", str(checkpoints), "--models", "mixtral,olmoe",
            "--modes", "serving-4,decode", "--all-arms"]
    assert conformance.main(args) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    facts = {row["model"]: row for row in rows if row["kind"] == "checkpoint"}
    assert facts["mixtral"]["expert_tensor_names"] == [
        f"model.layers.N.block_sparse_moe.experts.N.{w}.weight" for w in ("w1", "w2", "w3")]
    assert facts["olmoe"]["expert_tensor_names"] == [
        f"model.layers.N.mlp.experts.N.{p}_proj.weight" for p in ("down", "gate", "up")]
    assert (checkpoints / "olmoe-tiny" / "tokenizer.json").is_file()
    arms = [row for row in rows if row["kind"] == "arm"]
    # serving-4 and decode, estimated and --measure, and (MoE) decode whole-layer, each at 2 caps
    assert len(arms) == 2 * 10
    for row in arms:
        failed = {name for name, code in row["exit"].items() if code != 0}
        assert failed <= set(row["errors"]) and set(row["errors"]) - failed <= {"diff"}  # diff: skipped
        assert all("\n" not in error and error for error in row["errors"].values())
    assert {row["errors"]["make"].split(":")[1] for row in arms if row["measure"]} == {" error"}  # no CUDA here
    mixtral = [row for row in arms if row["model"] == "mixtral" and not row["measure"]]
    assert all(row["verdicts"]["exit_ok"] for row in mixtral), [row["errors"] for row in mixtral]
    assert {row["plan"]["regime"] for row in mixtral if row["experts"] == "whole-layer"} == {"whole_layer"}
    assert all(set(row["exit"]) == {"make", "show", "export_vllm", "export_sglang", "check", "diff"}
               for row in mixtral)
    assert "| mixtral/decode/tight/estimate | make:0 " in (out / "table.md").read_text()
    assert conformance.main(args[:-1] + ["--models", "mixtral", "--modes", "prefill"]) == 0  # folders reused
    again = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()][len(rows):]
    assert again[0]["kind"] == "checkpoint" and again[0]["write_s"] < 1


def _serving_row(peak_bytes: int, decode_ms: float, text: str) -> dict:
    bench = {"peak_gpu_bytes": peak_bytes, "predicted_total_gpu_bytes": 9 * 2**30, "gpu_memory_bytes": 10 * 2**30,
             "decode_step_ms": decode_ms, "predicted_decode_step_ms": 10.0, "prefill_chunk_ms": 100.0,
             "predicted_prefill_chunk_ms": 95.0, "outside_allocator_start_bytes": 2**30}
    return {"exit": {"make": 0, "bench": 0, "prompt": 0}, "errors": {}, "bench": bench, "text": text,
            "plan": {"memory": {"gpu_memory_bytes": 10 * 2**30, "total_gpu_bytes": 9 * 2**30}}}


@pytest.mark.parametrize(("measure", "peak_gib", "decode_ms", "text", "expected"), [
    (True, 9.5, 10.5, "w1 w2", dict(peak_le_cap=True, peak_ge=True, error_within=True, tokens_equal=True)),
    (True, 10.5, 11.5, "w1 w3", dict(peak_le_cap=False, peak_ge=True, error_within=False, tokens_equal=False)),
    (False, 7.0, 11.5, "w1 w2", dict(peak_le_cap=True, peak_ge=False, error_within=True, tokens_equal=True)),
])
def test_verdicts(measure, peak_gib, decode_ms, text, expected):
    arm = conformance.Arm("qwen2-moe", "serving-1", "tight", measure)
    row = _serving_row(int(peak_gib * 2**30), decode_ms, text)
    verdicts = conformance.verdicts(arm, row, "w1 w2")
    assert verdicts["exit_ok"] and verdicts["no_oom"]
    assert verdicts["peak_le_cap"] == expected["peak_le_cap"]
    assert verdicts["peak_ge_0.9_predicted"] == expected["peak_ge"]
    assert verdicts["error_within"] == expected["error_within"]
    assert verdicts["tokens_equal"] == expected["tokens_equal"]
    assert row["peak_over_cap"] == pytest.approx(peak_gib / 10)


def test_verdicts_of_a_run_out_of_memory():
    arm = conformance.Arm("mixtral", "serving-4", "loose", False)
    row = {"exit": {"make": 0, "bench": 5, "prompt": 0}, "text": None, "plan": {"memory": {}},
           "errors": {"bench": "offload-plan: error: out of GPU memory while serving: the plan predicts 8 GiB"}}
    verdicts = conformance.verdicts(arm, row, "w1")
    assert verdicts == {"exit_ok": False, "no_oom": False, "peak_le_cap": None, "peak_ge_0.9_predicted": None,
                        "error_within": None, "tokens_equal": False}
    text = conformance.report([{"kind": "arm", "arm": arm.name, "measure": False, "seconds": 1.0} | row
                               | {"verdicts": verdicts}], 1.0)
    assert "| exit_ok | 0 | 1 | 0 |" in text and "| peak_le_cap | 0 | 0 | 1 |" in text
