"""Fuzz family of routing traces (issue 25): ``make --routing-trace`` given a trace of the base MoE model that is
malformed, truncated, from another model, with another layer count or impossible counts, or a special file; and
``offload-plan trace`` given special, empty or oversized prompt files. A valid trace must make a plan every reader
takes (the round trip); every other case is one line of error."""

import tempfile
from pathlib import Path

from tests.fuzz.core import BASE_ARGS, GUARD_NAME, SPECIAL_KINDS, Base, Case, yaml_text

TRACE = "trace.yaml"
#: a serving plan over the traced model: --routing-trace is read and checked against it
MAKE_ARGS = [*BASE_ARGS, "--context", "64", "--concurrency", "4", "--chunk", "64", "--routing-trace", TRACE]
READERS = (("show", "new.yaml"), ("check", "new.yaml"), ("export", "new.yaml", "--to", "vllm"),
           ("export", "new.yaml", "--to", "sglang", "--explain"))


def readers_for(make_args: list) -> tuple:
    """The round trip's readers of a plan ``make_args`` wrote: every one, but a plan made ``--for`` an engine is
    exported to that engine alone (another engine's export refuses a plan made for an engine's own offloader in one
    line that says to make it again: planner.views.export.planned_read_at_use)."""
    engine = make_args[make_args.index("--for") + 1] if "--for" in make_args else None
    return tuple(list(reader) for reader in READERS
                 if engine is None or reader[0] != "export" or reader[reader.index("--to") + 1] == engine)


#: values no count, index or size may hold
BAD_NUMBERS = ("x", "", None, True, 1.5, -1, [], {}, 2**41, float("nan"), float("inf"))


_FINGERPRINT: list[str] = []


def _fingerprint(base_: Base) -> str:
    """The base MoE model's fingerprint, as planner.source.checkpoint computes it from its files (once a process)."""
    if not _FINGERPRINT:
        _FINGERPRINT.append(_read_fingerprint(base_))
    return _FINGERPRINT[0]


def _read_fingerprint(base_: Base) -> str:
    from planner.source.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory(prefix="fuzz-trace-") as folder:
        for relative, data in base_.moe.files().items():
            (Path(folder) / relative).parent.mkdir(parents=True, exist_ok=True)
            (Path(folder) / relative).write_bytes(data)
        return load_checkpoint(str(Path(folder) / "ckpt")).fingerprint()


def _num_experts_top_k(base_: Base) -> tuple[int, int]:
    config = base_.moe.config
    return config["num_experts"], config["num_experts_per_tok"]


def valid_trace(rng, base_: Base) -> dict:
    """A trace the base MoE model accepts: per layer, num_tokens tokens each routed to top_k distinct experts."""
    num_experts, top_k = _num_experts_top_k(base_)
    num_tokens = rng.choice((1, 2, 7, 64, 1000))
    layers = []
    for index in range(6):
        counts = [0] * num_experts
        for _ in range(num_tokens):
            for expert in rng.sample(range(num_experts), top_k):
                counts[expert] += 1
        layers.append({"index": index, "counts": counts})
    return {"schema_version": 1, "model_fingerprint": _fingerprint(base_), "num_experts": num_experts,
            "top_k": top_k, "num_tokens": num_tokens, "layers": layers}


def add_prefetch_hits(rng, trace: dict) -> None:
    """Valid per-rank prefetch hits on every layer after the first (0 to num_tokens per rank)."""
    for row in trace["layers"][1:]:
        row["prefetch_hits"] = [rng.randint(0, trace["num_tokens"]) for _ in range(trace["top_k"])]


def add_expert_prediction(rng, trace: dict) -> None:
    """Per-expert prediction figures on every layer after the first, consistent with its counts and per-rank
    hits: each token's routed experts and predicted ranks drawn again (a prediction is right at a rank with a
    chance), the layer's counts, prefetch_hits, expert_predicted and expert_hits counted from them."""
    num_experts, top_k, num_tokens = trace["num_experts"], trace["top_k"], trace["num_tokens"]
    right = rng.random()
    for row in trace["layers"][1:]:
        counts, rank_hits = [0] * num_experts, [0] * top_k
        made = [[0] * top_k for _ in range(num_experts)]
        hits = [[0] * top_k for _ in range(num_experts)]
        for _ in range(num_tokens):
            routed = rng.sample(range(num_experts), top_k)
            others = [e for e in range(num_experts) if e not in routed]
            rng.shuffle(others)
            pool = [*routed] if rng.random() < right else []
            ranks = (pool + others)[:top_k] if pool else rng.sample(range(num_experts), top_k)
            rng.shuffle(ranks)
            for expert in routed:
                counts[expert] += 1
            for rank, expert in enumerate(ranks):
                made[expert][rank] += 1
                if expert in routed:
                    hits[expert][rank] += 1
                    rank_hits[rank] += 1
        row.update(counts=counts, prefetch_hits=rank_hits, expert_predicted=made, expert_hits=hits)


def _expert_prediction(rng, trace: dict) -> str:
    """Per-expert prediction figures that break a rule: hits above the predictions or the expert's routed
    tokens, a rank not predicting one expert per token, a list too short or long, a value not a count, without
    their prefetch_hits or one without the other, or on the first layer (nothing predicts it)."""
    add_expert_prediction(rng, trace)
    row = rng.choice(trace["layers"][1:])
    expert, rank = rng.randrange(trace["num_experts"]), rng.randrange(trace["top_k"])
    kind = rng.choice(("hits above predicted", "hits beyond counts", "rank sum", "length", "number",
                       "no prefetch_hits", "one of the two", "first layer"))
    if kind == "hits above predicted":
        row["expert_hits"][expert][rank] = row["expert_predicted"][expert][rank] + 1
    elif kind == "hits beyond counts":
        row["expert_hits"][expert][rank] = row["counts"][expert] + 1
    elif kind == "rank sum":
        row["expert_predicted"][expert][rank] += 1
    elif kind == "length":
        key = rng.choice(("expert_predicted", "expert_hits"))
        if rng.random() < 0.5:
            row[key] = row[key][:-1] if rng.random() < 0.5 else [*row[key], [0] * trace["top_k"]]
        else:
            row[key][expert] = row[key][expert][:-1] if rng.random() < 0.5 else [*row[key][expert], 0]
    elif kind == "number":
        row[rng.choice(("expert_predicted", "expert_hits"))][expert][rank] = rng.choice(BAD_NUMBERS)
    elif kind == "no prefetch_hits":
        del row["prefetch_hits"]
    elif kind == "one of the two":
        del row[rng.choice(("expert_predicted", "expert_hits"))]
    else:
        first = trace["layers"][0]
        first.update(expert_predicted=row["expert_predicted"], expert_hits=row["expert_hits"])
        if rng.random() < 0.5:
            first["prefetch_hits"] = list(row["prefetch_hits"])
    return f"expert prediction: {kind}"


def _prefetch_hits(rng, trace: dict) -> str:
    """Prefetch hits that break a rule: on the first layer (nothing predicts it), a rank too many or too few, a
    count above num_tokens, below 0 or not a count."""
    add_prefetch_hits(rng, trace)
    kind = rng.choice(("first layer", "ranks", "count"))
    if kind == "first layer":
        trace["layers"][0]["prefetch_hits"] = [0] * trace["top_k"]
    elif kind == "ranks":
        row = trace["layers"][1]
        row["prefetch_hits"] = row["prefetch_hits"][:-1] if rng.random() < 0.5 else [*row["prefetch_hits"], 0]
    else:
        row = rng.choice(trace["layers"][1:])
        row["prefetch_hits"][rng.randrange(trace["top_k"])] = rng.choice((trace["num_tokens"] + 1, *BAD_NUMBERS))
    return f"prefetch_hits: {kind}"


def _set_count(rng, trace: dict) -> str:
    row = rng.choice(trace["layers"])
    value = rng.choice((trace["num_tokens"] + 1, -1, *BAD_NUMBERS))
    row["counts"][rng.randrange(len(row["counts"]))] = value
    return f"count {value!r}"


def _shift_count(rng, trace: dict) -> str:
    """Move one assignment from an expert to another: still valid while no count passes num_tokens."""
    row = rng.choice(trace["layers"])
    counts = row["counts"]
    giver = rng.choice([e for e, c in enumerate(counts) if c > 0])
    counts[giver] -= 1
    counts[rng.randrange(len(counts))] += 1
    return "shifted count"


def _counts_length(rng, trace: dict) -> str:
    row = rng.choice(trace["layers"])
    if rng.random() < 0.5:
        row["counts"] = row["counts"][:-1]
    else:
        row["counts"] = [*row["counts"], 0]
    return "counts length"


def _layer_rows(rng, trace: dict) -> str:
    layers = trace["layers"]
    kind = rng.choice(("drop", "extra", "duplicate", "swap", "empty", "reindex"))
    if kind == "drop":
        layers.pop(rng.randrange(len(layers)))
    elif kind == "extra":
        layers.append({"index": 6 + rng.randrange(3), "counts": list(layers[0]["counts"])})
    elif kind == "duplicate":
        layers.insert(1, dict(layers[0]))
    elif kind == "swap":
        layers[0], layers[1] = layers[1], layers[0]
    elif kind == "empty":
        layers.clear()
    else:
        layers[rng.randrange(len(layers))]["index"] = rng.choice((7, 100, -1, "1", None))
    return f"layers {kind}"


def _header_field(rng, trace: dict) -> str:
    key = rng.choice(("num_experts", "top_k", "num_tokens", "schema_version", "model_fingerprint"))
    if key == "model_fingerprint":
        trace[key] = rng.choice(("sha256:" + "0" * 64, "", 5, None))  # another model's, or junk
    elif key == "num_tokens":
        trace[key] = rng.choice((0, trace[key] + 1, *BAD_NUMBERS))
    elif key == "top_k":
        trace[key] = rng.choice((0, 1, 3, trace["num_experts"] + 1, *BAD_NUMBERS))
    elif key == "num_experts":
        trace[key] = rng.choice((0, 3, 8, *BAD_NUMBERS))
    else:
        trace[key] = rng.choice((0, 2, "1", 1.0, None))
    return f"{key} {trace[key]!r}"


def _keys(rng, trace: dict) -> str:
    if rng.random() < 0.5:
        key = rng.choice(sorted(trace))
        del trace[key]
        return f"missing {key}"
    trace["extra"] = 1
    return "extra key"


def _consistent_other_geometry(rng, trace: dict) -> str:
    """A well-formed trace of a model with 8 experts, or top-1: consistent in itself, wrong for this model."""
    num_experts = rng.choice((2, 8))
    top_k = 1
    for row in trace["layers"]:
        row["counts"] = [trace["num_tokens"]] + [0] * (num_experts - 1)
    trace.update(num_experts=num_experts, top_k=top_k)
    return f"geometry {num_experts}x{top_k}"


TRACE_MUTATIONS = (_set_count, _counts_length, _layer_rows, _header_field, _keys, _consistent_other_geometry,
                   _prefetch_hits, _expert_prediction)
TEXT_KINDS = ("truncated", "truncated", "garbage", "empty", "list", "deep", "not utf-8")


def _text_mutation(rng, text: str) -> tuple[str, bytes]:
    kind = rng.choice(TEXT_KINDS)
    if kind == "truncated":
        content = len(text.rstrip("\n"))
        return kind, text[:rng.randrange(content)].encode()  # every cut before the last character breaks it
    if kind == "garbage":
        return kind, bytes(rng.randrange(256) for _ in range(rng.choice((1, 16, 300))))
    if kind == "empty":
        return kind, b""
    if kind == "list":
        return kind, b"- 1\n- 2\n"
    if kind == "deep":
        return kind, ("[" * 5000 + "]" * 5000).encode()
    return kind, text.encode()[:40] + b"\xff\xfe\n"


def _trace_command_case(rng) -> Case:
    """offload-plan trace with a prompt file that is special, empty, or the base checkpoint (no tokenizer)."""
    kind = rng.choice((*SPECIAL_KINDS, "empty", "blank lines", "no tokenizer"))
    args = ["trace", "--model", "ckpt", "--prompts", "prompts.txt", "--device", "cpu", "-o", GUARD_NAME]
    args += rng.choice(([], [], ["--decode-tokens", rng.choice(("0", "4", "-1", "65537", "9" * 30, "x", ""))]))
    files, special = {}, {}
    if kind in SPECIAL_KINDS:
        special["prompts.txt"] = kind
    else:
        files["prompts.txt"] = {"empty": b"", "blank lines": b"\n \n\t\n"}.get(kind, b"hello\nworld\n")
    return Case(family="traces", mutation=f"trace --prompts: {kind}", args=args, invalid=True, files=files,
                moe=True, special=special)


def gen_traces(rng, base_: Base) -> Case:
    """One routing-trace input: valid (the round trip), mutated in its fields or text, special, or on the wrong
    model; or one of offload-plan trace's own inputs."""
    roll = rng.random()
    if roll < 0.1:
        return _trace_command_case(rng)
    trace = valid_trace(rng, base_)
    args, invalid, special, then, moe = [*MAKE_ARGS, "-o", GUARD_NAME], True, {}, (), True
    if roll < 0.25:
        mutation = "valid" if rng.random() < 0.5 else _shift_count(rng, trace)
        extra = rng.random()
        if extra < 0.3:  # the measured accuracy per rank: make chooses the prefetch depth from it
            add_prefetch_hits(rng, trace)
            mutation += " with prefetch_hits"
        elif extra < 0.5:  # per expert and rank: make prices each layer's prefetch over its cold experts
            add_expert_prediction(rng, trace)
            mutation += " with expert_predicted"
        invalid = any(c > trace["num_tokens"] for row in trace["layers"] for c in row["counts"])
        if not invalid:  # a weights budget that routes experts (60KB), streams whole layers (40KB) or keeps all
            args = [*MAKE_ARGS, *rng.choice((["--budget", "60KB"], ["--budget", "60KB"], ["--budget", "40KB"], [])),
                    *rng.choice(([], ["--cuda-graph"])), *rng.choice(([], [], ["--for", "vllm"], ["--for", "sglang"])),
                    "-o", "new.yaml"]
            mutation += " " + " ".join(args[len(MAKE_ARGS):-2])
            then = readers_for(args)
        data = yaml_text(trace).encode()
    elif roll < 0.35:
        mutation, data = _text_mutation(rng, yaml_text(trace))
    elif roll < 0.45:
        kind = rng.choice(SPECIAL_KINDS)
        mutation, data, special = f"special: {kind}", b"", {TRACE: kind}
    elif roll < 0.5:
        mutation, data, moe = "dense model", yaml_text(trace).encode(), False
    else:
        mutation, data = rng.choice(TRACE_MUTATIONS)(rng, trace), None
        data = yaml_text(trace).encode()
    files = {} if special else {TRACE: data}
    return Case(family="traces", mutation=mutation, args=args, invalid=invalid, files=files, moe=moe,
                special=special, then=then)
