"""Fuzz family of CPU experts sections (issue 37's plans, the error contract's newer surface): a plan make wrote
with experts of every routed layer on the host CPU (Base.hybrid_plan), its CPU ids, per-layer CPU figures or
experts.cpu section edited by hand; every reader must refuse it in one line (check as a stale plan). Unedited, the
plan must pass every reader.
"""

from tests.fuzz.core import Base, Case, yaml_text
from tests.fuzz.derived import DERIVED_COMMANDS
from tests.fuzz.roundtrip import READERS

#: values a hand edit writes where the plan holds a positive ms figure
JUNK_MS = (0, 0.0, -0.05, "fast", None, [], {"ms": 1}, float("nan"), float("inf"), 1e30, True)


def _row_edits(rng, plan: dict) -> list[tuple[str, object]]:
    """(name, edit) of one CPU layer's ids and figures: each leaves a plan make could not have written."""
    experts = plan["experts"]
    rows = [row for row in experts["layers"] if row.get("cpu")]
    row = rng.choice(rows)
    num_experts = experts["num_experts"]
    junk = rng.choice(JUNK_MS)
    return [
        ("cpu id also resident", lambda: row.update(cpu=sorted(set(row["cpu"]) | set(row["resident"][:1]))
                                                     if row["resident"] else row.update(resident=row["cpu"][:1]))),
        ("cpu id past num_experts", lambda: row.update(cpu=[*row["cpu"], num_experts])),
        ("cpu ids descending", lambda: row.update(cpu=sorted(row["cpu"], reverse=True) + [row["cpu"][0]])),
        ("cpu ids emptied, cpu_ms kept", lambda: row.update(cpu=[])),
        ("cpu_ms deleted", lambda: row.pop("cpu_ms")),
        ("cpu_ms below the handoff", lambda: row.update(cpu_ms=0.0)),
        ("cpu_ms past every id", lambda: row.update(cpu_ms=row["cpu_ms"] + 10 * len(row["cpu"])
                                                    * row["cpu_ms_per_expert"])),
        (f"cpu_ms_per_expert {junk!r}", lambda: row.update(cpu_ms_per_expert=junk)),
        ("cpu_ms_per_expert x8, cpu_ms with it", lambda: _slower(plan, row, 8.0)),
        ("cpu_ms_per_expert on a layer without cpu ids", lambda: (row.update(cpu=[]), row.pop("cpu_ms"))),
        ("whole_layer row with cpu ids", lambda: row.update(regime="whole_layer", resident=[])),
        *_split_edits(rng, row),
    ]


def _split_edits(rng, row: dict) -> list[tuple[str, object]]:
    """(name, edit) of a layer's per-step split (cpu_take), where it has one (the base plan's layers do)."""
    take = row.get("cpu_take")
    if not take:
        return []
    junk = rng.choice(("half", -1, 1.5, None, {"m": 1}, [[0]], True))
    return [
        ("cpu_take entry past its miss count", lambda: row.update(cpu_take=[*take, len(take) + 1])),
        ("cpu_take negative entry", lambda: row.update(cpu_take=[*take[:-1], -1])),
        (f"cpu_take {junk!r}", lambda: row.update(cpu_take=junk)),
        ("cpu_take all zero", lambda: row.update(cpu_take=[0])),
        ("cpu_take with a cpu id dropped", lambda: row.update(cpu=row["cpu"][1:])),
        ("cpu_take without cpu_ms_per_expert", lambda: row.pop("cpu_ms_per_expert")),
        # an expert split by its rows (make --cpu-experts rows): fractions need cpu_fixed_ms, on the 1/16 grid,
        # within the expert's time, and a plan made with rows
        ("cpu_take a fraction without cpu_fixed_ms", lambda: row.update(cpu_take=[0, 0.5], cpu_fixed_ms=None)),
        ("cpu_take off the 1/16 grid", lambda: row.update(cpu_take=[0, 0.3], cpu_fixed_ms=0.01)),
        ("cpu_fixed_ms past cpu_ms_per_expert", lambda: row.update(cpu_take=[0, 0.5], cpu_fixed_ms=1e6)),
        (f"cpu_fixed_ms {junk!r}", lambda: row.update(cpu_take=[0, 0.5], cpu_fixed_ms=junk)),
        ("cpu_take a fraction in a plan made without rows", lambda: row.update(cpu_take=[0, 0.5], cpu_fixed_ms=0.01)),
    ]


def _slower(plan: dict, row: dict, factor: float) -> None:
    """One layer's CPU experts ``factor`` times slower, its path and the section's sum consistent with it."""
    handoff_ms = plan["experts"]["cpu"]["handoff_ms"]
    more_ms = (factor - 1) * (row["cpu_ms"] - handoff_ms)
    row["cpu_ms"] += more_ms
    row["cpu_ms_per_expert"] *= factor
    plan["experts"]["cpu"]["cpu_ms_per_step"] += more_ms


def _section_edits(rng, plan: dict) -> list[tuple[str, object]]:
    """(name, edit) of the experts.cpu section and what refers to it."""
    experts = plan["experts"]
    cpu = experts["cpu"]
    junk = rng.choice(JUNK_MS)
    return [
        ("experts.cpu deleted", lambda: experts.pop("cpu")),
        ("experts.cpu.dtype int8", lambda: cpu.update(dtype="int8")),
        ("experts.cpu.threads 0", lambda: cpu.update(threads=0)),
        ("experts.cpu.host_copy_bytes with bf16", lambda: cpu.update(host_copy_bytes=4096)),
        (f"experts.cpu.handoff_ms {junk!r}", lambda: cpu.update(handoff_ms=junk)),
        ("experts.cpu.cpu_ms_per_step +1", lambda: cpu.update(cpu_ms_per_step=cpu["cpu_ms_per_step"] + 1)),
        ("experts.cpu.link_ms_per_step x3", lambda: cpu.update(link_ms_per_step=3 * cpu["link_ms_per_step"] + 1)),
        ("experts.cpu_declined beside experts.cpu", lambda: experts.update(cpu_declined="the CPU is slow")),
        ("experts.cpu unknown key", lambda: cpu.update(speedup=2)),
        ("experts.cpu not a mapping", lambda: experts.update(cpu=["bf16", 12])),
        ("inputs.cpu_experts off", lambda: plan["inputs"].update(cpu_experts="off")),
        # the experts' dtype make read (experts.expert_dtype): one the checkpoint does not hold, or not a name
        ("experts.expert_dtype F8_E4M3", lambda: experts.update(expert_dtype="F8_E4M3")),
        (f"experts.expert_dtype {junk!r}", lambda: experts.update(expert_dtype=junk if junk is not None else "")),
    ]


def gen_cpu_plans(rng, base_: Base) -> Case:
    """The hybrid base plan, edited (a CPU layer's ids or figures, or the experts.cpu section) or not (then every
    reader must accept it), read by one reader."""
    if rng.random() < 0.1:  # the round trip: the plan as make wrote it
        files = {"plan.yaml": base_.plan_text_of("hybrid").encode()}
        # check is left out: the plan was written to stdout (see tests.fuzz.derived.gen_derived)
        readers = [[part.replace("new.yaml", "plan.yaml") for part in reader] for reader in READERS
                   if reader[0] != "check"]
        return Case(family="cpu_plans", mutation="hybrid unedited", args=readers[0], invalid=False, files=files,
                    moe=True, then=tuple(readers[1:]))
    plan = base_.plan_copy("hybrid")
    edits = _row_edits(rng, plan) if rng.random() < 0.6 else _section_edits(rng, plan)
    name, edit = rng.choice(edits)
    edit()
    return Case(family="cpu_plans", mutation=name, args=list(rng.choice(DERIVED_COMMANDS)), invalid=True,
                files={"plan.yaml": yaml_text(plan).encode()}, moe=True)
