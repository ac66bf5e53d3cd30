"""Fuzz regressions, class: the round trip. A plan as make writes it, in every regime and with every row make can
write, is read by show, export and diff: accepted, never refused as out of range.
"""

from tests.fuzz import base
from tests.fuzz.derived import PLANS
from tests.fuzz.regression import run_regression, serving_plan_file
from tests.fuzz.roundtrip import READERS

#: every reader but check (which compares with what make writes now), on plan.yaml
PLAN_READERS = [[part.replace("new.yaml", "plan.yaml") for part in r] for r in READERS if r[0] != "check"]


def test_serving_rows_where_nothing_fits_read_back():
    """make marks a concurrency where no placement fits with num_offloaded -1 (planner.make.assemble.serving_row): a
    plan holding such a row is read by every reader, not refused as "negative" (issue 25)."""
    def mark(plan):
        chosen = plan["workload"]["concurrency"]
        row = next(r for r in reversed(plan["serving"]["points"]) if r["concurrency"] != chosen)
        row.update(num_offloaded=-1, group_size=0, num_in_group=0, prefetch_step=0, weights_gpu_bytes=0, step_ms=None,
                   tokens_per_s=0.0)

    result = run_regression("no-fit-row", PLAN_READERS[0], serving_plan_file(mark), then=PLAN_READERS[1:],
                            invalid=False)
    assert result.verdict == "accepted", f"{result.verdict}: {result.detail} | {result.message}"


def test_unedited_plans_pass_every_reader():
    """The round trip: every base plan (each regime) as make wrote it passes show, export and diff (issue 39)."""
    for which, moe in PLANS.items():
        result = run_regression(which, PLAN_READERS[0], {"plan.yaml": base().plan_text_of(which).encode()},
                                then=PLAN_READERS[1:], invalid=False, moe=moe)
        assert result.verdict == "accepted", (which, result)


def test_a_plan_made_for_an_engine_is_exported_to_that_engine(tmp_path):
    """A plan made --for sglang for a family SGLang's prefetch offloader is not wired for uses its --cpu-offload-gb
    (offload.mechanism read_at_use); vLLM's export refuses it in one line that says to make it again --for vllm,
    so the round trip exports such plans to their own engine (seed 62's traces cases 39, 46 and 48 had exported
    them to both)."""
    from pathlib import Path

    from tests.fuzz import case_for
    from tests.fuzz.core import run_case
    from tests.fuzz.traces import READERS, readers_for

    case = case_for("traces", 62, 48)
    assert "--for sglang" in case.mutation and [r for r in case.then if r[0] == "export"] == [
        ["export", "new.yaml", "--to", "sglang", "--explain"]]
    result = run_case(case, Path(tmp_path), 48)
    assert result.verdict == "accepted", result
    assert readers_for(["--budget", "60KB"]) == tuple(list(r) for r in READERS)
