"""Fuzz family of path arguments: every path a command takes given as a FIFO, a folder, a device, a link to a
FIFO, or a name or path longer than the file system allows; each is one line, never a hang."""

from tests.fuzz.core import BASE_ARGS, GUARD_NAME, SHARDS, SPECIAL_KINDS, Base, Case

LONG_NAME = "n" * 300
#: (command with {} for the path, the file the base inputs hold there, or None for a path of its own)
PATH_ARGUMENTS = (
    ([*BASE_ARGS[:2], "{}", *BASE_ARGS[3:], "--budget", "1MB", "-o", GUARD_NAME], "ckpt"),
    ([*BASE_ARGS, "--budget", "1MB", "-o", GUARD_NAME], "ckpt/config.json"),
    ([*BASE_ARGS, "--budget", "1MB", "-o", GUARD_NAME], "ckpt/model.safetensors.index.json"),
    ([*BASE_ARGS, "--budget", "1MB", "-o", GUARD_NAME], "ckpt/" + SHARDS[0]),
    ([*BASE_ARGS[:4], "{}", "--budget", "1MB", "-o", GUARD_NAME], "gpu.yaml"),
    ([*BASE_ARGS, "--budget", "1MB", "-o", "{}"], None),
    ([*BASE_ARGS, "--budget", "1MB", "--adapter", "a={}", "-o", GUARD_NAME], "ad"),
    ([*BASE_ARGS, "--budget", "1MB", "--adapter", "a=ad", "-o", GUARD_NAME], "ad/adapter_config.json"),
    ([*BASE_ARGS, "--budget", "1MB", "--adapter", "a=ad", "-o", GUARD_NAME], "ad/adapter_model.safetensors"),
    (["show", "{}"], "plan.yaml"),
    (["export", "{}", "--to", "vllm"], "plan.yaml"),
    (["diff", "{}", "graph-plan.yaml"], "plan.yaml"),
    (["diff", "graph-plan.yaml", "{}"], "plan.yaml"),
    (["check", "{}"], "plan.yaml"),
    (["header-checkpoint", "{}", "hc"], "ckpt/config.json"),
    (["header-checkpoint", "ckpt/config.json", "{}"], None),
    (["run", "{}"], "plan.yaml"),
)


def _long(rng) -> str:
    return rng.choice((LONG_NAME, LONG_NAME + ".yaml", "d/" + LONG_NAME, "/".join(["p" * 200] * 25),
                       "a/" * 2100 + "x"))


def gen_paths(rng, base_: Base) -> Case:
    """One path argument (or the file behind it) made special or too long."""
    from tests.fuzz.adapters import adapter_files

    template, target = rng.choice(PATH_ARGUMENTS)
    kinds = (*SPECIAL_KINDS, "long", "long")
    if template[:1] == ["header-checkpoint"] and target is None:  # a new folder is valid, and then transformers
        kinds = tuple(k for k in kinds if k != "folder")          # builds the model: slow, and not a boundary
    kind = rng.choice(kinds)
    path = target or "new-path.yaml"
    special, invalid = {}, True
    if kind == "long":
        path = _long(rng)
    else:
        special[path] = kind
    in_argument = any("{}" in part for part in template)
    if not in_argument and kind == "long":  # the file behind a fixed argument cannot be long: make it a FIFO
        special, kind, path = {target: "fifo"}, "fifo", target
    args = [part.replace("{}", path) for part in template]
    if "-o" in template and args[args.index("-o") + 1] == path and kind not in ("folder", "long"):
        invalid = False  # make replaces the output path, whatever file or link was there, with the plan
    if template[:1] == ["header-checkpoint"] and target is None and kind != "long":
        invalid = kind != "folder"  # a new empty folder is what it asks for
    return Case(family="paths", mutation=f"{template[0]} {target or 'output'}: {kind}", args=args, invalid=invalid,
                files=dict(adapter_files()), special=special)
