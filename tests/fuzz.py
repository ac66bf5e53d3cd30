"""A seeded fuzzer of offload-plan's input boundaries, run in-process through the CLI as a user would.

Seven families mutate one input each: a shard's safetensors header, the index JSON, config.json, a plan YAML,
a profile YAML, the command-line flags, and a LoRA adapter (its config, its header, its flags and a plan's
adapters section). Every case writes a fresh working directory (a tiny checkpoint,
a profile, a plan and a guarded output file), runs one CLI command in-process and is classified:

- ``error``: a clean one-line ``offload-plan: error: ...`` on stderr and a non-zero exit (good);
- ``accepted``: exit 0 on input that may be valid (good);
- ``traceback``: any exception that is not an OffloadPlanError, or the CLI's last-resort "this is a bug" line;
- ``hang``: the case ran past the per-case time limit;
- ``clobbered``: a failed command changed the guarded output file or left a temporary file beside it;
- ``accepted-invalid``: exit 0 on input the mutation made invalid;
- ``multi-line``: an error that is not exactly one ``offload-plan: error:`` line.

The generator is the project's own (``random.Random(seed)``): no dependency, and a case is reproduced by its
seed and index alone (``case_for(family, seed, index)``). tests/test_fuzz.py runs a bounded slice in CI;
scripts/fuzz_campaign.py runs the full campaign and prints the table.
"""

import json
import math
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from planner.plan import SCHEMA_VERSION

#: the plan's version line, where the text mutations hook in
VERSION_LINE = f"schema_version: {SCHEMA_VERSION}"

# Never the network: a mutated --model or plan source must not turn into a hub download.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("OFFLOAD_PLAN_DEBUG", None)

FAMILIES = ("headers", "index", "config", "plans", "profiles", "flags", "adapters")
FAMILY_TITLES = {"headers": "safetensors headers", "index": "index JSON", "config": "config.json",
                 "plans": "plan YAML", "profiles": "profile YAML", "flags": "CLI flags", "adapters": "LoRA adapters"}
VERDICTS = ("error", "accepted", "traceback", "hang", "clobbered", "accepted-invalid", "multi-line")
FAILURES = VERDICTS[2:]
#: a case running longer than this is a hang (the targets are refused in well under a second)
DEFAULT_TIME_LIMIT_S = 1.0
ERROR_PREFIX = "offload-plan: error:"
WARNING_PREFIX = "offload-plan: warning:"
BUG_MARKER = "OFFLOAD_PLAN_DEBUG"
#: lines of check's per-plan report, before its one error line
CHECK_REPORT_PREFIXES = ("FAIL ", "  fix: ", "  (or offload-plan check", "  recorded command: ", "  (change what")
GUARD_NAME = "out.yaml"
GUARD_TEXT = "# a good file that a failed command must leave alone\n"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
BASE_ARGS = ("make", "-m", "ckpt", "-g", "gpu.yaml")


_COMMAND = None


def invoke_cli(args: list[str]) -> tuple[int, str, str, BaseException | None]:
    """Run the CLI in-process: (exit code, stdout, stderr, uncaught exception). The one place the app is imported.

    typer's CliRunner.invoke rebuilds the click command from the function signatures on every call (about
    half of a short case's time); a user's process builds it once, so the fuzzer builds it once too and runs
    it inside the runner's stream isolation, as invoke does.
    """
    global _COMMAND
    import typer
    from typer.testing import CliRunner

    if _COMMAND is None:
        from offload_plan.app import app
        _COMMAND = typer.main.get_command(app)
    code, exception = 0, None
    with CliRunner().isolation() as streams:
        try:
            _COMMAND.main(args=list(args), prog_name="offload-plan")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception as error:  # noqa: BLE001 (any other exception is what the fuzzer looks for)
            code, exception = 1, error
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = (_text(stream) for stream in streams[:2])
    return code, stdout, stderr, exception


def _text(stream) -> str:
    return stream.getvalue().decode("utf-8", "replace") if stream is not None else ""


# ---- the base inputs ----------------------------------------------------------------------------------------


def _safetensors(tensors: dict, extra_data_bytes: int = 0) -> bytes:
    """A whole safetensors file (zero data) for name -> (dtype, shape), in order."""
    return _framed(_header_of(tensors), sum(_nbytes(*spec) for spec in tensors.values()) + extra_data_bytes)


def _nbytes(dtype: str, shape) -> int:
    return math.prod(shape) * {"BF16": 2, "F16": 2, "F32": 4}[dtype]


def _header_of(tensors: dict) -> dict:
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header


def _framed(header: dict | bytes, data_bytes: int) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(max(0, data_bytes))


def _tensors(num_layers: int, hidden: int, moe: int) -> dict:
    specs = {"model.embed_tokens.weight": ("BF16", (32, hidden)), "model.norm.weight": ("BF16", (hidden,)),
             "lm_head.weight": ("BF16", (32, hidden))}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = ("BF16", (hidden,))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            specs[p + f"self_attn.{proj}.weight"] = ("BF16", (hidden, hidden))
        for e in range(moe):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                specs[p + f"mlp.experts.{e}.{proj}.weight"] = ("BF16", (hidden, hidden))
        if not moe:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                specs[p + f"mlp.{proj}.weight"] = ("BF16", (2 * hidden, hidden))
    return dict(sorted(specs.items()))


def _config(num_layers: int, hidden: int, moe: int) -> dict:
    config = {"architectures": ["Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"], "hidden_size": hidden,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
              "num_hidden_layers": num_layers, "vocab_size": 32, "intermediate_size": 2 * hidden}
    if moe:
        config.update(num_experts=moe, num_experts_per_tok=2, moe_intermediate_size=hidden)
    return config


@dataclass
class Model:
    """One tiny checkpoint as files (relative path -> bytes) and its parts for mutation."""

    tensors: dict
    #: shard name -> the tensors it holds, in file order
    shards: dict
    weight_map: dict
    config: dict

    def files(self) -> dict[str, bytes]:
        out = {f"ckpt/{name}": _safetensors(tensors) for name, tensors in self.shards.items()}
        out["ckpt/model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": self.weight_map}).encode()
        out["ckpt/config.json"] = json.dumps(self.config).encode()
        return out


def build_model(moe: int) -> Model:
    """A 6-layer llama-style (or MoE with ``moe`` experts) checkpoint in two shards."""
    tensors = _tensors(6, 16, moe)
    names = list(tensors)
    half = len(names) // 2
    shards = {SHARDS[0]: {n: tensors[n] for n in names[:half]}, SHARDS[1]: {n: tensors[n] for n in names[half:]}}
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    return Model(tensors=tensors, shards=shards, weight_map=dict(sorted(weight_map.items())),
                 config=_config(6, 16, moe))


@dataclass
class Base:
    """Everything a case starts from: two models, the test profile, a plan made from them, the budget used."""

    dense: Model
    moe: Model
    profile: dict
    budget: str
    plan_text: str
    plan: dict
    #: plan made from the MoE model with --params experts --cuda-graph
    graph_plan_text: str
    graph_plan: dict = field(default_factory=dict)
    #: a serving plan of the dense model (make --concurrency auto): its serving section and whole-GPU lines
    serving_plan_text: str = ""
    serving_plan: dict = field(default_factory=dict)
    _files: dict = field(default_factory=dict)

    def files(self, moe: bool = False) -> dict[str, bytes]:
        """Relative path -> bytes of every base file (built once per model)."""
        if moe not in self._files:
            files = (self.moe if moe else self.dense).files()
            files["gpu.yaml"] = _yaml(self.profile).encode()
            files["plan.yaml"] = self.plan_text.encode()
            files["graph-plan.yaml"] = self.graph_plan_text.encode()
            files[GUARD_NAME] = GUARD_TEXT.encode()
            self._files[moe] = files
        return self._files[moe]

    def plan_copy(self, which: str) -> dict:
        """A fresh copy of a parsed base plan, "plain", "graph" or "serving" (a JSON round trip: much faster
        than parsing the YAML again)."""
        plans = {"plain": self.plan, "graph": self.graph_plan, "serving": self.serving_plan}
        return json.loads(json.dumps(plans[which]))

    def plan_text_of(self, which: str) -> str:
        """The YAML text of a base plan (see plan_copy)."""
        return {"plain": self.plan_text, "graph": self.graph_plan_text, "serving": self.serving_plan_text}[which]


_BASE: Base | None = None


def base() -> Base:
    """The base inputs, built once per process (the plans by the CLI itself, so they are what make writes)."""
    global _BASE
    if _BASE is None:
        _BASE = _build_base()
    return _BASE


def _warm_imports() -> None:
    """Import what commands import lazily (runtime and torch for run and calibrate) before any case is timed: a
    first import takes seconds and would read as a hang (and, interrupted, leave a half-imported module)."""
    for module in ("planner.make", "planner.check", "planner.export", "planner.report", "planner.compare",
                   "runtime.load", "runtime.bench", "runtime.calibrate"):
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 (no torch here: those commands then fail fast and cleanly)
            pass


def _build_base() -> Base:
    _warm_imports()
    profile = yaml.safe_load((Path(__file__).resolve().parent / "data" / "test-gpu.yaml").read_text())
    dense, moe = build_model(0), build_model(4)
    layer_bytes = sum(_nbytes(*s) for n, s in dense.tensors.items() if n.startswith("model.layers.0."))
    other = sum(_nbytes(*s) for n, s in dense.tensors.items() if not n.startswith("model.layers."))
    budget = f"{other + 3 * layer_bytes + 4096}B"  # room for three of six layers (plus slack): some offloaded
    partial = Base(dense=dense, moe=moe, profile=profile, budget=budget, plan_text="", plan={}, graph_plan_text="")
    with tempfile.TemporaryDirectory(prefix="fuzz-base-") as folder:
        plan_text = _make_plan(partial, Path(folder), [*BASE_ARGS, "--budget", budget], False)
        experts = sum(_nbytes(*s) for n, s in moe.tensors.items() if n.startswith("model.layers.0.mlp.experts."))
        total = sum(_nbytes(*s) for s in moe.tensors.values())
        graph_budget = total - 3 * experts + 256 * len(moe.tensors) + 4096
        graph_args = [*BASE_ARGS, "--budget", f"{graph_budget}B", "--params", "experts", "--cuda-graph",
                      "--tokens", "8", "--sequences", "8"]
        graph_text = _make_plan(partial, Path(folder), graph_args, True)
        serving_args = [*BASE_ARGS, "--context", "64", "--concurrency", "auto", "--chunk", "64"]
        serving_text = _make_plan(partial, Path(folder), serving_args, False)
    partial.plan_text, partial.graph_plan_text, partial.serving_plan_text = plan_text, graph_text, serving_text
    partial.plan, partial.graph_plan = yaml.safe_load(plan_text), yaml.safe_load(graph_text)
    partial.serving_plan = yaml.safe_load(serving_text)
    partial._files.clear()
    assert partial.plan["offload"]["layers"], "the base plan must offload layers, so plan mutations reach the schedule"
    return partial


def _make_plan(partial: Base, folder: Path, args: list[str], moe: bool) -> str:
    for relative, data in partial.files(moe).items():
        if relative.endswith(".yaml") and "plan" in relative:
            continue
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(data)
    previous = os.getcwd()
    os.chdir(folder)
    try:
        code, stdout, stderr, exception = invoke_cli(args)
    finally:
        os.chdir(previous)
    assert code == 0 and exception is None, f"the base plan could not be made: {stderr} {exception!r}"
    return stdout


# ---- cases --------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One mutated input and the command that reads it."""

    family: str
    #: the mutation's name, for the table and for reproducing it
    mutation: str
    args: list[str]
    #: True when the mutation made the input invalid: accepting it is a failure
    invalid: bool
    #: relative path -> bytes written over the base files (None: delete the file)
    files: dict = field(default_factory=dict)
    moe: bool = False


@dataclass(frozen=True, kw_only=True)
class Result:
    """What one case did."""

    family: str
    mutation: str
    verdict: str
    #: for failures: where and what (exception type and the planner frame, or the offending stderr)
    detail: str
    elapsed_ms: float
    index: int
    #: the last line on stderr (the error line of a clean error)
    message: str = ""


def case_for(family: str, seed: int, index: int) -> Case:
    """The case ``index`` of ``family`` under ``seed``: the same three numbers give the same case."""
    rng = random.Random(f"{seed}:{family}:{index}")
    return GENERATORS[family](rng, base())


# ---- running and classifying --------------------------------------------------------------------------------


class CaseTimeout(BaseException):
    """Raised by the timer inside a case that runs past its limit (a BaseException: no handler swallows it)."""


def _on_alarm(signum, frame):
    raise CaseTimeout()


def run_case(case: Case, root: Path, index: int = 0, time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> Result:
    """Write the case's files into a fresh folder under ``root``, run its command there, classify the outcome."""
    folder = Path(tempfile.mkdtemp(prefix=f"{case.family}-", dir=root))
    files = base().files(case.moe) | case.files
    for relative, data in files.items():
        if data is not None:
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(data)
    previous = os.getcwd()
    os.chdir(folder)
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit_s)
    start = time.perf_counter()
    try:
        code, stdout, stderr, exception = invoke_cli(case.args)
        signal.setitimer(signal.ITIMER_REAL, 0)
        message = ([line for line in stderr.splitlines() if line.strip()] or [""])[-1]
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        verdict, detail = _classify(case, code, stderr, exception, folder)
        if elapsed_ms > 1e3 * time_limit_s:
            verdict, detail = "hang", f"took {elapsed_ms / 1e3:.1f} s"
    except CaseTimeout:
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        verdict, detail, message = "hang", f"stopped after {time_limit_s:g} s", ""
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        os.chdir(previous)
        shutil.rmtree(folder, ignore_errors=True)
    return Result(family=case.family, mutation=case.mutation, verdict=verdict, detail=detail, elapsed_ms=elapsed_ms,
                  index=index, message=message)


def _classify(case: Case, code: int, stderr: str, exception: BaseException | None, folder: Path) -> tuple[str, str]:
    if exception is not None:
        return "traceback", _where(exception)
    lines = [line for line in stderr.splitlines() if line.strip()]
    if code == 0:
        return ("accepted-invalid", f"accepted: {case.mutation}") if case.invalid else ("accepted", "")
    guard = folder / GUARD_NAME
    leftovers = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    if not guard.is_file() or guard.read_text() != GUARD_TEXT or leftovers:
        return "clobbered", f"{GUARD_NAME} changed or temporary files left: {leftovers}"
    errors = [line for line in lines if not line.startswith(WARNING_PREFIX)]
    if case.args[:1] == ["check"]:  # check's report: a FAIL line per plan and its fix, then the one error line
        errors = [line for line in errors if not line.startswith(CHECK_REPORT_PREFIXES)]
    if len(errors) == 1 and BUG_MARKER in errors[0]:
        return "traceback", errors[0][:160]
    if len(errors) != 1 or not errors[0].startswith(ERROR_PREFIX):
        first = errors[0] if errors else "(nothing on stderr)"
        return "multi-line", f"{len(errors)} lines: {first[:120]}"
    return "error", ""


def _where(exception: BaseException) -> str:
    """'TypeError in planner/safetensors_header.py:_entry': the innermost project frame of the exception."""
    frames = traceback.extract_tb(exception.__traceback__)
    project = [f for f in frames if "/planner/" in f.filename or "/offload_plan/" in f.filename]
    frame = (project or frames or [None])[-1]
    where = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.name}" if frame else "?"
    return f"{type(exception).__name__} in {where}"


def scratch_dir() -> str | None:
    """Where case folders go: memory (/dev/shm) where there is one, since a disk's rmdir costs milliseconds."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def run_campaign(seed: int, cases_per_family: dict[str, int], time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 progress=None) -> list[Result]:
    """Every case of every family under ``seed``; ``progress(result)`` is called after each."""
    results = []
    with tempfile.TemporaryDirectory(prefix="offload-plan-fuzz-", dir=scratch_dir()) as root:
        for family, count in cases_per_family.items():
            for index in range(count):
                result = run_case(case_for(family, seed, index), Path(root), index, time_limit_s)
                results.append(result)
                if progress is not None:
                    progress(result)
    return results


def failure_summary(results: list[Result]) -> dict[str, dict[str, int]]:
    """family -> failure description -> count (a description is the verdict and where it happened)."""
    summary: dict[str, dict[str, int]] = {family: {} for family in dict.fromkeys(r.family for r in results)}
    for result in results:
        if result.verdict in FAILURES:
            key = f"{result.verdict}: {result.detail}"
            summary[result.family][key] = summary[result.family].get(key, 0) + 1
    return summary


# ---- mutation families --------------------------------------------------------------------------------------
# Each generator returns a Case. ``invalid`` is True only where the input must be refused; where a mutation may
# or may not leave a valid input (a flipped byte, a changed number in range) it is False and either a clean
# error or acceptance passes.

#: values of the wrong type or out of any plausible range for a number
JUNK = (None, True, False, -1, -7.5, 2**64, 10**30, 1e300, "x", "", "12", [], {}, [1, 2], {"a": 1})
#: text that must never reach a message unescaped
NASTY_TEXT = ("\n", "\r\n", "\x1b[2J", "\x00", "\u202e", "\t", "\x7f", "\ud800")
DEEP_LEVELS = (200, 1_000, 10_000, 100_000)
HUGE_INT = "1" + "0" * 5000


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _json(value) -> bytes:
    """JSON the way a buggy writer would: lone surrogates kept, NaN and Infinity as bare words."""
    return json.dumps(value, ensure_ascii=True).encode()


def _yaml(data) -> str:
    """YAML as a user would write it (block style, keys in order), through libyaml when present: fast."""
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False)


def _raw_splice(document: bytes, old: bytes, new: bytes) -> bytes:
    assert old in document, (old, document[:200])
    return document.replace(old, new, 1)


def _pick_tensor(rng, tensors: dict) -> str:
    return rng.choice(sorted(tensors))


def _make_case(family: str, mutation: str, invalid: bool, files: dict, rng, *, moe: bool = False,
               extra: tuple = ()) -> Case:
    args = [*BASE_ARGS, "--budget", base().budget, "-o", GUARD_NAME, *extra]
    if rng.random() < 0.2:
        args += ["--tokens", "8", "--sequences", "8", "--cuda-graph"]
    return Case(family=family, mutation=mutation, args=args, invalid=invalid, files=files, moe=moe)


def gen_headers(rng, base_: Base) -> Case:
    """Mutate one shard's header: fields, offsets, names, framing, JSON structure."""
    moe = rng.random() < 0.3
    model = base_.moe if moe else base_.dense
    shard = rng.choice(SHARDS)
    tensors = model.shards[shard]
    header = _header_of(tensors)
    data_bytes = sum(_nbytes(*s) for s in tensors.values())
    name = _pick_tensor(rng, tensors)
    kind = rng.choice(("dtype", "shape", "offsets", "overlap", "gap", "name", "duplicate", "unlisted", "deep",
                       "huge_int", "not_object", "metadata", "length", "truncate", "flip", "nan", "extra_key",
                       "swap_dims", "utf8", "layer_index"))
    invalid, raw, index = True, None, None
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = rng.choice(("F17", "", "bf16", 5, None, [], "F8_E4M3", "F32", "F16"))
        invalid = entry["dtype"] != "F16"
    elif kind == "shape":
        entry["shape"] = rng.choice(([-1, 16], [1.5, 16], ["16"], [[16]], [True, 16], [2**70, 16], [10**30],
                                     None, "16", {}, [16, 17], [], [0], [2**62, 2**62, 2**62]))
    elif kind == "swap_dims":
        entry["shape"] = entry["shape"][::-1]
        invalid = False
    elif kind == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(([start - 8, end - 8], [end, start], [start, end + 2**64], [-end, 0],
                                            [float(start), float(end)], [str(start), end], [start, end, end], None,
                                            [start + data_bytes, end + data_bytes], [2**64, 2**64 + end - start]))
    elif kind == "overlap":
        same = [n for n in tensors if n != name and tensors[n] == tensors[name]]
        if same:
            header[rng.choice(same)]["data_offsets"] = list(entry["data_offsets"])
        else:
            start, end = entry["data_offsets"]
            entry["data_offsets"] = [max(0, start - 2), max(0, start - 2) + end - start]
    elif kind == "gap":
        last = max(header, key=lambda n: header[n]["data_offsets"][1])
        header[last]["data_offsets"] = [o + 16 for o in header[last]["data_offsets"]]
        data_bytes += 16
    elif kind == "name":
        suffix = rng.choice((*NASTY_TEXT, " ", "é", "x" * 3000, ""))
        new_name = name + suffix if suffix else ""
        header[new_name] = header.pop(name)
        index = {k if k != name else new_name: v for k, v in model.weight_map.items()}
        invalid = suffix not in (" ", "é", "x" * 3000)
    elif kind == "layer_index":
        layer_names = [n for n in tensors if n.startswith("model.layers.")]
        old = ".".join(rng.choice(layer_names).split(".")[:3]) + "."
        new = "model.layers." + rng.choice(("\u00b2", "\u0663", "01", "99999999999", "1e3", "-1", "9" * 40)) + "."
        header = {(new + n[len(old):] if n.startswith(old) else n): e for n, e in header.items()}
        index = {(new + n[len(old):] if n.startswith(old) else n): v for n, v in model.weight_map.items()}
        invalid = False
    elif kind == "duplicate":
        text = json.dumps(header)
        first = json.dumps(name) + ": " + json.dumps(entry)
        raw = text.replace(first, first + ", " + first, 1).encode()
    elif kind == "unlisted":
        header["model.extra.weight"] = {"dtype": "BF16", "shape": [4], "data_offsets": [data_bytes, data_bytes + 8]}
        data_bytes += 8
    elif kind == "deep":
        raw = _raw_splice(json.dumps(header).encode(), json.dumps(entry).encode(),
                          _deep(rng.choice(DEEP_LEVELS)).encode())
    elif kind == "huge_int":
        raw = _raw_splice(json.dumps(header).encode(), json.dumps(entry["data_offsets"]).encode(),
                          f"[0, {HUGE_INT}]".encode())
    elif kind == "nan":
        raw = _raw_splice(json.dumps(header).encode(), json.dumps(entry["data_offsets"]).encode(),
                          rng.choice((b"[NaN, 8]", b"[0, Infinity]", b"[0, 1e999]")))
    elif kind == "not_object":
        raw = rng.choice((b"[]", b"1", b'"x"', b"null", b"true"))
    elif kind == "metadata":
        header["__metadata__"] = rng.choice(({"format": "pt"}, 5, [], {"a": {"b": 1}}, None, {"a": 1}))
        invalid = False
    elif kind == "extra_key":
        entry["checksum"] = rng.choice((1, "x", None))
        invalid = False
    elif kind == "utf8":
        raw = _raw_splice(json.dumps(header).encode(), name.encode(), name.encode() + rng.choice((b"\xff", b"\xc3")))
    if kind in ("length", "truncate", "flip"):
        whole = _framed(header, data_bytes)
        if kind == "length":
            length = rng.choice((0, 2**63, 2**64 - 1, len(whole), len(whole) - 16, 7))
            whole = struct.pack("<Q", length) + whole[8:]
            invalid = True
        elif kind == "truncate":
            whole = whole[:rng.randrange(0, len(whole) - 1)]
        else:
            whole = bytearray(whole)
            for _ in range(rng.randint(1, 3)):
                whole[rng.randrange(8, len(whole) - data_bytes)] = rng.randrange(256)
            whole, invalid = bytes(whole), False
        files = {f"ckpt/{shard}": whole}
    else:
        files = {f"ckpt/{shard}": _framed(raw if raw is not None else _json(header), data_bytes)}
    if index is not None:
        files["ckpt/model.safetensors.index.json"] = _json({"weight_map": index})
    return _make_case("headers", kind, invalid, files, rng, moe=moe)


def gen_index(rng, base_: Base) -> Case:
    """Mutate model.safetensors.index.json: weight_map types, names, files, structure."""
    weight_map = dict(base_.dense.weight_map)
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    name = _pick_tensor(rng, weight_map)
    kind = rng.choice(("file_junk", "missing_file", "traversal", "drop", "add", "rename", "map_junk", "top_junk",
                       "deep", "huge_int", "metadata", "invalid_json", "utf8", "duplicate", "empty", "flip"))
    invalid, raw = True, None
    if kind == "file_junk":
        weight_map[name] = rng.choice((5, None, [], "", "x.bin", SHARDS[0] + "\n", "a\x1b[2J.safetensors"))
    elif kind == "missing_file":
        weight_map[name] = "model-00009-of-00009.safetensors"
    elif kind == "traversal":
        weight_map[name] = rng.choice(("../" + SHARDS[0], "/" + SHARDS[0], "..", "ckpt/" + SHARDS[0]))
    elif kind == "drop":
        del weight_map[name]
    elif kind == "add":
        weight_map[rng.choice(("model.ghost.weight", "x" + rng.choice(NASTY_TEXT) + "y"))] = SHARDS[0]
    elif kind == "rename":
        weight_map[name + rng.choice(NASTY_TEXT)] = weight_map.pop(name)
    elif kind == "map_junk":
        index["weight_map"] = rng.choice(([], "x", None, {}, 5, [weight_map]))
    elif kind == "top_junk":
        raw = rng.choice((b"[]", b"1", b'"x"', b"null", json.dumps([index]).encode()))
    elif kind == "deep":
        raw = _raw_splice(_json(index), b'{"total_size": 1}', _deep(rng.choice(DEEP_LEVELS)).encode())
    elif kind == "huge_int":
        raw = _raw_splice(_json(index), b'{"total_size": 1}', f'{{"total_size": {HUGE_INT}}}'.encode())
    elif kind == "metadata":
        index["metadata"] = rng.choice((None, "x", [], {"total_size": "x"}, {"total_size": -1}))
        invalid = False
    elif kind == "invalid_json":
        raw = _json(index)[:-rng.randint(1, 20)]
    elif kind == "utf8":
        raw = b"\xff\xfe" + _json(index)
    elif kind == "duplicate":
        pair = json.dumps(name).encode() + b": " + json.dumps(weight_map[name]).encode()
        other = json.dumps(name).encode() + b": " + json.dumps(SHARDS[1] if weight_map[name] == SHARDS[0]
                                                               else SHARDS[0]).encode()
        raw = _raw_splice(_json(index), pair, pair + b", " + other)
    elif kind == "empty":
        raw = b""
    elif kind == "flip":
        raw = bytearray(_json(index))
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(32, 127)
        raw, invalid = bytes(raw), False
    files = {"ckpt/model.safetensors.index.json": raw if raw is not None else _json(index)}
    return _make_case("index", kind, invalid, files, rng)


#: config keys the planner reads, with the range a real model's value lies in (None: not a count)
CONFIG_INT_KEYS = {"hidden_size": (1, 2**20), "n_embd": (1, 2**20), "num_attention_heads": (1, 2**16),
                   "n_head": (1, 2**16), "head_dim": (1, 2**16), "num_key_value_heads": (1, 2**16),
                   "num_hidden_layers": (1, 100_000), "n_layer": (1, 100_000), "num_layers": (1, 100_000),
                   "num_experts": (0, 2**20), "num_local_experts": (0, 2**20), "n_routed_experts": (0, 2**20),
                   "moe_num_experts": (0, 2**20), "num_experts_per_tok": (0, 2**20),
                   "num_experts_per_token": (0, 2**20), "moe_topk": (0, 2**20), "top_k": (0, 2**20)}
CONFIG_VALUES = (*JUNK, 0, 1, 2, 3, 4, 8, 64, 2**31, 10**9, 2**20 + 1, float("nan"), float("inf"))


def _config_value_invalid(key: str, value, config: dict, moe: bool) -> bool:
    """Whether a config holding ``value`` at ``key`` must be refused (the fuzzer's oracle)."""
    if key == "architectures":
        return not (value is None or (isinstance(value, list) and value and isinstance(value[0], str)
                                      and value[0].isprintable()))
    if key not in CONFIG_INT_KEYS or value is None:
        return False
    low, high = CONFIG_INT_KEYS[key]
    return isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high


def gen_config(rng, base_: Base) -> Case:
    """Mutate config.json: every key the planner reads, types and ranges, structure."""
    moe = rng.random() < 0.4
    config = dict((base_.moe if moe else base_.dense).config)
    kind = rng.choice(("value", "value", "value", "text_config", "delete", "architectures", "top_junk", "deep",
                       "huge_int", "invalid_json", "nan_word", "utf8"))
    invalid, raw = False, None
    if kind in ("value", "text_config"):
        key = rng.choice(sorted(CONFIG_INT_KEYS))
        value = rng.choice(CONFIG_VALUES)
        target = config
        if kind == "text_config":
            target = config["text_config"] = dict(config)
        target[key] = value
        invalid = _config_value_invalid(key, value, target, moe)
        if key in ("num_experts", "num_experts_per_tok") and moe and isinstance(value, int) and value == 0:
            invalid = False
        kind = f"{kind}:{key}"
    elif kind == "delete":
        config.pop(rng.choice(sorted(config)))
    elif kind == "architectures":
        config["architectures"] = rng.choice((None, [], "Llama", {}, {"a": 1}, [5], [None], ["A\nB"], ["A\x1b[2J"],
                                              ["LlamaForCausalLM"], 5))
        invalid = _config_value_invalid("architectures", config["architectures"], config, moe) \
            and config["architectures"] != []
    elif kind == "top_junk":
        raw, invalid = rng.choice((b"[]", b"1", b'"x"', b"null")), True
    elif kind == "deep":
        raw, invalid = _raw_splice(_json(config), b'"vocab_size": 32',
                                   b'"vocab_size": ' + _deep(rng.choice(DEEP_LEVELS)).encode()), True
    elif kind == "huge_int":
        raw, invalid = _raw_splice(_json(config), b'"vocab_size": 32', f'"vocab_size": {HUGE_INT}'.encode()), True
    elif kind == "invalid_json":
        raw, invalid = _json(config)[:-3], True
    elif kind == "nan_word":
        key = rng.choice(("hidden_size", "num_hidden_layers", "head_dim", "vocab_size"))
        raw = _raw_splice(_json(config), f'"{key}": {config[key]}'.encode(),
                          f'"{key}": {rng.choice(("NaN", "Infinity", "-Infinity"))}'.encode())
        invalid = key != "vocab_size"
    elif kind == "utf8":
        raw, invalid = b"\xff" + _json(config), True
    files = {"ckpt/config.json": raw if raw is not None else _json(config)}
    return _make_case("config", kind, invalid, files, rng, moe=moe)


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


#: optional plan fields that hold text when not null
PLAN_OPTIONAL_TEXT = {"revision", "budget", "stack", "measured_on", "host_memory", "architecture", "concurrency",
                      "gpu_memory"}


def _plan_value(rng, current, key: str) -> tuple[object, bool]:
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
                       "deep", "huge_int", "big_file", "tag", "duplicate", "utf8", "not_mapping", "alias", "schema"))
    invalid, raw = True, None
    if kind == "field":
        path = rng.choice(_plan_paths(plan))
        value, invalid = _plan_value(rng, _get(plan, path), path[-1])
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
        raw = _yaml(plan).encode()
    command = list(rng.choice(PLAN_COMMANDS))
    files = {"plan.yaml": raw}
    if command[0] == "diff" and rng.random() < 0.5:
        command = ["diff", "graph-plan.yaml", "plan.yaml"]
    return Case(family="plans", mutation=kind, args=command, invalid=invalid, files=files, moe=use_graph)


PROFILE_FIGURES = ("gpu_memory_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s", "h2d_bytes_per_s",
                   "copy_overhead_us", "trigger", "reserve_bytes", "compute_efficiency", "host_memory_bytes")
#: (lowest, highest) plausible value of each figure; lowest is exclusive where zero makes no sense
PROFILE_RANGES = {"gpu_memory_bytes": (0, 2**50), "hbm_bytes_per_s": (0, 1e16), "bf16_flops_per_s": (0, 1e19),
                  "fp8_flops_per_s": (0, 1e19), "h2d_bytes_per_s": (0, 1e14), "copy_overhead_us": (-1, 1e6),
                  "trigger": (0, 1), "reserve_bytes": (-1, 2**50), "compute_efficiency": (0, 1),
                  "host_memory_bytes": (0, 2**60)}


def _figure_invalid(key: str, value, profile: dict) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return True
    low, high = PROFILE_RANGES[key]
    if not low < value <= high:
        return True
    if key.endswith("_bytes") and isinstance(value, float) and not value.is_integer():
        return True
    memory = profile["gpu_memory_bytes"]["value"]
    reserve = profile["reserve_bytes"]["value"]
    return isinstance(memory, (int, float)) and isinstance(reserve, (int, float)) and reserve >= memory


def gen_profiles(rng, base_: Base) -> Case:
    """Mutate a profile (figures, sources, names, YAML structure) and make a plan with it."""
    profile = json.loads(json.dumps(base_.profile))
    kind = rng.choice(("value", "value", "value", "source", "note", "name", "delete", "add", "figure_junk",
                       "alias_bomb", "deep", "huge_int", "big_file", "duplicate", "not_mapping", "utf8", "alias"))
    invalid, raw = True, None
    if kind == "value":
        key = rng.choice(PROFILE_FIGURES)
        profile.setdefault(key, {"value": 2**40, "source": "assumed", "note": "added by the fuzzer"})
        value = rng.choice((*JUNK, 0, 0.0, 1, 1e9, 1e12, 0.5, 2.0, float("nan"), float("inf"), 10**400,
                            profile[key]["value"] * 2))
        profile[key]["value"] = value
        invalid = _figure_invalid(key, value, profile)
        if value is None and key in ("fp8_flops_per_s", "host_memory_bytes", "cuda_context_bytes"):
            invalid = True
        kind = f"value:{key}"
    elif kind == "source":
        figure = rng.choice([k for k in PROFILE_FIGURES if k in profile])
        profile[figure]["source"] = rng.choice(("guess", None, 5, "", "datasheet\n"))
    elif kind == "note":
        figure = rng.choice([k for k in PROFILE_FIGURES if k in profile])
        profile[figure]["note"] = rng.choice((5, None, "a\nb", "\x1b[2J", [], "ok"))
        invalid = False
    elif kind == "name":
        profile["name"] = rng.choice(("", None, 5, [], "a\nb", "x\x1b[2J", "\ud800", "ok-name", "n" * 5000))
        invalid = profile["name"] not in ("ok-name", "n" * 5000)
    elif kind == "delete":
        key = rng.choice(sorted(profile))
        del profile[key]
        invalid = key not in ("fp8_flops_per_s", "host_memory_bytes", "cuda_context_bytes", "description")
    elif kind == "add":
        profile[rng.choice(("surprise", "name\n"))] = 1
        profile[rng.choice((5, 1.5, True, None))] = 1  # YAML keys need not be strings
    elif kind == "figure_junk":
        key = rng.choice(PROFILE_FIGURES)
        profile[key] = rng.choice((5, "x", [], None, {"value": 1}, {"source": "assumed"}))
        invalid = not (profile[key] is None and key in ("fp8_flops_per_s", "host_memory_bytes", "cuda_context_bytes"))
    elif kind == "alias_bomb":
        levels = rng.choice((9, 12, 20))
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
        raw = ("\n".join(lines) + "\n" + yaml.safe_dump(profile, sort_keys=False)).encode()
    elif kind == "deep":
        levels = rng.choice(DEEP_LEVELS)
        raw = ("description: " + "[" * levels + "]" * levels + "\n").encode()
    elif kind == "huge_int":
        raw = yaml.safe_dump(profile, sort_keys=False).replace("value: 1000000000\n", f"value: {HUGE_INT}\n",
                                                                1).encode()
    elif kind == "big_file":
        raw = (yaml.safe_dump(profile, sort_keys=False) + "#" + "x" * (2 * 2**20) + "\n").encode()
    elif kind == "duplicate":
        raw = ("name: other\n" + yaml.safe_dump(profile, sort_keys=False)).encode()
    elif kind == "not_mapping":
        raw = rng.choice((b"[]", b"1", b"null", b"", b"- a\n"))
    elif kind == "utf8":
        raw = b"\xff" + yaml.safe_dump(profile, sort_keys=False).encode()
    elif kind == "alias":
        raw = yaml.safe_dump(profile, sort_keys=False).replace("source: assumed", "source: &s assumed", 1).replace(
            "source: assumed", "source: *s", 1).encode()
    if raw is None:
        raw = yaml.safe_dump(profile, sort_keys=False).encode()
    case = _make_case("profiles", kind, invalid, {"gpu.yaml": raw}, rng)
    case.args = [a for a in case.args]  # budget from the base, which the test profile allows
    if rng.random() < 0.3:  # the profile's trigger decides the budget
        at = case.args.index("--budget")
        del case.args[at:at + 2]
    return case


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


# ---- adapters -----------------------------------------------------------------------------------------------

#: the base adapter: rank 4 on q_proj and v_proj of every layer of the dense model (hidden 16)
ADAPTER_RANK = 4
ADAPTER_CONFIG = {"peft_type": "LORA", "r": ADAPTER_RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                  "base_model_name_or_path": "ckpt", "task_type": "CAUSAL_LM"}
ADAPTER_ARGS = ("--adapter", "a=ad")
_ADAPTER_PLAN: list[str] = []


def _adapter_tensors(rank: int = ADAPTER_RANK, modules=("q_proj", "v_proj"), num_layers: int = 6) -> dict:
    specs = {}
    for i in range(num_layers):
        for module in modules:
            stem = f"base_model.model.model.layers.{i}.self_attn.{module}"
            specs[f"{stem}.lora_A.weight"] = ("BF16", (rank, 16))
            specs[f"{stem}.lora_B.weight"] = ("BF16", (16, rank))
    return dict(sorted(specs.items()))


def _adapter_files(config: dict | bytes | None = None, weights: bytes | None = None) -> dict:
    config = ADAPTER_CONFIG if config is None else config
    return {"ad/adapter_config.json": config if isinstance(config, bytes) else _json(config),
            "ad/adapter_model.safetensors": weights if weights is not None else _safetensors(_adapter_tensors())}


def _adapter_plan_text() -> str:
    """A plan made with the base adapter (built once per process, by the CLI)."""
    if not _ADAPTER_PLAN:
        partial = base()
        with tempfile.TemporaryDirectory(prefix="fuzz-adapter-") as folder:
            for relative, data in _adapter_files().items():
                (Path(folder) / relative).parent.mkdir(parents=True, exist_ok=True)
                (Path(folder) / relative).write_bytes(data)
            _ADAPTER_PLAN.append(_make_plan(partial, Path(folder), [*BASE_ARGS, "--budget", partial.budget,
                                                                   *ADAPTER_ARGS], False))
    return _ADAPTER_PLAN[0]


def _adapter_config_invalid(key: str, value) -> bool:
    """Whether ``value`` for config ``key`` makes the base adapter unreadable or inconsistent."""
    if key == "r":
        return value != ADAPTER_RANK or isinstance(value, bool)
    if key == "lora_alpha":
        return not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1e6)
    if key == "target_modules":
        if isinstance(value, str):
            return value == ""
        return not (isinstance(value, list) and value and all(isinstance(v, str) and v and v.isprintable()
                                                              for v in value)
                    and {"q_proj", "v_proj"} <= set(value))
    if key == "peft_type":
        return value != "LORA"
    if key == "base_model_name_or_path":
        return not (value is None or (isinstance(value, str) and value.isprintable()))
    if key in ("rank_pattern", "alpha_pattern", "use_dora"):
        return bool(value)
    return False


ADAPTER_CONFIG_VALUES = (*JUNK, 0, 4, 8, 2**20, float("nan"), "LORA", "IA3", ["q_proj"], ["q_proj", "v_proj", "k_proj"],
                         ["q_proj", "v_proj", "\n"], "all-linear", ".*proj", {"q_proj": 8})
ADAPTER_FLAG_VALUES = (("a", True), ("=ad", True), ("a=", True), ("a=ad=x", True), ("a b=ad", True),
                       ("a=./nope", True), ("a\n=ad", True), ("x" * 100 + "=ad", True), ("a=org/none", True),
                       ("a=ckpt", True), ("a=gpu.yaml", True), ("a=org/x..y", True), ("a=org/-x", True),
                       ("a=org/x\n", True), ("b=ad", False), ("a.1-x=ad", False))


def gen_adapters(rng, base_: Base) -> Case:
    """Mutate the adapter (config keys and bytes, header shapes, dtypes, names, framing), its flags, or the
    adapters section of a plan read by show, export, diff or check."""
    kind = rng.choice(("valid", "config_value", "config_missing", "config_raw", "no_config", "no_weights", "shape",
                       "dtype", "name", "drop_tensor", "extra_module", "truncate", "flip", "flag", "slots", "twice",
                       "plan", "plan", "plan"))
    tensors, config, extra = _adapter_tensors(), dict(ADAPTER_CONFIG), list(ADAPTER_ARGS)
    invalid, files = True, None
    name = _pick_tensor(rng, tensors)
    if kind == "valid":
        invalid = False
    elif kind == "config_value":
        key = rng.choice(("r", "lora_alpha", "target_modules", "peft_type", "base_model_name_or_path", "rank_pattern",
                          "use_dora", "task_type"))
        config[key] = rng.choice(ADAPTER_CONFIG_VALUES)
        invalid = _adapter_config_invalid(key, config[key])
    elif kind == "config_missing":
        key = rng.choice(sorted(ADAPTER_CONFIG))
        del config[key]
        invalid = key in ("r", "target_modules")
    elif kind == "config_raw":
        files = _adapter_files(config=rng.choice((b"", b"{", b"[]", b"null", b'{"r": 4, "r": 4}', b"\xff\xfe",
                                                  _deep(rng.choice(DEEP_LEVELS)).encode(),
                                                  ('{"r": ' + HUGE_INT + "}").encode(), b'{"r": NaN}')))
    elif kind in ("no_config", "no_weights"):
        files = {f"ad/{'adapter_config.json' if kind == 'no_config' else 'adapter_model.safetensors'}": None}
    elif kind == "shape":
        old = tensors[name]
        tensors[name] = (old[0], rng.choice(((old[1][1], old[1][0]), (ADAPTER_RANK + 1, 16), (16,), (16, 16, 1),
                                             (0, 16), (16, 0))))
        invalid = tensors[name][1] != old[1]
    elif kind == "dtype":
        dtype = rng.choice(("F16", "F32", "I8", "U8", "BOOL", "F8_E4M3"))
        tensors[name] = (dtype if dtype in ("F16", "F32") else "BF16", tensors[name][1])
        if dtype not in ("F16", "F32"):
            header = _header_of(tensors)
            header[name]["dtype"] = dtype
            size = math.prod(tensors[name][1]) * {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}[dtype]
            start = header[name]["data_offsets"][0]
            header[name]["data_offsets"] = [start, start + size]
            files = _adapter_files(weights=_framed(header, 10**6))
        invalid = dtype not in ("F16", "F32")
    elif kind == "name":
        new = rng.choice(("model.layers.0.self_attn.q_proj.lora_A.weight", name.replace("lora_A", "lora_C"),
                          name.replace("self_attn", "mlp"), name.replace("layers.0", "layers.99"),
                          name.replace("layers.", "layers.-"), name.replace("q_proj", "nope_proj"),
                          name + "\n", name.replace(".weight", ".bias"), "base_model.model.lm_head.lora_A.weight"))
        tensors = {(new if n == name else n): spec for n, spec in tensors.items()}
        invalid = new != name  # a replacement that finds nothing to replace leaves the name as it was
    elif kind == "drop_tensor":
        del tensors[name]
    elif kind == "extra_module":
        tensors.update(_adapter_tensors(modules=("k_proj",)))
        if rng.random() < 0.5:
            config["target_modules"] = ["k_proj", "q_proj", "v_proj"]
            invalid = False
    elif kind in ("truncate", "flip"):
        whole = bytearray(_safetensors(tensors))
        if kind == "truncate":
            whole = whole[:rng.randrange(0, len(whole) - 1)]
        else:
            for _ in range(rng.randint(1, 3)):
                whole[rng.randrange(8, len(whole) - 256)] = rng.randrange(256)
            invalid = False  # a flipped byte may leave valid JSON
        files = _adapter_files(weights=bytes(whole))
    elif kind == "flag":
        value, invalid = rng.choice(ADAPTER_FLAG_VALUES)
        extra = ["--adapter", value]
    elif kind == "slots":
        value = rng.choice(("0", "-1", "1", "2", "x", "99999999999999999999"))
        extra += ["--adapter-slots", value]
        invalid = value != "1"
    elif kind == "twice":
        extra += ["--adapter", rng.choice(("a=ad", "b=ad"))]
        invalid = extra[-1] == "a=ad"
    elif kind == "plan":
        return _adapter_plan_case(rng)
    if files is None:
        files = _adapter_files(config=config, weights=_safetensors(tensors))
    return _make_case("adapters", kind, invalid, {**_adapter_files(), **files}, rng, extra=tuple(extra))


def _adapter_plan_case(rng) -> Case:
    """Mutate one field of a plan's adapters section and read the plan back."""
    plan = yaml.safe_load(_adapter_plan_text())
    section = plan["adapters"]
    row = rng.random() < 0.4
    target = section["items"][0] if row else section
    key = rng.choice(sorted(k for k in target if k != "items"))
    mode = rng.random()
    if mode < 0.1:
        del target[key]
        invalid = True
    elif mode < 0.15:
        plan["adapters"] = rng.choice((None, [], "x", {"items": []}, {}))
        invalid = plan["adapters"] is not None
    else:
        value, invalid = _plan_value(rng, target[key], key)
        if value is None:
            invalid = key != "revision"
        target[key] = value
        invalid = bool(invalid)
    return Case(family="adapters", mutation=f"plan:{key}", args=list(rng.choice(PLAN_COMMANDS)), invalid=invalid,
                files={**_adapter_files(), "plan.yaml": _yaml(plan).encode()})


GENERATORS = {"headers": gen_headers, "index": gen_index, "config": gen_config, "plans": gen_plans,
              "profiles": gen_profiles, "flags": gen_flags, "adapters": gen_adapters}
