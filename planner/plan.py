"""The plan file: a frozen dataclass tree, written by one function with fixed YAML settings.

Same inputs, same bytes: stable key order, block style (one line per layer row so diffs stay readable),
floats rounded to fixed decimals, no timestamps, host names or absolute paths. A header comment holds the
command that regenerates the file. Written atomically: a failed write never leaves a partial file.
"""

import os
import tempfile
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from planner.errors import PlanError, printable, shown
from planner.untrusted import load_yaml, read_capped

SCHEMA_VERSION = 1
#: a plan of 100,000 layers is about 10 MB
MAX_PLAN_BYTES = 16 * 2**20
#: plausible bounds of any number in a plan: byte counts and counts fit in 2**62, rates (FLOP/s) stay under
#: 1e21 and times under 1e15 ms; beyond these a plan was edited by hand or corrupted, and arithmetic on it
#: (floats of huge ints, table formatting) would overflow
MAX_PLAN_INT = 2**62
MAX_PLAN_FLOAT = 1e21
MS_DECIMALS = 4
SHARE_DECIMALS = 4


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """The arguments of ``make`` that produced the plan: enough to regenerate it."""

    model: str
    revision: str | None
    gpu: str
    budget: str | None
    trigger: float | None
    tokens: int
    sequences: int
    context: int
    params: tuple[str, ...]
    stack: str | None
    group_size: int | None
    num_in_group: int | None
    prefetch_step: int | None
    #: time layers on the local GPU instead of estimating them
    measure: bool = False
    #: the local GPU's profile for --measure (None: from its device name)
    measured_on: str | None = None
    #: decode steps replayed from CUDA graphs: prefetches joined at the end of each replay, layers timed graphed
    cuda_graph: bool = False
    #: host memory for pinned params, e.g. "480GB" (None: the profile's figure, if it has one)
    host_memory: str | None = None


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """What was planned: the checkpoint's identity and how its bytes divide."""

    source: str
    #: hub commit the headers were read at; null for local checkpoints
    revision: str | None
    #: sha256 over every tensor's name, dtype and shape
    fingerprint: str
    architecture: str | None
    #: the planned layer stack's name prefix
    stack: str
    #: layers of the stack that run
    num_layers: int
    num_tensors: int
    #: every tensor of the checkpoint
    total_bytes: int
    #: bytes of the layers that run
    layer_bytes: int
    #: embeddings, norms, head and other stacks: always on the GPU
    non_layer_bytes: int
    #: stack layers beyond config's layer count (e.g. multi-token prediction): never loaded
    unused_layers: tuple[int, ...]
    unused_bytes: int
    #: dtype -> bytes, over the whole checkpoint
    dtype_bytes: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class HardwareSection:
    """The profile figures the plan was computed with."""

    profile: str
    gpu_memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float | None
    h2d_bytes_per_s: float
    copy_overhead_us: float
    trigger: float
    reserve_bytes: int
    compute_efficiency: float
    #: host memory the plan's pinned bytes were checked against (--host-memory, else the profile's); None: unchecked
    host_memory_bytes: int | None = None

    def __post_init__(self):
        # The same rules as planner.profile.HardwareProfile: a plan read back must not divide by a zero rate.
        for key in ("gpu_memory_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "h2d_bytes_per_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"hardware.{key} must be positive")
        for key in ("fp8_flops_per_s", "host_memory_bytes"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ValueError(f"hardware.{key} must be positive (or null)")
        for key in ("trigger", "compute_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"hardware.{key} must be a share in (0, 1]")
        if not self.reserve_bytes < self.gpu_memory_bytes:
            raise ValueError("hardware.reserve_bytes must be less than gpu_memory_bytes")


@dataclass(frozen=True, kw_only=True)
class WorkloadSection:
    """One forward step."""

    tokens_per_step: int
    sequences_per_step: int
    context_tokens: int
    #: where the per-layer compute times come from ("estimated: ..." or "measured: ...")
    compute_source: str
    #: steps are CUDA-graph replays of planner.simulate.STEPS_PER_GRAPH steps (one): copies that wrap past a
    #: replay's last step finish inside it
    cuda_graph: bool = False

    def __post_init__(self):
        if self.tokens_per_step < 1 or self.sequences_per_step < 1 or self.tokens_per_step % self.sequences_per_step:
            raise ValueError("workload.tokens_per_step must be a positive multiple of sequences_per_step (>= 1)")


@dataclass(frozen=True, kw_only=True)
class OffloadSection:
    """The decisions, in the engines' terms, and the explicit layer list."""

    #: G: layers are taken in groups of G (0 when nothing is offloaded)
    group_size: int
    #: K: the last K layers of every group are offloaded
    num_in_group: int
    #: P: copies run this many offloaded layers ahead; also the number of GPU slots
    prefetch_step: int
    #: name segments selecting the params that move (empty: whole layers)
    params: tuple[str, ...]
    #: offloaded layer indices, ascending
    layers: tuple[int, ...]
    #: under CUDA graphs (workload.cuda_graph; written only then): of the copies that wrap past a replay, the
    #: last this many are issued by the next replay as it begins instead of joined at this one's end
    replay_start_copies: int = 0

    def __post_init__(self):
        if list(self.layers) != sorted(set(self.layers)):
            raise ValueError("offload.layers must be ascending and distinct")
        if not 0 <= self.replay_start_copies <= (self.prefetch_step if self.layers else 0):
            raise ValueError("offload.replay_start_copies must be between 0 and prefetch_step")
        if self.layers and (self.prefetch_step < 1 or self.group_size < 1):
            raise ValueError("offload.prefetch_step and offload.group_size must be >= 1 when layers are offloaded")


@dataclass(frozen=True, kw_only=True)
class MemorySection:
    """Where the weights live."""

    budget_bytes: int
    #: weights on the GPU: resident params + slots + non-layer tensors + allocation slack
    gpu_bytes: int
    resident_layer_bytes: int
    non_layer_bytes: int
    #: alignment pads and allocator rounding of the runtime's one GPU allocation (planner.placement)
    allocation_slack_bytes: int
    num_slots: int
    #: one slot holds the largest offloaded layer's selected params
    slot_bytes: int
    #: offloaded params in pinned host memory
    host_pinned_bytes: int


@dataclass(frozen=True, kw_only=True)
class PredictionSection:
    """The simulated steady-state step."""

    step_ms: float
    resident_step_ms: float
    #: compute outside the stack per step (embedding, final norm, LM head)
    head_ms: float
    stall_ms: float
    #: offloaded bytes copied per step / host-to-device bandwidth: no step can be faster than this
    link_floor_ms: float
    copy_bytes_per_step: int
    #: share of the step the link is busy
    link_busy_share: float


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """One planned layer."""

    index: int
    bytes: int
    #: bytes moved over the link when offloaded (selected params); 0 for resident layers
    offloaded_bytes: int
    compute_ms: float
    #: copy time of the selected params (shown for every layer, to see what offloading it would cost)
    copy_ms: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A whole plan file."""

    schema_version: int
    inputs: Inputs
    model: ModelSection
    hardware: HardwareSection
    workload: WorkloadSection
    offload: OffloadSection
    memory: MemorySection
    prediction: PredictionSection
    layers: tuple[LayerRow, ...]

    def __post_init__(self):
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}")
        if len(self.layers) != self.model.num_layers:
            raise ValueError("layers must have one row per planned layer")
        if any(i >= self.model.num_layers for i in self.offload.layers):
            raise ValueError("offload.layers names a layer beyond model.num_layers")
        if self.offload.replay_start_copies and not self.workload.cuda_graph:
            raise ValueError("offload.replay_start_copies applies to CUDA-graph plans (workload.cuda_graph) only")
        if self.offload.layers and not 1 <= self.offload.num_in_group <= self.offload.group_size:
            raise ValueError("offload.num_in_group must be between 1 and group_size when layers are offloaded")


SECTIONS = {
    "inputs": Inputs,
    "model": ModelSection,
    "hardware": HardwareSection,
    "workload": WorkloadSection,
    "offload": OffloadSection,
    "memory": MemorySection,
    "prediction": PredictionSection,
}


# ---- writing ------------------------------------------------------------------------------------------------


class _FlowRow(dict):
    """A mapping dumped on one line: per-layer rows, so a moved layer is a one-line diff."""


class _Dumper(yaml.SafeDumper):
    pass


def _represent_flow_row(dumper, data):
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


def _represent_flow_list(dumper, data):
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


class _FlowList(list):
    """A short list of scalars dumped on one line (layer indices, params)."""


_Dumper.add_representer(_FlowRow, _represent_flow_row)
_Dumper.add_representer(_FlowList, _represent_flow_list)


def _rounded(value: Any, decimals: int) -> Any:
    return round(value, decimals) if isinstance(value, float) else value


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data in schema key order (also what ``show --json`` prints)."""
    out: dict = {"schema_version": plan.schema_version}
    for name in SECTIONS:
        section = asdict(getattr(plan, name))
        out[name] = {key: _plain(value) for key, value in section.items()}
    if not plan.workload.cuda_graph:
        del out["offload"]["replay_start_copies"]  # eager plans keep their bytes
    out["layers"] = [{key: _plain(value) for key, value in asdict(row).items()} for row in plan.layers]
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float):
        return round(value, MS_DECIMALS) if abs(value) < 1e6 else value
    return value


def render_plan(plan: Plan, command: str) -> str:
    """The plan's file text: header comment with the regenerating command, then block-style YAML."""
    data = plan_to_dict(plan)
    for name in ("inputs", "offload", "model"):
        for key, value in data[name].items():
            if isinstance(value, list):
                data[name][key] = _FlowList(value)
    data["layers"] = [_FlowRow(row) for row in data["layers"]]
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, allow_unicode=False)
    header = (
        "# Offload plan written by offload-plan. Do not edit by hand; regenerate with:\n"
        f"#   {command}\n"
    )
    return header + body


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file.

    Every problem with the destination (a folder, a missing or unwritable folder, a full disk) is one PlanError
    line, and the file that was there before is left as it was.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    shown = printable(path)
    if path.is_dir():
        raise PlanError(f"{shown} is a folder; give a file name for the plan, e.g. {printable(path / 'plan.yaml')}")
    if not directory.is_dir():
        what = "is not a folder" if directory.exists() else "does not exist"
        raise PlanError(f"output folder {printable(directory)} {what}; create it first or choose another path")
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise PlanError(f"cannot write in {printable(directory)} ({error.strerror}); check its permissions or choose "
                        "another path") from None
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise PlanError(f"cannot write {shown} ({error.strerror}); check the path, its permissions and free "
                            "space") from None
        raise


# ---- reading ------------------------------------------------------------------------------------------------


def read_plan(path: Path) -> Plan:
    """Load and validate a plan file; any problem is a one-line PlanError naming the field."""
    path = Path(path)
    raw = read_capped(path, MAX_PLAN_BYTES, PlanError, "plan")
    data = load_yaml(raw, str(path), PlanError, fix="regenerate it with make")
    return plan_from_dict(data, str(path))


def plan_from_dict(data: object, origin: str) -> Plan:
    """Build a Plan from parsed YAML."""
    if not isinstance(data, dict):
        raise PlanError(f"{origin}: not a plan (expected a mapping); regenerate it with offload-plan make")
    expected = {"schema_version", "layers", *SECTIONS}
    if set(data) != expected:
        problems = sorted(set(data) ^ expected, key=str)  # YAML keys may be numbers too
        raise PlanError(f"{origin}: plan keys differ from schema {SCHEMA_VERSION} at {problems}; regenerate it")
    if type(data["schema_version"]) is not int or data["schema_version"] != SCHEMA_VERSION:  # 1.0 and true are not 1
        raise PlanError(
            f"{origin}: schema_version {shown(data['schema_version'])} is not {SCHEMA_VERSION}; regenerate it"
        )
    kwargs: dict = {"schema_version": SCHEMA_VERSION}
    for name, cls in SECTIONS.items():
        kwargs[name] = _section(cls, data[name], f"{origin}: {name}")
    rows = data["layers"]
    if not isinstance(rows, list):
        raise PlanError(f"{origin}: layers must be a list of rows; regenerate the plan")
    kwargs["layers"] = tuple(_section(LayerRow, row, f"{origin}: layers[{i}]") for i, row in enumerate(rows))
    misplaced = [i for i, row in enumerate(kwargs["layers"]) if row.index != i]
    if misplaced:
        raise PlanError(f"{origin}: layers[{misplaced[0]}] has index {kwargs['layers'][misplaced[0]].index}; rows must "
                        "be numbered 0, 1, 2, ... in order: regenerate the plan")
    try:
        return Plan(**kwargs)
    except ValueError as error:
        raise PlanError(f"{origin}: {error}; regenerate the plan") from None


_TYPES = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
_BASES = (bool, int, float, str)


def _section(cls, raw: object, origin: str):
    if not isinstance(raw, dict):
        raise PlanError(f"{origin} must be a mapping; regenerate the plan")
    names = [f.name for f in fields(cls)]
    # Fields added after schema 1 carry defaults: a plan written before them still reads (check reports it stale).
    optional = {f.name for f in fields(cls) if f.default is not MISSING}
    if set(raw) - set(names) or set(names) - set(raw) - optional:
        wrong = sorted((set(raw) - set(names)) | (set(names) - set(raw) - optional), key=str)
        raise PlanError(f"{origin}: keys {wrong} differ from the schema; regenerate the plan")
    values = {}
    for f in fields(cls):
        if f.name in raw:
            values[f.name] = _check_type(raw[f.name], f.type, f"{origin}.{f.name}")
    try:
        return cls(**values)
    except ValueError as error:
        raise PlanError(f"{origin}: {error}; regenerate the plan") from None


def _check_type(value: Any, annotation: Any, origin: str) -> Any:
    """Check one field against its annotation (int, float, str, optional, tuples and str->int dicts)."""
    text = str(annotation)
    if value is None:
        if "None" in text:
            return None
        raise PlanError(f"{origin} must not be null; regenerate the plan")
    if text.startswith("tuple"):
        inner = int if "int" in text else str
        if not isinstance(value, list) or not all(_is(v, inner) for v in value):
            raise PlanError(f"{origin} must be a list of {inner.__name__}; regenerate the plan")
        if inner is int and not all(_plausible(v) for v in value):
            raise PlanError(f"{origin} must hold whole numbers from 0 to {MAX_PLAN_INT}; regenerate the plan")
        return tuple(value)
    if text.startswith("dict"):
        if not isinstance(value, dict) or not all(isinstance(k, str) and _is(v, int) and _plausible(v)
                                                  for k, v in value.items()):
            raise PlanError(f"{origin} must be a mapping of names to whole numbers; regenerate the plan")
        return value
    base = next(t for t in _BASES if t is annotation or text.split("|")[0].strip() in (t.__name__, f"<class '{t.__name__}'>"))
    if base is bool:
        if not isinstance(value, bool):
            raise PlanError(f"{origin} must be true or false, got {shown(value)}; regenerate the plan")
        return value
    if not _is(value, base):
        raise PlanError(f"{origin} must be {base.__name__}, got {shown(value)}; regenerate the plan")
    if base in (int, float) and not _plausible(value):
        raise PlanError(f"{origin} is {value!r}; plan numbers are finite, not negative and below "
                        f"{MAX_PLAN_INT if base is int else MAX_PLAN_FLOAT:g}: regenerate the plan")
    return float(value) if base is float else value


def _plausible(value: int | float) -> bool:
    limit = MAX_PLAN_INT if isinstance(value, int) else MAX_PLAN_FLOAT
    return 0 <= value <= limit  # False for NaN too


def _is(value: Any, kind: type) -> bool:
    return not isinstance(value, bool) and isinstance(value, _TYPES[kind])
