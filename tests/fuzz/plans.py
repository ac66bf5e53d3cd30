"""Fuzz family of plan files: every field, layer lists and YAML structure, read by show, export, diff, check."""


from planner.plan.schema import SCHEMA_VERSION

from tests.fuzz.core import (Base, Case, DEEP_LEVELS, HUGE_INT, JUNK, VERSION_LINE, yaml_text)


def _plan_paths(plan: dict) -> list[tuple]:
    paths = []
    for section, body in plan.items():
        if isinstance(body, dict):
            paths += [(section, key) for key in body]
            paths += [(section, key, i, name) for key, rows in body.items() if isinstance(rows, list)
                      for i, row in enumerate(rows) if isinstance(row, dict) for name in row]
        elif isinstance(body, list):
            paths += [(section, i, key) for i, row in enumerate(body) for key in row]
        else:
            paths.append((section,))
    return paths


def _get(data, path):
    for part in path:
        data = data[part]
    return data


def _set(data, path, value):
    _get(data, path[:-1])[path[-1]] = value


#: plan fields that may be null (Optional in the schema)
PLAN_OPTIONAL = {"revision", "budget", "trigger", "stack", "group_size", "num_in_group", "prefetch_step",
                 "measured_on", "host_memory", "architecture", "fp8_flops_per_s", "host_memory_bytes",
                 # serving plans and the whole-GPU accounting: null where a plan has no such figure
                 "concurrency", "max_tpot_ms", "gpu_memory", "cuda_context_bytes", "kv_cache_bytes",
                 "activation_bytes", "total_gpu_bytes", "decode_step_ms", "decode_tokens_per_s", "prefill_chunk_ms"}
PLAN_COMMANDS = (["show", "plan.yaml"], ["show", "plan.yaml", "--json"], ["export", "plan.yaml", "--to", "vllm"],
                 ["export", "plan.yaml", "--to", "sglang"], ["export", "plan.yaml", "--to", "vllm", "--tp", "2"],
                 ["diff", "plan.yaml", "graph-plan.yaml"], ["check", "plan.yaml"], ["show", "plan.yaml", "--no-layers"])


#: fields of the serving section (and its rows) that may be null, where a field of that name elsewhere may not
SERVING_OPTIONAL = {"step_ms", "max_tpot_ms", "no_offload_concurrency", "no_offload_step_ms",
                    "no_offload_tokens_per_s"}


def _may_be_null(path: tuple) -> bool:
    return path[-1] in PLAN_OPTIONAL or (path[0] == "serving" and path[-1] in SERVING_OPTIONAL)


#: (section, key, value, invalid) for keys a plan holds only when given or measured (absent from the base plans):
#: NCCL's measured bytes (whole, not negative, within a plan's numbers) and make --cpu-time-scale (0 < x <= 100)
WRITTEN_WHEN_GIVEN = (("hardware", "nccl_bytes", 0, False), ("hardware", "nccl_bytes", 842 * 2**20, False),
                      ("hardware", "nccl_bytes", None, False), ("hardware", "nccl_bytes", -1, True),
                      ("hardware", "nccl_bytes", 2**70, True), ("hardware", "nccl_bytes", "x", True),
                      ("hardware", "nccl_bytes", 1.5, True), ("inputs", "cpu_time_scale", 1.7, False),
                      ("inputs", "cpu_time_scale", None, False), ("inputs", "cpu_time_scale", 0.0, True),
                      ("inputs", "cpu_time_scale", -1.0, True), ("inputs", "cpu_time_scale", 101.0, True),
                      ("inputs", "cpu_time_scale", "x", True), ("inputs", "cpu_time_scale", float("nan"), True))


#: optional plan fields that hold text when not null
PLAN_OPTIONAL_TEXT = {"revision", "budget", "stack", "measured_on", "host_memory", "architecture", "concurrency",
                      "gpu_memory"}


def plan_value(rng, current, key: str) -> tuple[object, bool]:
    """(new value, invalid) for one field of a plan."""
    choice = rng.random()
    if choice < 0.35:
        value = rng.choice(JUNK + (float("nan"), float("inf"), -float("inf")))
        if value is None:
            return value, None  # decided by the caller (optional fields may be null)
        if current is None and key in PLAN_OPTIONAL_TEXT:
            return value, not isinstance(value, str)
        same_type = type(value) is type(current) or (isinstance(current, float) and type(value) is int)
        plausible = not (isinstance(value, (int, float)) and not isinstance(value, bool)
                         and (value < 0 or abs(value) > 1e15 or value != value))
        return value, not (same_type and plausible)
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        return current, False
    value = rng.choice((0, current + 1, current * 2, max(0, current - 1), current / 2 if isinstance(current, float)
                        else current // 2))
    return value, False


def gen_plans(rng, base_: Base) -> Case:
    """Mutate a plan (fields, layer lists, YAML structure) and read it with show, export, diff or check."""
    draw = rng.random()
    which = "graph" if draw < 0.25 else ("serving" if draw < 0.45 else "plain")
    use_graph = which == "graph"
    text = base_.plan_text_of(which)
    plan = base_.plan_copy(which)
    kind = rng.choice(("field", "field", "field", "field", "offload_layers", "delete", "add", "rows", "alias_bomb",
                       "deep", "huge_int", "big_file", "tag", "duplicate", "utf8", "not_mapping", "alias", "schema",
                       "written_when_given"))
    invalid, raw = True, None
    if kind == "field":
        path = rng.choice(_plan_paths(plan))
        value, invalid = plan_value(rng, _get(plan, path), path[-1])
        if invalid is None:
            invalid = not _may_be_null(path)
        _set(plan, path, value)
        kind = f"field:{'.'.join(str(p) if not isinstance(p, int) else '[]' for p in path)}"
    elif kind == "offload_layers":
        layers = list(plan["offload"]["layers"]) or [0]
        num = plan["model"]["num_layers"]
        plan["offload"]["layers"] = rng.choice((layers + [num], layers + [num + 100], [-1] + layers, layers[::-1],
                                                layers + layers[-1:], [2**70], [1.5], ["0"]))
    elif kind == "delete":
        path = rng.choice(_plan_paths(plan))
        del _get(plan, path[:-1])[path[-1]]
        invalid = path[-1] not in ("replay_start_copies", "measure", "measured_on", "cuda_graph", "host_memory",
                                   "host_memory_bytes")
    elif kind == "add":
        target = _get(plan, rng.choice(_plan_paths(plan))[:-1])
        target["surprise"] = 1
        target[rng.choice((5, 1.5, True, None))] = 1  # YAML keys need not be strings
    elif kind == "written_when_given":
        section, key, value, invalid = rng.choice(WRITTEN_WHEN_GIVEN)
        plan[section][key] = value
        kind = f"written_when_given:{section}.{key}={value!r}"
    elif kind == "rows":
        rows = plan["layers"]
        change = rng.choice(("drop", "swap", "append", "index"))
        if change == "drop":
            rows.pop(rng.randrange(len(rows)))
        elif change == "swap":
            rows[0], rows[1] = rows[1], rows[0]
        elif change == "append":
            rows.append(dict(rows[-1], index=len(rows)))
        else:
            rows[rng.randrange(len(rows))]["index"] = rng.choice((-1, len(rows), 10**9))
    elif kind == "alias_bomb":
        levels = rng.choice((9, 12, 20))
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
        raw = ("\n".join(lines) + "\n" + text).encode()
    elif kind == "deep":
        levels = rng.choice(DEEP_LEVELS)
        raw = (text + "extra: " + "[" * levels + "]" * levels + "\n").encode()
    elif kind == "huge_int":
        raw = text.replace(VERSION_LINE, f"schema_version: {HUGE_INT}", 1).encode()
    elif kind == "big_file":
        raw = (text + "#" + "x" * (17 * 2**20) + "\n").encode()
    elif kind == "tag":
        raw = text.replace(VERSION_LINE, "schema_version: !!python/object/apply:os.getcwd []", 1).encode()
    elif kind == "duplicate":
        raw = text.replace(VERSION_LINE, f"{VERSION_LINE}\n{VERSION_LINE}", 1).encode()
    elif kind == "utf8":
        raw = text.encode() + b"\n# \xff\xfe\n"
    elif kind == "not_mapping":
        raw = rng.choice((b"[]", b"1", b"null", b"", b"- a\n- b\n"))
    elif kind == "alias":
        raw = text.replace(VERSION_LINE, f"schema_version: &v {SCHEMA_VERSION}\nx: *v", 1).encode()
    elif kind == "schema":
        plan["schema_version"] = rng.choice((SCHEMA_VERSION + 1, 0, str(SCHEMA_VERSION), None, float(SCHEMA_VERSION)))
    if raw is None:
        raw = yaml_text(plan).encode()
    command = list(rng.choice(PLAN_COMMANDS))
    files = {"plan.yaml": raw}
    if command[0] == "diff" and rng.random() < 0.5:
        command = ["diff", "graph-plan.yaml", "plan.yaml"]
    return Case(family="plans", mutation=kind, args=command, invalid=invalid, files=files, moe=use_graph)
