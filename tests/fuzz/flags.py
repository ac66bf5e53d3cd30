"""Fuzz family of command lines: make's flags and the other commands' paths and values."""


from tests.fuzz.core import (Base, Case, GUARD_NAME, SHARDS)


#: (flag, values, values that are invalid) for make
MAKE_FLAGS = {
    "--budget": (("40GiB", "1e400", "-5GiB", "nanGiB", "9" * 400 + "TiB", "", "1 GiB", "0", "12.5MB", "x",
                  "1" + "0" * 30), ("1e400", "-5GiB", "nanGiB", "", "0", "x")),
    "--trigger": (("0.5", "0", "-1", "1.5", "nan", "inf", "1e400", "x", "1"), ("0", "-1", "1.5", "nan", "inf", "1e400",
                                                                              "x")),
    "--tokens": (("1", "0", "-1", "2048", "9" * 30, "x", "1.5"), ("0", "-1", "9" * 30, "x", "1.5")),
    "--sequences": (("1", "0", "-3", "9" * 30, "x", "2"), ("0", "-3", "9" * 30, "x")),
    "--context": (("0", "-1", "4096", "9" * 30, "x"), ("-1", "9" * 30, "x")),
    "--params": (("experts", "mlp", "", "nothing", "a\nb", "\x1b[2J", "mlp.."), ("", "nothing", "a\nb", "\x1b[2J")),
    "--stack": (("model.layers", "nope", "", "a\nb"), ("nope", "", "a\nb")),
    "--group-size": (("2", "0", "-1", "9" * 30, "100"), ("0", "-1", "9" * 30)),
    "--num-in-group": (("1", "0", "-1", "9" * 30, "3"), ("0", "-1", "9" * 30)),
    "--prefetch-step": (("1", "0", "-1", "9" * 30, "2"), ("0", "-1", "9" * 30)),
    "--host-memory": (("1GiB", "1", "x", "-1GiB", "1e400"), ("x", "-1GiB", "1e400")),
    "--revision": (("main",), ("main",)),
    "--measured-on": (("h100-sxm",), ("h100-sxm",)),
    "--concurrency": (("auto", "8", "1..64", "0", "64..8", "x", "1..", "5000", "1.5", ""),
                      ("0", "64..8", "x", "1..", "5000", "1.5", "")),
    "--chunk": (("2048", "64", "0", "-1", "9" * 30, "x"), ("0", "-1", "9" * 30, "x")),
    "--kv-dtype": (("auto", "bf16", "fp8", "int3", "", "a\nb"), ("int3", "", "a\nb")),
    "--max-tpot-ms": (("50", "0", "-1", "nan", "inf", "x", "1e400"), ("0", "-1", "nan", "inf", "x", "1e400")),
    "--gpu-memory": (("24GiB", "0GiB", "1e400GiB", "40", "x", "-1GiB"), ("0GiB", "1e400GiB", "40", "x", "-1GiB")),
    # the base model is dense: any prefetch depth is refused (it is for routed experts)
    "--prefetch-depth": (("0", "2", "-1", "9" * 30, "x"), ("0", "2", "-1", "9" * 30, "x")),
    "--cpu-experts": (("auto", "off", "maybe", "", "a\nb"), ("maybe", "", "a\nb")),
    "--cpu-time-scale": (("1.7", "0", "-1", "101", "nan", "inf", "x", "1e400"),
                         ("0", "-1", "101", "nan", "inf", "x", "1e400")),
    "--routed-experts": (("auto", "off", "never", "", "a\nb"), ("never", "", "a\nb")),
}
OUTPUTS = ((GUARD_NAME, False), ("missing/plan.yaml", True), ("ckpt", True), ("out.yaml/plan.yaml", True),
           ("ckpt/config.json/x.yaml", True), ("", True), ("plan\n.yaml", False))
MODELS = (("ckpt", False), ("./missing", True), ("./ckpt/config.json", True), ("./gpu.yaml", True),
          ("./ckpt/" + SHARDS[0], False), ("./ckpt/model.safetensors.index.json", False), ("/", True),
          ("./a\nb", True))
GPUS = (("gpu.yaml", False), ("nope", True), ("./missing.yaml", True), ("ckpt", True), ("ckpt/config.json", True),
        ("h100-sxm", False), ("a\x1b[2J", True), ("plan.yaml", True))


def gen_flags(rng, base_: Base) -> Case:
    """Random command lines: make with mutated flags, the other commands with bad paths and values."""
    if rng.random() < 0.3:
        return _other_command(rng)
    model, bad_model = rng.choice(MODELS) if rng.random() < 0.3 else ("ckpt", False)
    gpu, bad_gpu = rng.choice(GPUS) if rng.random() < 0.3 else ("gpu.yaml", False)
    output, bad_output = rng.choice(OUTPUTS) if rng.random() < 0.4 else (GUARD_NAME, False)
    args, invalid, names = ["make", "-m", model, "-g", gpu], bad_model or bad_gpu or bad_output, [model, gpu, output]
    flags = rng.sample(sorted(MAKE_FLAGS), rng.randint(0, 3))
    if "--budget" not in flags and "--trigger" not in flags and gpu == "gpu.yaml":
        args += ["--budget", base_.budget]
    for flag in flags:
        values, bad = MAKE_FLAGS[flag]
        value = rng.choice(values)
        args += [flag, value]
        invalid = invalid or value in bad
        names.append(f"{flag}={value}")
    if rng.random() < 0.1:
        args.append(rng.choice(("--no-such-flag", "--tokens", "-x")))
        invalid = True
    args += ["-o", output]
    return Case(family="flags", mutation="make " + " ".join(sorted(flags)), args=args, invalid=invalid)


def _other_command(rng) -> Case:
    command = rng.choice((
        (["show", "missing.yaml"], True), (["show", "ckpt"], True), (["show", "ckpt/config.json"], True),
        (["show", "plan.yaml", "--bogus"], True), (["export", "plan.yaml", "--to", "tgi"], True),
        (["export", "plan.yaml", "--to", "vllm", "--tp", rng.choice(("0", "-1", "9" * 30, "x", "3"))], None),
        (["export", "plan.yaml"], True), (["diff", "plan.yaml"], True), (["diff", "plan.yaml", "missing"], True),
        (["check"], True), (["check", "missing.yaml"], True), (["check", "ckpt"], True),
        (["run", "plan.yaml"], True), (["run", "plan.yaml", "--bench", "--prompt", "x"], True),
        (["calibrate", "-o", rng.choice(("missing/x.yaml", "ckpt", GUARD_NAME))], True),
        (["profiles", "--json"], False),
        (["nonsense"], True), (["make"], True), (["show", "plan.yaml", "--json", "a\x1b[2J"], True),
    ))
    args, invalid = command
    if invalid is None:
        invalid = args[-1] not in ("3",)
    return Case(family="flags", mutation=" ".join(args[:1]) or "(none)", args=list(args), invalid=invalid)
