"""make with the third placement of a routed expert (planner.search.cpu_placement): a profile with cpu_experts
writes CPU expert ids that keep the invariants, --cpu-experts off and a profile without the section plan the same,
a slow CPU is declined with its reason, and show, check, diff and export read what make wrote; hand edits that
break the invariants are refused in one line."""

import dataclasses
import json

import pytest

from planner.search.cpu_experts import CPU_WITHIN_LINK_FACTOR
from planner.units import format_ms
import yaml

from planner.errors import PlanError
from planner.plan.file import read_plan
from planner.search import cpu_experts
from planner.search.cpu_per_step import per_step_split
from tests.conftest import assert_one_line_error, invoke, make_checkpoint
from tests.helpers import roofline_profile

#: the measured expert of the profiles below: Qwen3-30B-A3B's (H 2048, I 768)
QWEN_PARAMS = 3 * 2048 * 768
#: tokens per expert the table holds, and each further token's ms
TABLE_TOKENS = (1, 2, 4, 8, 16)
PER_TOKEN_MS = 0.02
#: the H100 host's bf16 figure for one Qwen3-30B-A3B expert at one token (issue 37), and a CPU ten times slower
FAST_MS, SLOW_MS = 0.342, 3.42
#: a CPU four times faster, which computes the test model's half-size expert in about half the link's time
QUICK_MS = FAST_MS / 4
MAKE = ["--tokens", "1", "--context", "64", "--budget", "200MiB"]


def cpu_section(ms_at_1: float, dtype: str = "bf16") -> dict:
    """A profile's cpu_experts section for a CPU that computes a Qwen3 expert in ``ms_at_1`` at one token."""
    width = 2 if dtype == "bf16" else 4
    return {"threads": 16, "dtype": dtype, "hidden_size": 2048, "intermediate_size": 768,
            "ms_per_expert_at_tokens": {t: ms_at_1 + (t - 1) * PER_TOKEN_MS for t in TABLE_TOKENS},
            "weight_bytes_per_s": width * QWEN_PARAMS / ((ms_at_1 - 0.01) / 1e3),
            "flops_per_s": 2 * QWEN_PARAMS / (PER_TOKEN_MS / 1e3), "overhead_us": 10.0, "source": "assumed",
            "note": "built by the test"}


@pytest.fixture
def measured_moe(tmp_path, monkeypatch):
    """A header-only MoE checkpoint whose experts (4.5 MiB) take the link ~0.1 ms each, and profiles with and
    without the CPU's figures, in a working directory; the CPU path priced as measured (planner.search.
    cpu_experts' constants)."""
    monkeypatch.chdir(tmp_path)
    make_checkpoint(tmp_path / "moe", hidden=1024, intermediate=1024, num_heads=8, data=False,
                    moe={"num_experts": 16, "top_k": 2, "expert_intermediate": 768})
    base = yaml.safe_load(open(roofline_profile(tmp_path)))
    for name, section in (("fast", cpu_section(FAST_MS)), ("slow", cpu_section(SLOW_MS)),
                          ("fp32", cpu_section(FAST_MS / 2, "fp32"))):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**base, "cpu_experts": section}))
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(base))
    return tmp_path


@pytest.fixture
def moe(measured_moe, monkeypatch):
    """measured_moe on a host whose CPU path runs beside the link after a 0.05 ms handoff, and whose fast.yaml CPU
    computes this model's expert in about half the link's time (fp32.yaml's too, with an fp32 copy): what the
    plan's wiring needs to be exercised (the measured price is declined here: test_the_measured_cpu_path_is_
    declined). A CPU slower per expert than the link saves nothing at one sequence of top-2 routing: a step that
    sends a pair to it waits for it (E[max])."""
    base = yaml.safe_load(open(measured_moe / "fast.yaml"))
    for name, dtype in (("fast", "bf16"), ("fp32", "fp32")):
        (measured_moe / f"{name}.yaml").write_text(yaml.safe_dump({**base, "cpu_experts": cpu_section(QUICK_MS,
                                                                                                        dtype)}))
    monkeypatch.setattr(cpu_experts, "CPU_PATH_OVERLAPS_LINK", True)
    monkeypatch.setattr(cpu_experts, "CPU_HANDOFF_MS", 0.05)
    monkeypatch.setattr(cpu_experts, "CPU_IN_STEP_FACTOR", 1.0)
    monkeypatch.setattr(cpu_experts, "CPU_IN_STEP_EXTRA_MS", 0.0)
    return measured_moe


def test_the_measured_cpu_path_is_declined(measured_moe, monkeypatch):
    """Priced as measured (a pair inside the step at CPU_IN_STEP_FACTOR x the lone rate), this CPU takes about
    three times the link's ~0.1 ms for one of this model's small experts, a share too small to repay its handoff:
    make fetches every miss, predicts what fetch-only predicts and says why; priced at the lone rate but run after
    the link (serial), the handoff saves nothing, and it says that."""
    make("fast.yaml", "plan.yaml")
    make("none.yaml", "none-plan.yaml")
    experts = read_plan("plan.yaml").experts
    assert experts.cpu is None and not any(row.cpu for row in experts.layers)
    # within CPU_WITHIN_LINK_FACTOR of the link, its split's own optimum declines it: no faster than fetching
    assert "no faster than fetching every miss" in experts.cpu_declined
    assert read_plan("plan.yaml").prediction.step_ms == read_plan("none-plan.yaml").prediction.step_ms
    monkeypatch.setattr(cpu_experts, "CPU_IN_STEP_FACTOR", 1.0)
    monkeypatch.setattr(cpu_experts, "CPU_IN_STEP_EXTRA_MS", 0.0)
    monkeypatch.setattr(cpu_experts, "CPU_PATH_OVERLAPS_LINK", False)
    make("fast.yaml", "serial.yaml")
    declined = read_plan("serial.yaml").experts.cpu_declined
    assert "after the link" in declined and "handoff" in declined


def test_a_measured_handoff_in_the_profile_prices_the_cpu_path(moe):
    """calibrate's handoff_us (measured on the GPU's host) replaces CPU_HANDOFF_MS (here 0.05 ms): the plan records
    the measured figure, and the CPU takes misses at it."""
    data = yaml.safe_load(open("fast.yaml"))
    data["cpu_experts"]["handoff_us"] = 20.0
    (moe / "measured.yaml").write_text(yaml.safe_dump(data))
    make("measured.yaml", "plan.yaml")
    experts = read_plan("plan.yaml").experts
    assert experts.cpu is not None and experts.cpu.handoff_ms == pytest.approx(0.02)
    assert any(row.cpu for row in experts.layers)


def make(profile: str, output: str, *extra: str) -> None:
    result = invoke(["make", "--model", "moe", "--gpu", profile, *MAKE, *extra, "-o", output])
    assert result.exit_code == 0, result.stderr


def test_make_puts_non_resident_experts_on_the_cpu_within_the_invariants(moe):
    make("fast.yaml", "plan.yaml", "--cpu-experts", "fixed")
    make("fast.yaml", "off.yaml", "--cpu-experts", "off")
    plan, off = read_plan("plan.yaml"), read_plan("off.yaml")
    experts = plan.experts
    assert experts.cpu is not None and experts.cpu.dtype == "bf16" and experts.cpu.host_copy_bytes == 0
    assert experts.cpu.threads == 16 and experts.cpu_declined is None
    for row in experts.routed_layers:
        assert row.cpu and list(row.cpu) == sorted(set(row.cpu))
        assert not set(row.cpu) & set(row.resident) and max(row.cpu) < experts.num_experts
        # uniform routing: the highest non-resident ids
        assert row.cpu == tuple(range(experts.num_experts - len(row.cpu), experts.num_experts))
        assert row.cpu_ms >= experts.cpu.handoff_ms
    assert experts.cpu.cpu_ms_per_step == pytest.approx(sum(row.cpu_ms for row in experts.cpu_layers), abs=1e-3)
    # the hybrid step beats fetching every miss, and the link carries less
    assert plan.prediction.step_ms < off.prediction.step_ms
    assert plan.prediction.copy_bytes_per_step < off.prediction.copy_bytes_per_step
    # the zero row the CPU's experts read as resident at takes one expert's room: one resident expert fewer at most
    resident = sum(len(row.resident) for row in experts.layers)
    assert sum(len(row.resident) for row in off.experts.layers) - resident in (0, 1)
    sets = 2 if experts.prefetching else 1
    assert experts.fetch_buffer_bytes == (sets * experts.fetch_slots + 1) * experts.expert_bytes
    assert plan.memory.gpu_bytes <= off.memory.gpu_bytes + experts.expert_bytes


def test_cpu_experts_off_plans_as_a_profile_without_the_section(moe):
    make("fast.yaml", "off.yaml", "--cpu-experts", "off")
    make("none.yaml", "none.yaml.out")
    make("none.yaml", "none-off.yaml", "--cpu-experts", "off")

    def body(path: str) -> dict:
        data = yaml.safe_load(open(path))
        data["inputs"].pop("cpu_experts", None)
        data["inputs"].pop("gpu")
        data["hardware"].pop("profile")
        return data

    assert body("off.yaml") == body("none.yaml.out") == body("none-off.yaml")
    text = open("none.yaml.out").read()
    assert "cpu" not in yaml.safe_load(text)["experts"] and "cpu_experts" not in text  # nothing new written


def test_a_slow_cpu_is_declined_and_the_plan_says_why(moe):
    make("slow.yaml", "slow.yaml.out")
    make("none.yaml", "none.yaml.out")
    plan, fetch_only = read_plan("slow.yaml.out"), read_plan("none.yaml.out")
    assert plan.experts.cpu is None and plan.experts.cpu_layers == ()
    assert f"more than {CPU_WITHIN_LINK_FACTOR:g}x" in plan.experts.cpu_declined
    assert "fetching only" in plan.experts.cpu_declined
    assert plan.prediction.step_ms == fetch_only.prediction.step_ms
    shown = invoke(["show", "slow.yaml.out"])
    assert shown.exit_code == 0 and "CPU experts: declined:" in shown.stdout


def test_an_fp32_host_copy_is_counted_and_held_to_the_host_memory(moe):
    make("fp32.yaml", "fp32.yaml.out", "--cpu-experts", "fixed")
    plan = read_plan("fp32.yaml.out")
    cpu, layers = plan.experts.cpu, plan.experts.cpu_layers
    expert_params = 3 * 1024 * 768
    assert cpu.dtype == "fp32" and cpu.host_copy_bytes == 4 * expert_params * sum(len(row.cpu) for row in layers)
    room = plan.memory.host_pinned_bytes + cpu.host_copy_bytes - 1
    make("fp32.yaml", "tight.yaml", "--host-memory", f"{room}B", "--cpu-experts", "fixed")
    tight = read_plan("tight.yaml")
    assert tight.experts.cpu is None and "fp32 host copy" in tight.experts.cpu_declined


@pytest.mark.parametrize("choice, words", [("fixed", ("Third placement: the host CPU computes",
                                                      "resident / CPU / fetched")),
                                           ("auto", ("Third placement, split per step", "j(m) for m = 0, 1, 2"))])
def test_show_check_diff_and_export_read_a_plan_with_cpu_experts(moe, choice, words):
    make("fast.yaml", "plan.yaml", "--cpu-experts", choice)
    make("fast.yaml", "off.yaml", "--cpu-experts", "off")
    shown = invoke(["show", "plan.yaml"])
    assert shown.exit_code == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert all(word in text for word in words)
    assert all(bool(row.cpu_take) == (choice == "auto") for row in read_plan("plan.yaml").experts.cpu_layers)
    assert "2^-6" in text and "1e-5" in text
    _assert_the_cpu_rate_moves_the_step(read_plan("plan.yaml"), text)
    assert invoke(["check", "plan.yaml", "off.yaml"]).exit_code == 0
    diff = invoke(["diff", "off.yaml", "plan.yaml"])
    assert diff.exit_code == 0, diff.stderr
    plan = read_plan("plan.yaml")
    count = sum(len(row.cpu) for row in plan.experts.cpu_layers)
    assert f"experts on the host CPU 0 -> {count}" in " ".join(diff.stdout.split())
    figures = invoke(["diff", "--json", "off.yaml", "plan.yaml"])
    assert figures.exit_code == 0, figures.stderr
    experts = json.loads(figures.stdout)["experts"]
    assert experts["num_cpu"]["old"] == 0 and experts["num_cpu"]["new"] == count > 0
    assert experts["cpu_ms_per_step"]["new"] == plan.experts.cpu.cpu_ms_per_step
    for engine in ("vllm", "sglang"):
        exported = invoke(["export", "plan.yaml", "--to", engine])
        assert exported.exit_code == 0, exported.stderr
        said = " ".join(exported.stderr.split())
        assert "has no CPU experts" in said and "--n-cpu-moe" in said
        layers = "|".join(str(row.index) for row in read_plan("plan.yaml").experts.cpu_layers)
        assert f'-ot "blk\\.({layers})\\.ffn_(up|down|gate)_exps=CPU"' in said
    again = invoke(["show", "--json", "plan.yaml"])
    assert again.exit_code == 0 and '"cpu"' in again.stdout


def test_cpu_time_scale_prices_the_cpu_at_a_multiple_and_is_read_back(moe):
    """make --cpu-time-scale 2: every CPU expert priced at twice its price, the input recorded and regenerated (check
    passes), show says so; 0, a negative and one beyond MAX_CPU_TIME_SCALE are one-line usage errors, and a
    hand-edited scale out of range a one-line plan error."""
    make("fast.yaml", "plan.yaml")
    make("fast.yaml", "slow2.yaml", "--cpu-time-scale", "2")
    plan, slower = read_plan("plan.yaml"), read_plan("slow2.yaml")
    assert slower.inputs.cpu_time_scale == 2.0 and plan.inputs.cpu_time_scale is None
    assert "cpu_time_scale" not in open("plan.yaml").read() and "--cpu-time-scale 2" in open("slow2.yaml").read()
    if slower.experts.cpu is not None:
        prices = {row.index: row.cpu_ms_per_expert for row in plan.experts.cpu_layers}
        assert all(row.cpu_ms_per_expert == pytest.approx(2 * prices[row.index], abs=2e-4)  # 4 decimals written
                   for row in slower.experts.cpu_layers if row.index in prices)
    assert slower.prediction.step_ms >= plan.prediction.step_ms
    assert invoke(["check", "slow2.yaml"]).exit_code == 0
    shown = invoke(["show", "slow2.yaml"])
    assert shown.exit_code == 0 and ("2x calibrate's rate (--cpu-time-scale)" in " ".join(shown.stdout.split())
                                     or slower.experts.cpu is None)
    for bad in ("0", "-1", "101"):
        result = invoke(["make", "--model", "moe", "--gpu", "fast.yaml", *MAKE, "--cpu-time-scale", bad, "-o",
                         "bad.yaml"])
        assert_one_line_error(result.exit_code, result.stderr, contains=("--cpu-time-scale",))
    edited = _edited("slow2.yaml", lambda data: data["inputs"].update(cpu_time_scale=0.0))
    result = invoke(["show", edited])
    assert_one_line_error(result.exit_code, result.stderr, contains=("cpu_time_scale",))


def _assert_the_cpu_rate_moves_the_step(plan, shown: str) -> None:
    """The plan's step re-timed with its CPU experts at a share of their price: its prediction at 1x, slower as the
    CPU is, and show states the ends of the measured spread."""
    from planner.search.routed_step import cpu_rate_step_ms
    from planner.views.show_cpu_experts import CPU_RATE_SPREAD

    steps = [cpu_rate_step_ms(plan, scale) for scale in (0.5, 1.0, 2.0, 4.0)]
    assert steps[1] == pytest.approx(plan.prediction.step_ms, abs=1e-3)
    assert steps == sorted(steps) and steps[3] > steps[1]
    # run --bench's host clock (handoffs left out) at the plan's price is 1x, and twice it re-times the step at 2x
    from planner.search.routed_step import host_cpu_scale

    priced_ms = sum(row.cpu_ms - plan.experts.cpu.handoff_ms for row in plan.experts.cpu_layers)
    assert host_cpu_scale(plan, priced_ms) == pytest.approx(1.0)
    assert cpu_rate_step_ms(plan, host_cpu_scale(plan, 2 * priced_ms)) == pytest.approx(steps[2])
    assert host_cpu_scale(plan, 0.0) is None
    fast, slow = (cpu_rate_step_ms(plan, scale) for scale in CPU_RATE_SPREAD)
    assert (f"The host CPU's rate moves the step: at {CPU_RATE_SPREAD[0]:g}x its price {format_ms(fast)}, at "
            f"{CPU_RATE_SPREAD[1]:g}x {format_ms(slow)}") in shown
    # a per-step plan: what run's re-split makes of it at both ends; fixed ids have no such line
    from planner.search.cpu_resplit import resplit_at_scale

    resplit = [resplit_at_scale(plan, scale) for scale in CPU_RATE_SPREAD]
    said = (f"run re-splits each step's misses at the rate it measures (every 16 decode steps, where it is 15% or more "
            f"from the tables'): the step then {format_ms(resplit[0].step_ms)} at {CPU_RATE_SPREAD[0]:g}x and "
            f"{format_ms(resplit[1].step_ms)} at {CPU_RATE_SPREAD[1]:g}x") if None not in resplit else None
    assert (said in shown) if said else ("run re-splits" not in shown)
    assert said is None or resplit[1].step_ms <= slow + 1e-9


def _edited(path: str, edit) -> str:
    data = yaml.safe_load(open(path))
    edit(data)
    out = path.replace(".yaml", "-edited.yaml")
    with open(out, "w") as handle:
        yaml.safe_dump(data, handle, sort_keys=False)
    return out


def _first_cpu_layer(data: dict) -> dict:
    return next(row for row in data["experts"]["layers"] if row.get("cpu"))


def _slower_cpu_path(data: dict, factor: float) -> None:
    """One layer's CPU experts ``factor`` times slower, its CPU path and the section's sum with them: the step the
    plan states no longer follows."""
    row, handoff_ms = _first_cpu_layer(data), data["experts"]["cpu"]["handoff_ms"]
    more_ms = (factor - 1) * (row["cpu_ms"] - handoff_ms)
    row["cpu_ms"] += more_ms
    row["cpu_ms_per_expert"] *= factor
    data["experts"]["cpu"]["cpu_ms_per_step"] += more_ms


@pytest.mark.parametrize("edit, words", [
    (lambda d: _first_cpu_layer(d).__setitem__("cpu", [*_first_cpu_layer(d)["resident"][:1],
                                                       *_first_cpu_layer(d)["cpu"]]), "also resident"),
    (lambda d: d["experts"].pop("cpu"), "experts.cpu is given exactly where"),
    (lambda d: _first_cpu_layer(d).__setitem__("cpu", [99]), "below num_experts"),
    (lambda d: _first_cpu_layer(d).__setitem__("cpu", [15, 14]), "ascending and distinct"),
    (lambda d: d["experts"]["cpu"].__setitem__("cpu_ms_per_step", 9.0), "cpu_ms_per_step"),
    (lambda d: d["experts"]["cpu"].__setitem__("dtype", "int8"), "experts.cpu.dtype"),
    (lambda d: d["inputs"].__setitem__("cpu_experts", "off"), "inputs.cpu_experts is off"),
    (lambda d: _slower_cpu_path(d, 50.0), "prediction.step_ms"),
        (lambda d: _first_cpu_layer(d).__setitem__("cpu_ms", 9.0), "more than its handoff"),
])
def test_hand_edits_that_break_the_cpu_invariants_are_refused_in_one_line(moe, edit, words):
    make("fast.yaml", "plan.yaml", "--cpu-experts", "fixed")
    _assert_refused_in_one_line("plan.yaml", edit, words)


def _assert_refused_in_one_line(path: str, edit, words: str) -> None:
    """The plan at ``path`` edited by ``edit``: read_plan refuses it in one line naming ``words``, and check exits
    non-zero without a traceback."""
    with pytest.raises(PlanError) as error:
        read_plan(_edited(path, edit))
    assert words in str(error.value) and "\n" not in str(error.value)
    result = invoke(["check", _edited(path, edit)])
    assert result.exit_code != 0 and "Traceback" not in result.stderr


def test_cpu_ids_on_a_whole_layer_are_refused(moe):
    make("none.yaml", "whole.yaml", "--budget", "120MiB", "--routed-experts", "off")
    whole = yaml.safe_load(open("whole.yaml"))
    assert whole["experts"]["regime"] == "whole_layer"

    def edit(data):
        data["experts"]["layers"][0]["cpu"] = [15]
        data["experts"]["layers"][0]["cpu_ms"] = 0.1

    with pytest.raises(PlanError, match="a whole_layer row has cpu ids"):
        read_plan(_edited("whole.yaml", edit))


def test_make_refuses_an_unknown_cpu_experts_choice_in_one_line(moe):
    result = invoke(["make", "--model", "moe", "--gpu", "fast.yaml", *MAKE, "--cpu-experts", "maybe"])
    assert result.exit_code != 0 and "--cpu-experts" in result.stderr and "Traceback" not in result.stderr


def test_routed_experts_off_plans_whole_layers_as_the_engines_offload(moe):
    """--routed-experts off: every MoE layer resident or streamed whole (the engines' offload, without naming an
    engine, so for any architecture): the plan says why routed experts are not planned, records the choice, and
    every reader takes it; a hand edit that gives such a plan routed layers, or an unknown choice, is one line."""
    make("none.yaml", "routed.yaml")
    make("none.yaml", "whole.yaml", "--routed-experts", "off")
    routed, whole = read_plan("routed.yaml"), read_plan("whole.yaml")
    assert routed.experts.regime == "routed" and routed.inputs.routed_experts == "auto"
    assert whole.experts.regime == "whole_layer" and whole.experts.routed_layers == ()
    assert whole.inputs.routed_experts == "off" and "routed_experts" not in open("routed.yaml").read()
    assert "--routed-experts off" in whole.experts.routed_unavailable
    assert whole.prediction.step_ms > routed.prediction.step_ms  # routed experts were the faster here
    for words in (["show", "whole.yaml"], ["check", "whole.yaml"], ["diff", "routed.yaml", "whole.yaml"],
                  ["export", "whole.yaml", "--to", "vllm"]):
        assert invoke(words).exit_code == 0, words
    assert "--routed-experts off" in " ".join(invoke(["show", "whole.yaml"]).stdout.split())
    with pytest.raises(PlanError, match="inputs.routed_experts is off") as error:
        read_plan(_edited("routed.yaml", lambda d: d["inputs"].__setitem__("routed_experts", "off")))
    assert "\n" not in str(error.value)
    with pytest.raises(PlanError, match="inputs.routed_experts 'sometimes' is not one of auto, off"):
        read_plan(_edited("whole.yaml", lambda d: d["inputs"].__setitem__("routed_experts", "sometimes")))
    refused = invoke(["make", "--model", "moe", "--gpu", "none.yaml", *MAKE, "--routed-experts", "never",
                      "-o", "never.yaml"])
    assert refused.exit_code != 0 and "--routed-experts 'never' is not one of auto, off" in refused.stderr
    assert "\n" not in refused.stderr.strip() and not (moe / "never.yaml").exists()


def test_run_bench_reads_the_plans_expected_cpu_experts_a_step(moe):
    """run --bench puts the host's distinct CPU experts a step beside the plan's expectation
    (runtime.routed_fetches.planned_cpu_experts): each CPU layer's path less the handoff, over one expert's price;
    None for a plan written without cpu_ms_per_expert."""
    pytest.importorskip("torch")
    from runtime.routed_fetches import planned_cpu_experts

    make("fast.yaml", "plan.yaml")
    plan = read_plan("plan.yaml")
    rows, handoff_ms = plan.experts.cpu_layers, plan.experts.cpu.handoff_ms
    assert rows
    want = sum((row.cpu_ms - handoff_ms) / row.cpu_ms_per_expert for row in rows)
    assert planned_cpu_experts(plan) == pytest.approx(want) and 0 < want <= sum(len(row.cpu) for row in rows)
    layers = tuple(dataclasses.replace(row, cpu_ms_per_expert=None, cpu_take=(), cpu_fixed_ms=None)
                   for row in plan.experts.layers)
    older = dataclasses.replace(plan, experts=dataclasses.replace(plan.experts, layers=layers))
    assert planned_cpu_experts(older) is None



def test_auto_splits_each_steps_misses_by_count_where_the_cpu_reads_in_place(moe):
    """--cpu-experts auto with a bf16 CPU: every CPU layer may send any non-resident expert to the CPU, a table j(m)
    of whole counts says how many of a step's m misses; the step is no slower than fixed ids' and faster than
    fetching every miss. An fp32 host copy keeps fixed ids (a copy of every non-resident expert is not planned)."""
    make("fast.yaml", "auto.yaml")
    make("fast.yaml", "fixed.yaml", "--cpu-experts", "fixed")
    make("fast.yaml", "off.yaml", "--cpu-experts", "off")
    auto, fixed, off = (read_plan(name) for name in ("auto.yaml", "fixed.yaml", "off.yaml"))
    experts = auto.experts
    assert experts.cpu_layers and auto.inputs.cpu_experts == "auto" and fixed.inputs.cpu_experts == "fixed"
    for row in experts.cpu_layers:
        assert set(row.cpu) | set(row.resident) == set(range(experts.num_experts)) and row.cpu_take
        assert all(0 <= j <= m for m, j in enumerate(row.cpu_take)) and max(row.cpu_take) > 0
    assert auto.prediction.step_ms <= fixed.prediction.step_ms < off.prediction.step_ms


def test_a_per_step_split_with_an_fp32_copy_copies_every_non_resident_expert_or_keeps_fixed_ids(moe):
    """With an fp32 host copy the per-step split copies every non-resident expert, counted in host_copy_bytes; where
    --host-memory holds fixed ids' copy but not that, the layers keep fixed ids."""
    make("fp32.yaml", "split.yaml")
    make("fp32.yaml", "fixed.yaml", "--cpu-experts", "fixed")
    split, fixed = read_plan("split.yaml"), read_plan("fixed.yaml")
    expert_params = 3 * 1024 * 768
    rows = split.experts.cpu_layers
    assert rows and all(row.cpu_take for row in rows)
    non_resident = sum(split.experts.num_experts - len(row.resident) for row in rows)
    assert split.experts.cpu.host_copy_bytes == 4 * expert_params * non_resident
    assert fixed.experts.cpu.host_copy_bytes < split.experts.cpu.host_copy_bytes
    room = split.memory.host_pinned_bytes + split.experts.cpu.host_copy_bytes - 1
    make("fp32.yaml", "tight.yaml", "--host-memory", f"{room}B")
    tight = read_plan("tight.yaml")
    assert tight.experts.cpu is not None and not any(row.cpu_take for row in tight.experts.cpu_layers)
    assert tight.memory.host_pinned_bytes + tight.experts.cpu.host_copy_bytes <= room


def _first_split_layer(data: dict) -> dict:
    return next(row for row in data["experts"]["layers"] if row.get("cpu_take"))


@pytest.mark.parametrize("edit, words", [
    (lambda d: _first_split_layer(d).__setitem__("cpu_take", [0, 2]), "cpu_take[1] is 2"),
    (lambda d: _first_split_layer(d).__setitem__("cpu_take", [0, -1]), "cpu_take must hold numbers from 0"),
    (lambda d: _first_split_layer(d).update(cpu_take=[0, 0.3], cpu_fixed_ms=0.01), "not a multiple of 1/16"),
    (lambda d: _first_split_layer(d).update(cpu_take=[0, 0.5], cpu_fixed_ms=None),
     "cpu_fixed_ms is given exactly where cpu_take holds a fraction"),
    (lambda d: _first_split_layer(d).update(cpu_take=[0, 1], cpu_fixed_ms=0.01),
     "cpu_fixed_ms is given exactly where cpu_take holds a fraction"),
    (lambda d: _first_split_layer(d).update(cpu_take=[0, 0.5], cpu_fixed_ms=99.0),
     "must be from 0 to cpu_ms_per_expert"),
    (lambda d: _first_split_layer(d).__setitem__("cpu", _first_split_layer(d)["cpu"][1:]),
     "must be every expert not resident"),
    (lambda d: _first_split_layer(d).update(cpu_take=[0], cpu_fixed_ms=None), "the most its cpu_take sends"),
    (lambda d: _first_split_layer(d).update(cpu_take=[0, 1, 2], cpu_fixed_ms=None), "prediction.step_ms"),
    (lambda d: _first_split_layer(d).pop("cpu_ms_per_expert"), "cpu_take is given only with"),
])
def test_hand_edits_of_a_per_step_split_are_refused_in_one_line(moe, edit, words):
    make("fast.yaml", "plan.yaml")
    _assert_refused_in_one_line("plan.yaml", edit, words)


def test_a_decode_step_routing_more_pairs_than_experts_is_priced_as_staged_whole(moe):
    """16 sequences of top-2 over 16 experts route 32 pairs: the runtime's fetch slots (min(pairs, experts)) do
    not hold them, so the step copies every expert of a routed layer whole, as a prefill chunk does
    (planner.model.experts.decode_gathers): the routed step is priced at least at that copy, with no CPU experts
    (the plan says why where routed is chosen), and every reader takes the plan."""
    result = invoke(["make", "--model", "moe", "--gpu", "fast.yaml", "--tokens", "16", "--sequences", "16",
                     "--context", "64", "--budget", "200MiB", "-o", "wide.yaml"])
    assert result.exit_code == 0, result.stderr
    plan = read_plan("wide.yaml")
    experts = plan.experts
    (point,) = experts.points
    staged_bytes = len(experts.layers) * experts.num_experts * experts.expert_bytes  # every expert, every step
    assert point.routed_step_ms is not None
    assert 1e-3 * point.routed_step_ms * plan.hardware.h2d_bytes_per_s >= 0.99 * staged_bytes
    assert experts.cpu is None and experts.prefetch is None
    if experts.routed_layers:
        assert "more than the 16 experts" in experts.cpu_declined
    for words in (["check", "wide.yaml"], ["show", "wide.yaml"]):
        assert invoke(words).exit_code == 0, words


def test_a_serving_plan_weighs_cpu_experts_at_each_concurrency(moe):
    """--concurrency: each concurrency the search weighs prices the CPU's share (its routed step no slower than
    fetching every miss), the chosen one's layers split per step, and every reader takes the plan."""
    args = ["--concurrency", "2", "--context", "64", "--budget", "200MiB"]
    for choice, output in (("auto", "serve.yaml"), ("off", "serve-off.yaml")):
        result = invoke(["make", "--model", "moe", "--gpu", "fast.yaml", *args, "--cpu-experts", choice, "-o", output])
        assert result.exit_code == 0, result.stderr
    plan, off = read_plan("serve.yaml"), read_plan("serve-off.yaml")
    assert plan.serving is not None and plan.experts.cpu is not None and plan.experts.cpu_layers
    assert all(row.cpu_take for row in plan.experts.cpu_layers)
    assert off.experts.cpu is None
    assert plan.prediction.step_ms < off.prediction.step_ms
    for here, there in zip(plan.experts.points, off.experts.points):
        assert here.routed_step_ms <= there.routed_step_ms
    for words in (["check", "serve.yaml"], ["show", "serve.yaml"], ["export", "serve.yaml", "--to", "vllm"],
                  ["diff", "serve-off.yaml", "serve.yaml"]):
        assert invoke(words).exit_code == 0, words


@pytest.mark.parametrize("accuracy, budget", [("0.3", "200MiB"), ("0.8", "260MiB")])
def test_the_prefetch_depth_is_chosen_with_the_cpu_beside_the_link(moe, accuracy, budget):
    """A plan with CPU experts is at least as fast as the hybrid at any one prefetch depth make could pin (none
    included): the depth is chosen with the CPU taking misses, not for fetching alone. At 0.8 and 260 MiB fetching
    alone prefers no prefetch, and with the CPU a depth of one is faster (the chosen plan had been 0.448 ms, the
    depth-1 hybrid 0.446); a Mixtral shape at one sequence went the other way (73.8 ms at the fetch-only depth,
    68.8 without prefetch)."""
    flags = ("--prefetch-accuracy", accuracy, "--budget", budget)
    make("fast.yaml", "chosen.yaml", *flags)
    chosen = read_plan("chosen.yaml")
    assert chosen.experts.cpu is not None
    pinned = []
    for depth in ("0", "1", "2"):
        make("fast.yaml", f"depth-{depth}.yaml", *flags, "--prefetch-depth", depth)
        pinned.append(read_plan(f"depth-{depth}.yaml").prediction.step_ms)
    assert chosen.prediction.step_ms <= min(pinned)


def test_rows_may_split_one_expert_by_its_rows_and_auto_does_not(moe, monkeypatch):
    """--cpu-experts rows prices a fraction of one more expert (its first rows on the CPU) per miss count and writes
    it with the fixed part it pays (here without PART_EXTRA_MS, which this fixture's small experts cannot carry:
    with it, rows keeps them whole); auto writes whole counts only and is no faster; check passes both, and an
    auto plan edited to hold a fraction is refused in one line."""
    make("fast.yaml", "priced.yaml", "--cpu-experts", "rows")
    assert all(row.cpu_fixed_ms is None for row in read_plan("priced.yaml").experts.layers)
    monkeypatch.setattr(cpu_experts, "PART_EXTRA_MS", 0.0)
    per_step_split.cache_clear()  # its tables were priced with the extra
    try:
        make("fast.yaml", "rows.yaml", "--cpu-experts", "rows")
    finally:
        per_step_split.cache_clear()  # nor may later tests read tables priced without it
    make("fast.yaml", "whole.yaml", "--cpu-experts", "auto")
    auto, whole = read_plan("rows.yaml"), read_plan("whole.yaml")
    parted = [row for row in auto.experts.layers if row.cpu_fixed_ms is not None]
    assert parted and all(any(take != int(take) for take in row.cpu_take) for row in parted)
    assert all(0 < row.cpu_fixed_ms < row.cpu_ms_per_expert for row in parted)
    assert all(take == int(take) and row.cpu_fixed_ms is None for row in whole.experts.layers for take in row.cpu_take)
    assert auto.prediction.step_ms < whole.prediction.step_ms
    for path in ("rows.yaml", "whole.yaml"):
        assert invoke(["check", path]).exit_code == 0

    def fraction(data: dict) -> None:
        _first_split_layer(data).update(cpu_take=[0, 0.5], cpu_fixed_ms=0.01)

    _assert_refused_in_one_line("whole.yaml", fraction, "inputs.cpu_experts is auto")
