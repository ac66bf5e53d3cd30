"""A seeded fuzzer of offload-plan's input boundaries, run in-process through the CLI as a user would.

Each family (a module of this package) mutates one kind of input. Every case writes a fresh working directory (a
tiny checkpoint, a profile, a plan, a guarded output file, and any special files it asks for: FIFOs, folders,
links to devices), runs one CLI command in-process (and, for the round trip, the commands that read what it
wrote) and is classified:

- ``error``: a clean one-line ``offload-plan: error: ...`` on stderr and a non-zero exit (good);
- ``accepted``: exit 0 on input that may be valid (good);
- ``traceback``: any exception that is not an OffloadPlanError, or the CLI's last-resort "this is a bug" line;
- ``hang``: the case ran past the per-case time limit;
- ``clobbered``: a failed command changed the guarded output file or left a temporary file beside it;
- ``accepted-invalid``: exit 0 on input the mutation made invalid;
- ``multi-line``: an error that is not exactly one ``offload-plan: error:`` line;
- ``long-line``: an error line longer than MAX_ERROR_CHARS (a message must stay readable);
- ``round-trip``: a plan the first command wrote that a reading command (show, check, diff, export) refused.

The generator is the project's own (``random.Random(seed)``): no dependency, and a case is reproduced by its
seed and index alone (``case_for(family, seed, index)``). tests/contract/test_fuzz.py runs a bounded slice in CI;
scripts/fuzz_campaign.py runs the full campaign and prints the table.
"""

import json
import math
import os
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

from planner.plan.schema import SCHEMA_VERSION

#: the plan's version line, where the text mutations hook in
VERSION_LINE = f"schema_version: {SCHEMA_VERSION}"

# Never the network: a mutated --model or plan source must not turn into a hub download.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("OFFLOAD_PLAN_DEBUG", None)

VERDICTS = ("error", "accepted", "traceback", "hang", "clobbered", "accepted-invalid", "multi-line", "long-line",
            "round-trip")
#: an error line longer than this (about 300 characters, with room for a long path echoed in part) fails
MAX_ERROR_CHARS = 320
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


def safetensors_bytes(tensors: dict, extra_data_bytes: int = 0) -> bytes:
    """A whole safetensors file (zero data) for name -> (dtype, shape), in order."""
    return framed(header_of(tensors), sum(nbytes(*spec) for spec in tensors.values()) + extra_data_bytes)


def nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of the fuzzer's dtypes."""
    return math.prod(shape) * {"BF16": 2, "F16": 2, "F32": 4}[dtype]


def header_of(tensors: dict) -> dict:
    """The safetensors header of name -> (dtype, shape), tensors laid end to end in order."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header


def framed(header: dict | bytes, data_bytes: int) -> bytes:
    """A safetensors file: the 8-byte length, the header padded to 8 bytes, then ``data_bytes`` zero bytes."""
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
              "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": hidden // 4,  # k_proj: 16 rows
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
        out = {f"ckpt/{name}": safetensors_bytes(tensors) for name, tensors in self.shards.items()}
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
    #: a decode plan of the MoE model that fetches routed experts (every MoE layer routed, some experts resident)
    routed_plan_text: str = ""
    routed_plan: dict = field(default_factory=dict)
    #: the same routed decode plan made with HYBRID_PROFILE (a slow link, a measured CPU): some experts of every
    #: layer on the host CPU, some fetched
    hybrid_plan_text: str = ""
    hybrid_plan: dict = field(default_factory=dict)
    _files: dict = field(default_factory=dict)

    def files(self, moe: bool = False) -> dict[str, bytes]:
        """Relative path -> bytes of every base file (built once per model)."""
        if moe not in self._files:
            files = (self.moe if moe else self.dense).files()
            files["gpu.yaml"] = yaml_text(self.profile).encode()
            files[HYBRID_PROFILE] = yaml_text(hybrid_profile(self.profile)).encode()
            files["plan.yaml"] = self.plan_text.encode()
            files["graph-plan.yaml"] = self.graph_plan_text.encode()
            files[GUARD_NAME] = GUARD_TEXT.encode()
            self._files[moe] = files
        return self._files[moe]

    def plan_copy(self, which: str) -> dict:
        """A fresh copy of a parsed base plan, "plain", "graph" or "serving" (a JSON round trip: much faster
        than parsing the YAML again)."""
        plans = {"plain": self.plan, "graph": self.graph_plan, "serving": self.serving_plan,
                 "routed": self.routed_plan, "hybrid": self.hybrid_plan}
        return json.loads(json.dumps(plans[which]))

    def plan_text_of(self, which: str) -> str:
        """The YAML text of a base plan (see plan_copy)."""
        return {"plain": self.plan_text, "graph": self.graph_plan_text, "serving": self.serving_plan_text,
                "routed": self.routed_plan_text, "hybrid": self.hybrid_plan_text}[which]


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
    for module in ("planner.make.make_plan", "planner.views.check", "planner.views.export", "planner.views.show",
                   "planner.views.diff", "runtime.load", "runtime.bench", "runtime.generate", "runtime.calibrate",
                   "runtime.trace", "planner.source.routing_trace"):
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 (no torch here: those commands then fail fast and cleanly)
            pass


def _build_base() -> Base:
    _warm_imports()
    profile = yaml.safe_load((Path(__file__).resolve().parents[1] / "data" / "test-gpu.yaml").read_text())
    dense, moe = build_model(0), build_model(4)
    layer_bytes = sum(nbytes(*s) for n, s in dense.tensors.items() if n.startswith("model.layers.0."))
    other = sum(nbytes(*s) for n, s in dense.tensors.items() if not n.startswith("model.layers."))
    budget = f"{other + 3 * layer_bytes + 4096}B"  # room for three of six layers (plus slack): some offloaded
    partial = Base(dense=dense, moe=moe, profile=profile, budget=budget, plan_text="", plan={}, graph_plan_text="")
    with tempfile.TemporaryDirectory(prefix="fuzz-base-") as folder:
        plan_text = make_plan_text(partial, Path(folder), [*BASE_ARGS, "--budget", budget], False)
        experts = sum(nbytes(*s) for n, s in moe.tensors.items() if n.startswith("model.layers.0.mlp.experts."))
        total = sum(nbytes(*s) for s in moe.tensors.values())
        graph_budget = total - 3 * experts + 256 * len(moe.tensors) + 4096
        graph_args = [*BASE_ARGS, "--budget", f"{graph_budget}B", "--params", "experts", "--cuda-graph",
                      "--tokens", "8", "--sequences", "8"]
        graph_text = make_plan_text(partial, Path(folder), graph_args, True)
        serving_args = [*BASE_ARGS, "--context", "64", "--concurrency", "auto", "--chunk", "64"]
        serving_text = make_plan_text(partial, Path(folder), serving_args, False)
        # 60 KiB: the all-resident model takes 76.5 KiB with its arena's slack, and whole layers stream slower
        routed_args = [*BASE_ARGS, "--budget", "61440B", "--tokens", "1", "--context", "64"]
        routed_text = make_plan_text(partial, Path(folder), routed_args, True)
        hybrid_args = ["make", "-m", "ckpt", "-g", HYBRID_PROFILE, *routed_args[5:]]
        hybrid_text = make_plan_text(partial, Path(folder), hybrid_args, True)
        _warm_trace(partial, Path(folder))
    partial.plan_text, partial.graph_plan_text, partial.serving_plan_text = plan_text, graph_text, serving_text
    partial.plan, partial.graph_plan = yaml.safe_load(plan_text), yaml.safe_load(graph_text)
    partial.serving_plan = yaml.safe_load(serving_text)
    partial.routed_plan_text, partial.routed_plan = routed_text, yaml.safe_load(routed_text)
    assert partial.routed_plan["experts"]["regime"] == "routed", "the routed base plan must route its MoE layers"
    partial.hybrid_plan_text, partial.hybrid_plan = hybrid_text, yaml.safe_load(hybrid_text)
    hybrid_layers = partial.hybrid_plan["experts"]["layers"]
    split = all(row.get("cpu") for row in hybrid_layers) and any(row["expected_fetched_bytes"] for row in hybrid_layers)
    assert split, "the hybrid base plan must put experts of every layer on the CPU and fetch others"
    partial._files.clear()
    assert partial.plan["offload"]["layers"], "the base plan must offload layers, so plan mutations reach the schedule"
    return partial


#: the profile the hybrid base plan is made with (hybrid_profile)
HYBRID_PROFILE = "gpu-cpu.yaml"
#: its measured CPU: the fuzz profile family's cpu_experts section, no fixed per-expert overhead, a 1 us handoff
HYBRID_CPU = {"threads": 12, "dtype": "bf16", "hidden_size": 2048, "intermediate_size": 768,
              "ms_per_expert_at_tokens": {1: 0.15, 4: 0.165, 16: 0.48}, "weight_bytes_per_s": 7.1e10,
              "flops_per_s": 5.0e11, "overhead_us": 0.0, "handoff_us": 1.0, "source": "measured",
              "note": "added by the fuzzer"}


def hybrid_profile(profile: dict) -> dict:
    """The test profile with a 30 MB/s link, on which one of the tiny MoE's 1.5 KiB experts takes the link
    ~58 us, more than a CPU expert inside the step (~46 us), and HYBRID_CPU: make splits each layer's misses."""
    hybrid = json.loads(json.dumps(profile))
    hybrid["h2d_bytes_per_s"]["value"] = 3.0e7
    hybrid["cpu_experts"] = dict(HYBRID_CPU)
    return hybrid


def invoke_cli_in(folder: Path, files: dict[str, bytes], args: list[str]) -> tuple[int, str, str,
                                                                                BaseException | None]:
    """``files`` (path relative to ``folder`` -> bytes) written into ``folder``, then invoke_cli(``args``) run
    there (the working directory restored after)."""
    for relative, data in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(data)
    previous = os.getcwd()
    os.chdir(folder)
    try:
        return invoke_cli(args)
    finally:
        os.chdir(previous)


def _warm_trace(partial: Base, folder: Path) -> None:
    """Run ``trace`` once on the MoE model (with a model_type, so it reaches the tokenizer; it has no tokenizer
    files: an error): transformers' first tokenizer lookup imports for seconds, which a timed case would read as a
    hang."""
    config = json.dumps({**partial.moe.config, "model_type": "qwen3_moe"}).encode()
    files = partial.moe.files() | {"prompts.txt": b"hello\n", "ckpt/config.json": config}
    invoke_cli_in(folder / "moe", files, ["trace", "--model", "ckpt", "--prompts", "prompts.txt", "--device", "cpu"])


def make_plan_text(partial: Base, folder: Path, args: list[str], moe: bool) -> str:
    """The plan the CLI makes from the partial base's files for ``args``; the base is broken if it fails."""
    files = {relative: data for relative, data in partial.files(moe).items()
             if not (relative.endswith(".yaml") and "plan" in relative)}
    code, stdout, stderr, exception = invoke_cli_in(folder, files, args)
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
    #: relative path -> one of SPECIAL_KINDS, made before the command runs (files cannot hold a FIFO)
    special: dict = field(default_factory=dict)
    #: commands run after the first one succeeds, each of which must succeed too (the round trip)
    then: tuple = ()


#: what a special path can be: a FIFO (opening it for reading waits for a writer), a folder, or a link to a device
#: (or, as "link-to:NAME", to another file of the case)
SPECIAL_KINDS = ("fifo", "folder", "dev-null", "dev-zero", "dev-urandom", "link-to-fifo")


def make_special(path: Path, kind: str) -> None:
    """Create ``path`` as a special file of ``kind`` (replacing whatever the base files put there)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "link-to-fifo":
        os.mkfifo(path.with_name(path.name + ".fifo"))
        path.symlink_to(path.name + ".fifo")
    elif kind.startswith("link-to:"):  # a link to another of the case's files (an output that is an input)
        path.symlink_to(kind.removeprefix("link-to:"))
    else:
        path.symlink_to("/dev/" + kind.removeprefix("dev-"))


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
    for relative, kind in case.special.items():
        make_special(folder / relative, kind)
    previous = os.getcwd()
    os.chdir(folder)
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    time_limit_s *= 1 + len(case.then)  # each command of a round trip gets the limit
    signal.setitimer(signal.ITIMER_REAL, time_limit_s)
    start = time.perf_counter()
    try:
        code, stdout, stderr, exception = invoke_cli(case.args)
        signal.setitimer(signal.ITIMER_REAL, 0)
        message = ([line for line in stderr.splitlines() if line.strip()] or [""])[-1]
        elapsed_ms = 1e3 * (time.perf_counter() - start)
        verdict, detail = _classify(case, code, stderr, exception, folder)
        if verdict in ("error", "accepted", "accepted-invalid"):
            verdict, detail = _inputs_kept(case, files, folder, code) or (verdict, detail)
        if verdict == "accepted" and case.then:
            verdict, detail = _round_trip(case.then)
            elapsed_ms = 1e3 * (time.perf_counter() - start)
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


def _round_trip(commands: tuple) -> tuple[str, str]:
    """Run each reading command of the round trip: all must succeed on the plan the first command wrote."""
    for command in commands:
        code, _, stderr, exception = invoke_cli(list(command))
        if exception is not None:
            return "traceback", _where(exception)
        if code != 0:
            last = ([line for line in stderr.splitlines() if line.strip()] or ["(nothing on stderr)"])[-1]
            verdict = "traceback" if BUG_MARKER in last else "round-trip"
            return verdict, f"{' '.join(command[:1] + command[2:])}: {last[:140]}"
    return "accepted", ""


def _inputs_kept(case: Case, files: dict, folder: Path, code: int) -> tuple[str, str] | None:
    """("clobbered", which) when the command changed a file the case wrote (an input: the checkpoint, profile,
    plans, traces, prompts), None when every one is as written. A command that succeeded may write its own -o."""
    outputs = {case.args[i + 1] for i, word in enumerate(case.args[:-1]) if word in ("-o", "--output")} if code == 0 \
        else set()
    for relative, data in files.items():
        if data is None or relative in case.special or relative in outputs or relative == GUARD_NAME:
            continue
        path = folder / relative
        if any(parent in case.special for parent in map(str, Path(relative).parents)):
            continue
        try:
            same = path.is_file() and not path.is_symlink() and path.read_bytes() == data
        except OSError:
            same = False
        if not same:
            return "clobbered", f"input {relative} changed by {case.args[0]}"
    return None


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
    if len(errors[0]) > MAX_ERROR_CHARS:
        return "long-line", f"{len(errors[0])} chars: {errors[0][len(ERROR_PREFIX):][:60]}"
    return "error", ""


def _where(exception: BaseException) -> str:
    """'TypeError in planner/source/safetensors_header.py:_entry': the innermost project frame of the exception."""
    frames = traceback.extract_tb(exception.__traceback__)
    project = [f for f in frames if "/planner/" in f.filename or "/offload_plan/" in f.filename]
    frame = (project or frames or [None])[-1]
    where = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.name}" if frame else "?"
    return f"{type(exception).__name__} in {where}"


def scratch_dir() -> str | None:
    """Where case folders go: memory (/dev/shm) where there is one, since a disk's rmdir costs milliseconds."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


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


def deep_nesting(levels: int) -> str:
    """A JSON or YAML list nested ``levels`` deep."""
    return "[" * levels + "]" * levels


#: a YAML document of 20 aliases, each of nine of the one before: 9**20 nodes once expanded (a billion laughs)
ALIAS_BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
                       + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 20)]) + "\n"
#: a list nested 10,000 deep: past Python's recursion limit for a recursive reader
DEEP = deep_nesting(10_000)


def json_bytes(value) -> bytes:
    """JSON the way a buggy writer would: lone surrogates kept, NaN and Infinity as bare words."""
    return json.dumps(value, ensure_ascii=True).encode()


def yaml_text(data) -> str:
    """YAML as a user would write it (block style, keys in order), through libyaml when present: fast."""
    return yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False)


def raw_splice(document: bytes, old: bytes, new: bytes) -> bytes:
    """``document`` with its first ``old`` replaced by ``new``; ``old`` must be there (else the edit is a no-op)."""
    assert old in document, (old, document[:200])
    return document.replace(old, new, 1)


def pick_tensor(rng, tensors: dict) -> str:
    """One tensor name, the same for the same seed whatever the dict's order."""
    return rng.choice(sorted(tensors))


def make_case(family: str, mutation: str, invalid: bool, files: dict, rng, *, moe: bool = False,
               extra: tuple = ()) -> Case:
    """A make case over the base inputs with ``files`` replaced (one in five also asks for a CUDA-graph workload)."""
    args = [*BASE_ARGS, "--budget", base().budget, "-o", GUARD_NAME, *extra]
    if rng.random() < 0.2:
        args += ["--tokens", "8", "--sequences", "8", "--cuda-graph"]
    return Case(family=family, mutation=mutation, args=args, invalid=invalid, files=files, moe=moe)


