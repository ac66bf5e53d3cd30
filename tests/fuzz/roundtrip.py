"""The round trip as a fuzz property: whatever plan make writes from valid flags, show, check, diff and export
(every engine, with and without tensor parallelism) read it without refusing it."""

from tests.fuzz.core import BASE_ARGS, Base, Case

READERS = (("show", "new.yaml"), ("show", "new.yaml", "--json"), ("show", "new.yaml", "--no-layers"),
           ("check", "new.yaml"), ("diff", "new.yaml", "new.yaml"), ("diff", "plan.yaml", "new.yaml"),
           ("export", "new.yaml", "--to", "vllm"), ("export", "new.yaml", "--to", "sglang"),
           ("export", "new.yaml", "--to", "vllm", "--tp", "2"), ("export", "new.yaml", "--to", "sglang", "--tp", "4"))


def _weights_flags(rng, base_: Base, moe: bool) -> list[str]:
    flags = ["--budget", rng.choice((base_.budget, "40KB", "60KB", "1MB", "100KB"))]
    if moe and rng.random() < 0.6:
        flags += ["--params", "experts"]
    if rng.random() < 0.3:
        batch = str(rng.choice((1, 4, 8)))
        flags += ["--tokens", batch, "--sequences", batch, "--context", str(rng.choice((0, 64))), "--cuda-graph"]
    elif rng.random() < 0.5:
        flags += ["--tokens", str(rng.choice((8, 64, 2048))), "--context", str(rng.choice((0, 64, 4096)))]
    for flag, values in (("--group-size", ("2", "3")), ("--prefetch-step", ("1", "2")),
                         ("--host-memory", ("1MB", "1GiB"))):
        if rng.random() < 0.15:
            flags += [flag, rng.choice(values)]
    return flags


def _serving_flags(rng) -> list[str]:
    flags = ["--concurrency", rng.choice(("auto", "8", "1..64", "4096", "16..16")), "--context",
             str(rng.choice((64, 1024, 32768)))]
    for flag, values in (("--chunk", ("64", "2048")), ("--kv-dtype", ("auto", "bf16", "fp8", "fp32")),
                         ("--max-tpot-ms", ("0.05", "1", "50", "1e9")), ("--gpu-memory", ("5MB", "24GiB", "100MB")),
                         ("--budget", ("30KB", "1MB"))):
        if rng.random() < 0.3:
            flags += [flag, rng.choice(values)]
    return flags


def gen_roundtrip(rng, base_: Base) -> Case:
    """Valid make flags (a weights plan or a serving plan, MoE or dense, with or without an adapter); the plan
    written must pass every reader."""
    from tests.fuzz.adapters import ADAPTER_ARGS, adapter_files

    moe = rng.random() < 0.3
    serving = rng.random() < 0.45
    flags = _serving_flags(rng) if serving else _weights_flags(rng, base_, moe)
    if not moe and rng.random() < 0.3:
        flags += [*ADAPTER_ARGS, *(["--adapter-slots", "1"] if rng.random() < 0.3 else [])]
    args = [*BASE_ARGS, *flags, "-o", "new.yaml"]
    mutation = ("serving" if serving else "weights") + (" moe" if moe else "") + (" adapter" if "--adapter" in flags
                                                                                  else "")
    return Case(family="roundtrip", mutation=mutation, args=args, invalid=False, files=dict(adapter_files()),
                moe=moe, then=tuple(list(reader) for reader in READERS))
