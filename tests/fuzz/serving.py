"""Fuzz families of serving plans: make's serving flags, and a plan's serving, workload, memory and adapters
sections edited by hand (every field null or of the wrong type, and the contradictions make never writes)."""

import json

import yaml

from tests.fuzz.adapters import adapter_files, adapter_plan_text
from tests.fuzz.core import BASE_ARGS, GUARD_NAME, Base, Case, yaml_text

#: (flag, values, values that are invalid) for make --concurrency: the flags a serving plan reads, and those it
#: does not (--tokens, --sequences) but checks all the same
SERVING_FLAGS = {
    "--tokens": (("8", "0", "-1", "7", "9" * 30, "2048"), ("0", "-1", "9" * 30)),
    "--sequences": (("1", "0", "-1", "3", "9" * 30), ("0", "-1", "9" * 30)),
    "--max-tpot-ms": (("50", "0", "-1", "1e308", "1e9", "1e10", "nan", "inf", "5e-324", "0.001"),
                      ("0", "-1", "1e308", "1e10", "nan", "inf")),
    "--host-memory": (("1GiB", "0B", "0GiB", "1B", "-1B", "1e400GiB", "5e-324GiB"), ("0B", "0GiB", "-1B", "1e400GiB")),
    "--gpu-memory": (("24GiB", "0B", "1B", "1e400GiB", "-1GiB", "100MiB"), ("0B", "1e400GiB", "-1GiB")),
    "--kv-dtype": (("auto", "bf16", "fp8", "fp32", "int3", "", "FP8"), ("int3", "", "FP8")),
    "--chunk": (("64", "1", "0", "-1", "9" * 30, str(2**24), str(2**24 + 1)), ("0", "-1", "9" * 30, str(2**24 + 1))),
    "--context": (("64", "1", "0", "-1", str(2**32), str(2**32 + 1)), ("0", "-1", str(2**32 + 1))),
    "--budget": (("21632B", "1B", "0B", "1e400GiB"), ("0B", "1e400GiB")),
}
CONCURRENCIES = (("auto", False), ("8", False), ("1..64", False), ("4096", False), ("0", True), ("64..8", True),
                 ("4097", True), ("1..4097", True), ("-1", True), ("8..", True), ("..8", True), ("x", True))


def gen_serving_flags(rng, base_: Base) -> Case:
    """make --concurrency with serving flags at and past their edges; every value refused without --concurrency
    is refused with it."""
    concurrency, invalid = rng.choice(CONCURRENCIES) if rng.random() < 0.3 else ("auto", False)
    args, names = [*BASE_ARGS, "--concurrency", concurrency], [f"--concurrency={concurrency}"]
    flags = rng.sample(sorted(SERVING_FLAGS), rng.randint(1, 3))
    if "--context" not in flags:
        args += ["--context", "64"]
    for flag in flags:
        values, bad = SERVING_FLAGS[flag]
        value = rng.choice(values)
        args += [flag, value]
        invalid = invalid or value in bad
        names.append(flag)
    if "--tokens" in flags and "--sequences" in flags:  # --tokens 7 --sequences 3: not a multiple, refused
        tokens, sequences = (args[args.index(f) + 1] for f in ("--tokens", "--sequences"))
        if tokens.lstrip("-").isdigit() and sequences.lstrip("-").isdigit() and int(sequences) > 0:
            invalid = invalid or int(tokens) % int(sequences) != 0
    if "--tokens" in flags and "--sequences" not in flags:
        tokens = args[args.index("--tokens") + 1]
        invalid = invalid or tokens in SERVING_FLAGS["--tokens"][1]
    args += ["-o", GUARD_NAME]
    return Case(family="serving_flags", mutation=" ".join(sorted(names)), args=args, invalid=invalid)


# ---- plan sections edited by hand -----------------------------------------------------------------------------

SECTION_COMMANDS = (["show", "plan.yaml"], ["show", "plan.yaml", "--json"], ["export", "plan.yaml", "--to", "vllm"],
                    ["export", "plan.yaml", "--to", "sglang"], ["export", "plan.yaml", "--to", "vllm", "--tp", "2"],
                    ["export", "plan.yaml", "--to", "sglang", "--tp", "3"], ["diff", "plan.yaml", "graph-plan.yaml"],
                    ["check", "plan.yaml"])
#: values of a wrong type or out of range for any field of these sections
WRONG = ("x", "", [], {}, True, [1], {"a": 1}, -1, -0.5, 2**70, 10**30, float("nan"), float("inf"), 1e308)
#: text fields whose value make checks (a changed string elsewhere, a fingerprint or a revision, may be valid)
CHECKED_TEXT = {"kv_dtype", "name", "source", "concurrency"}
#: fields that may be null only together with others (the reader refuses one alone); revision alone may be null
NULLABLE_ALONE = {"revision", "max_tpot_ms"}


def _serving_contradictions(plan: dict) -> list[tuple[str, callable]]:
    """(name, edit) pairs, each giving a serving plan make could not have written."""
    serving, workload, inputs, memory = plan["serving"], plan["workload"], plan["inputs"], plan["memory"]
    chosen = workload["concurrency"]

    def setter(target, key, value):
        return lambda: target.__setitem__(key, value)

    def both(*edits):
        return lambda: [edit() for edit in edits]

    row = serving["points"][0]
    return [
        ("concurrency 0", both(setter(workload, "concurrency", 0), setter(workload, "sequences_per_step", 0),
                               setter(workload, "tokens_per_step", 0))),
        ("chosen outside range", setter(serving, "concurrency_high", max(1, chosen - 1))),
        ("low > high", both(setter(serving, "concurrency_low", 64), setter(serving, "concurrency_high", 8))),
        ("low 0", setter(serving, "concurrency_low", 0)),
        ("high past max", setter(serving, "concurrency_high", 5000)),
        ("range unlike inputs", setter(serving, "concurrency_low", 2)),
        ("inputs.concurrency junk", setter(inputs, "concurrency", "64..8")),
        ("context 0", both(setter(workload, "context_tokens", 0), setter(inputs, "context", 0))),
        ("workload context unlike inputs", setter(workload, "context_tokens", inputs["context"] + 1)),
        ("chunk 0", both(setter(workload, "chunk_tokens", 0), setter(inputs, "chunk", 0))),
        ("chunk unlike inputs", setter(workload, "chunk_tokens", inputs["chunk"] + 1)),
        ("kv_dtype junk", setter(workload, "kv_dtype", "int3")),
        ("input kv_dtype junk", setter(inputs, "kv_dtype", "BF16")),
        ("kv_dtype unlike inputs", both(setter(inputs, "kv_dtype", "fp8"), setter(workload, "kv_dtype", "bf16"))),
        ("max_tpot 1e308", both(setter(serving, "max_tpot_ms", 1e308), setter(inputs, "max_tpot_ms", 1e308))),
        ("max_tpot unlike inputs", setter(serving, "max_tpot_ms", 50.0)),
        ("tokens unlike sequences", setter(workload, "tokens_per_step", chosen * 2)),
        ("concurrency unlike sequences", setter(workload, "concurrency", max(1, chosen // 2))),
        ("row -1 with a step", setter(row, "num_offloaded", -1)),
        ("row beyond layers", setter(row, "num_offloaded", plan["model"]["num_layers"] + 1)),
        ("row step null", setter(row, "step_ms", None)),
        ("rows unsorted", lambda: serving["points"].reverse()),
        ("row outside range", setter(row, "concurrency", 0)),
        ("no rows", setter(serving, "points", [])),
        ("no_offload half null", setter(serving, "no_offload_step_ms", None)),
        ("no serving section", lambda: plan.pop("serving")),
        ("memory kv null", setter(memory, "kv_cache_bytes", None)),
        ("memory total null", setter(memory, "total_gpu_bytes", None)),
        ("prediction decode null", setter(plan["prediction"], "decode_step_ms", None)),
        ("gpu over budget", setter(memory, "budget_bytes", max(0, memory["gpu_bytes"] - 1))),
    ]


def _adapter_contradictions(plan: dict) -> list[tuple[str, callable]]:
    """(name, edit) pairs, each giving an adapters section make could not have written."""
    section, item, inputs = plan["adapters"], plan["adapters"]["items"][0], plan["inputs"]

    def setter(target, key, value):
        return lambda: target.__setitem__(key, value)

    return [
        ("rank 0", setter(item, "rank", 0)),
        ("rank unlike max_rank", setter(item, "rank", item["rank"] + 1)),
        ("max_rank unlike ranks", setter(section, "max_rank", section["max_rank"] * 2)),
        ("slots > adapters", lambda: section.update(num_slots=2, gpu_bytes=2 * section["slot_bytes"])),
        ("slots 0", lambda: section.update(num_slots=0, gpu_bytes=0)),
        ("slot smaller than adapter", lambda: section.update(slot_bytes=item["bytes"] - 1,
                                                             gpu_bytes=section["num_slots"] * (item["bytes"] - 1))),
        ("pinned unlike sum", setter(section, "host_pinned_bytes", section["host_pinned_bytes"] + 1)),
        ("missing > slots", setter(section, "num_missing", section["num_slots"] + 1)),
        ("alpha 0", setter(item, "alpha", 0.0)),
        ("name make refuses", lambda: [item.__setitem__("name", "a=b"), inputs.__setitem__("adapters", ["a=b=ad"])]),
        ("name with space", lambda: [item.__setitem__("name", "a b"), inputs.__setitem__("adapters", ["a b=ad"])]),
        ("name empty", lambda: [item.__setitem__("name", ""), inputs.__setitem__("adapters", ["=ad"])]),
        ("name unlike inputs", setter(item, "name", "b")),
        ("source unlike inputs", setter(item, "source", "elsewhere")),
        ("inputs entry junk", setter(inputs, "adapters", ["a"])),
        ("inputs twice", setter(inputs, "adapters", ["a=ad", "a=ad"])),
        ("slots unlike inputs", setter(inputs, "adapter_slots", 2)),
        ("no adapters section", lambda: plan.pop("adapters")),
    ]


def _edit_field(rng, section: dict, key: str) -> tuple[str, bool]:
    """Set one field to null or a wrong value; (mutation, invalid)."""
    current = section[key]
    if rng.random() < 0.4:
        section[key] = None
        return f"null {key}", current is not None and key not in NULLABLE_ALONE
    value = rng.choice(WRONG)
    section[key] = value
    if isinstance(current, bool) and isinstance(value, bool) or isinstance(current, list) and value == []:
        return f"other {key}", False  # another valid value (or an empty list): either outcome is right
    if isinstance(current, str) and isinstance(value, str):
        return f"text {key}", key in CHECKED_TEXT and value != current
    if current is None and key == "max_tpot_ms":  # a limit in the plan that inputs do not hold
        return f"wrong {key}", True
    if current is None:
        return f"wrong {key}", not isinstance(value, str) or key != "revision"
    return f"wrong {key}", True


def gen_sections(rng, base_: Base) -> Case:
    """A serving or adapters plan with one field of its serving, workload, memory, prediction or adapters section
    null or wrong, or with a contradiction across fields; read by show, export (all targets), diff or check."""
    adapters = rng.random() < 0.4
    plan = yaml.safe_load(adapter_plan_text()) if adapters else json.loads(json.dumps(base_.serving_plan))
    files = dict(adapter_files()) if adapters else {}
    if rng.random() < 0.5:
        edits = _adapter_contradictions(plan) if adapters else _serving_contradictions(plan)
        mutation, edit = rng.choice(edits)
        edit()
        invalid = True
    else:
        names = ("adapters", "adapters.items") if adapters else ("serving", "serving.points", "workload", "memory",
                                                                 "prediction")
        where = rng.choice(names)
        section = plan[where.split(".")[0]]
        if where.endswith((".items", ".points")):
            section = rng.choice(section[where.split(".")[1]])
        key = rng.choice(sorted(k for k in section if k not in ("items", "points")))
        mutation, invalid = _edit_field(rng, section, key)
        mutation = f"{where}: {mutation}"
    files["plan.yaml"] = yaml_text(plan).encode()
    return Case(family="sections", mutation=mutation, args=list(rng.choice(SECTION_COMMANDS)), invalid=invalid,
                files=files)
