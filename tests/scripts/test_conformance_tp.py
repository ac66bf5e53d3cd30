"""scripts/conformance_tp.py on the CPU: the arms, the ranks' verdicts on made-up figures, and make and the plan
readers of one model's rank plans from a header-only checkpoint at full width (run skipped: it needs two GPUs)."""

import json

from scripts import conformance_tp


def test_list_names_every_arm(capsys):
    assert conformance_tp.main(["--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[:-1] == [arm.name for arm in conformance_tp.ARMS]
    assert lines[-1].startswith(f"{len(conformance_tp.ARMS)} arms; about ")
    assert any(arm.measure for arm in conformance_tp.ARMS) and any(not arm.measure for arm in conformance_tp.ARMS)
    assert {arm.concurrency for arm in conformance_tp.ARMS} >= {"1", "4", "auto"}


def _rank(rank, peak, decode_ms):
    return {"rank": rank, "peak_gpu_bytes": peak, "predicted_total_gpu_bytes": 1000, "decode_step_ms": decode_ms,
            "predicted_decode_step_ms": 10.0, "prefill_chunk_ms": 20.0, "predicted_prefill_chunk_ms": 20.0}


def test_every_rank_must_keep_the_promise():
    """The arm passes only where each rank peaks within the cap and at 0.9 of predicted or more, and each rank's
    step is within the limit (10% measured, 25% estimated)."""
    measured = conformance_tp.TpArm("mistral-sw", "4", "tight", True)
    stdout = "some text\n" + json.dumps([_rank(0, 950, 10.5), _rank(1, 950, 11.5)])
    ranks = conformance_tp.ranks_of(stdout)
    verdicts = [conformance_tp.rank_verdicts(measured, 1000, rank) for rank in ranks]
    assert [v["error_within"] for v in verdicts] == [True, False]  # rank 1: +15%
    assert all(v["peak_le_cap"] and v["peak_ge_0.9_predicted"] for v in verdicts)
    estimated = conformance_tp.TpArm("mistral-sw", "4", "tight", False)
    assert conformance_tp.rank_verdicts(estimated, 1000, ranks[1])["error_within"]
    over = conformance_tp.rank_verdicts(measured, 1000, _rank(0, 1001, 10.0))
    low = conformance_tp.rank_verdicts(measured, 1000, _rank(0, 899, 10.0))
    assert not over["peak_le_cap"] and not low["peak_ge_0.9_predicted"]
    row = {"exit": {"make": 0, "bench": 0}, "errors": {}, "verdicts": verdicts, "plan": {"architecture": None}}
    assert conformance_tp.passed(row)["error_within"] is False and conformance_tp.passed(row)["peak_le_cap"]
    assert conformance_tp.ranks_of("no json") is None
    assert "+15.0%" in conformance_tp.table([{"arm": measured.name, **row}])


def test_dry_run_makes_and_reads_the_rank_plans(tmp_path, capsys):
    """Header-only Gemma-2 at full width: make --tp 2 (estimated) and show, both exports and check on each arm's
    plan; the exports' one-line refusals for an architecture the engine does not wire count as kept promises."""
    code = conformance_tp.main(["--dry-run", "--models", "gemma2", "--out", str(tmp_path / "out"),
                                "--checkpoints", str(tmp_path / "ckpt")])
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert code == 0 and len(rows) == 2, capsys.readouterr().out[-2000:]
    for row in rows:
        assert row["verdicts_all"]["exit_ok"] and set(row["exit"]) == {"make", "show", "export_vllm",
                                                                      "export_sglang", "check"}, row
        assert row["plan"]["concurrency"] >= 1 and row["plan"]["total_gpu_bytes"] <= row["cap_bytes"]
