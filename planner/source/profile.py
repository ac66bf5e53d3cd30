"""Hardware profiles: YAML data in ``profiles/``, read into a frozen dataclass that validates itself.

Every figure carries its provenance (``datasheet``, ``measured``, ``fitted`` or ``assumed``) and a note that
says where it comes from, so a reviewer can tell a reading from a lead.
"""

import difflib
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path


from planner.errors import ProfileError, shown
from planner.source.untrusted import checked_path, load_yaml, read_capped

SOURCES = ("datasheet", "measured", "fitted", "assumed")
PROFILE_SUFFIXES = (".yaml", ".yml")


def profiles_dir() -> Path:
    """The built-in profiles: ``profiles/`` beside the packages (repo checkout or installed data)."""
    package = Path(__file__).resolve().parent.parent  # planner/, whose parent is the checkout
    for candidate in (package.parent / "profiles", package / "_profiles"):
        if candidate.is_dir():
            return candidate
    raise ProfileError("the built-in profiles folder is missing from this installation; reinstall offload-plan")


#: plausible upper bounds of each figure, far above any chip today: a figure beyond is a typo (a unit off by
#: 1e9) or a corrupt file, and the arithmetic on it would overflow or mislead
FIGURE_MAX = {"gpu_memory_bytes": 2**50, "hbm_bytes_per_s": 1e16, "bf16_flops_per_s": 1e19,
              "fp8_flops_per_s": 1e19, "h2d_bytes_per_s": 1e14, "copy_overhead_us": 1e6, "reserve_bytes": 2**50,
              "host_memory_bytes": 2**60, "gpu_link_bytes_per_s": 1e14, "fp8_dequant_bytes_per_s": 1e16,
              "nccl_bytes": 2**50}
#: plausible lower bounds of the rates and shares, far below any chip: a rate of 1e-300 is a typo, and the
#: planner's times (bytes / rate) would overflow to infinity
FIGURE_MIN = {"gpu_link_bytes_per_s": 1e6, "fp8_dequant_bytes_per_s": 1e6,
              "hbm_bytes_per_s": 1e6, "bf16_flops_per_s": 1e6, "fp8_flops_per_s": 1e6, "h2d_bytes_per_s": 1e6,
              "compute_efficiency": 1e-3}
#: figures that must be above zero (trigger and compute_efficiency are shares, checked as such): the planner
#: divides by the rates, and zero memory holds nothing. A zero
#: rate is refused, not read as "unknown": fp8_flops_per_s is null (or left out) on chips without fp8
POSITIVE_FIGURES = ("gpu_memory_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s",
                    "h2d_bytes_per_s", "host_memory_bytes", "gpu_link_bytes_per_s", "fp8_dequant_bytes_per_s")
MAX_PROFILE_BYTES = 2**20


def _finite(value: int | float) -> bool:
    """math.isfinite without its OverflowError on integers beyond a float."""
    return abs(value) <= 1e300 and math.isfinite(value)


def _check_figure(key: str, value: object, lowest: float, highest: float, *, whole: bool = False,
                  kind: str | None = None) -> None:
    """ValueError (one line) unless ``value`` is a finite number (a whole one where ``whole``; never a bool) from
    ``lowest`` to ``highest``; ``kind`` names it in the message (default: "a whole number" or "a number")."""
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not _finite(value) \
            or not lowest <= value <= highest:
        kind = kind or ("a whole number" if whole else "a number")
        raise ValueError(f"{key} must be {kind} from {lowest:g} to {highest:g}, not {shown(value)}")


#: the host copy's dtypes the CPU's expert rates may be measured for (runtime.cpu_experts.CPU_DTYPES)
CPU_EXPERT_DTYPES = ("bf16", "fp32")
#: plausible bounds of the CPU's expert figures, far beyond any host: a figure outside is a unit off or a corrupt
#: file, and the planner divides by the rates
CPU_EXPERT_BOUNDS = {"threads": (1, 4096), "weight_bytes_per_s": (1e6, 1e14), "flops_per_s": (1e6, 1e17),
                     "overhead_us": (0, 1e6), "hidden_size": (1, 2**20), "intermediate_size": (1, 2**20)}
#: the largest make --cpu-time-scale: a CPU a hundred times slower than its price computes no expert in time
MAX_CPU_TIME_SCALE = 100.0
#: the most token counts a measured table may hold, and the largest count (a prefill chunk's tokens per expert)
MAX_CPU_TABLE_ROWS = 64
MAX_CPU_TABLE_TOKENS = 2**20
#: the longest one expert may take on the CPU, per the table: beyond, a unit is off (seconds written as ms)
MAX_CPU_EXPERT_MS = 1e5


@dataclass(frozen=True, kw_only=True)
class CpuExperts:
    """The host CPU's rate at computing routed experts (gate/up/down SwiGLU MLPs), measured by ``calibrate``:
    the table it read for one expert shape, and the two rates fitted to it that carry it to other shapes and
    token counts (planner.search.cpu_experts.cpu_expert_ms)."""

    #: CPU threads the experts were computed with (torch.set_num_threads)
    threads: int
    #: the host copy's dtype the CPU read the weights in (one of CPU_EXPERT_DTYPES): the fastest measured
    dtype: str
    #: the measured expert's shape: hidden size H and intermediate size I (3 x H x I weights)
    hidden_size: int
    intermediate_size: int
    #: (tokens, ms to compute one expert of that shape for that many tokens), tokens ascending: measured
    ms_per_expert_at_tokens: tuple[tuple[int, float], ...]
    #: fitted: the weight bytes the CPU reads per second at one token (the table's first row less the overhead)
    weight_bytes_per_s: float
    #: fitted: the rate each further token's 6 x H x I FLOPs run at (the table's last two rows' slope)
    flops_per_s: float
    #: fitted: each expert's fixed cost on the CPU beside its bytes (a small expert's time at one token)
    overhead_us: float
    #: measured on a CUDA GPU: a routed layer's handoff to the CPU and back with no pair to compute, as the
    #: runtime makes it inside a captured step (runtime.calibrate.measure_handoff_ms); None: not measured (the
    #: planner then takes planner.search.cpu_experts.CPU_HANDOFF_MS)
    handoff_us: float | None = None
    #: one of SOURCES
    source: str = "measured"
    #: how and where it was measured, for people
    note: str = ""
    #: a CPU expert's time inside the step as a multiple of its price from the figures above (make
    #: --cpu-time-scale: run --bench counts the host's own); not a profile key, 1.0 unless a plan's inputs say
    in_step_scale: float = 1.0

    def __post_init__(self):
        if not 0 < self.in_step_scale <= MAX_CPU_TIME_SCALE:
            raise ValueError(f"in_step_scale {self.in_step_scale:g} is not in (0, {MAX_CPU_TIME_SCALE:g}]")
        if self.dtype not in CPU_EXPERT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(CPU_EXPERT_DTYPES)}, not {shown(self.dtype)}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {shown(self.source)}")
        for key, (lowest, highest) in CPU_EXPERT_BOUNDS.items():
            _check_figure(key, getattr(self, key), lowest, highest,
                          whole=key in ("threads", "hidden_size", "intermediate_size"))
        if self.handoff_us is not None:
            _check_figure("handoff_us", self.handoff_us, 0, 1e6, whole=False)
        self._check_table()

    def _check_table(self) -> None:
        table = self.ms_per_expert_at_tokens
        if not isinstance(table, tuple) or not 1 <= len(table) <= MAX_CPU_TABLE_ROWS:
            raise ValueError(f"ms_per_expert_at_tokens must hold 1 to {MAX_CPU_TABLE_ROWS} token counts")
        for tokens, ms in table:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_CPU_TABLE_TOKENS:
                raise ValueError(f"ms_per_expert_at_tokens: {shown(tokens)} is no token count from 1 to "
                                 f"{MAX_CPU_TABLE_TOKENS}")
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not _finite(ms) \
                    or not 0 < ms <= MAX_CPU_EXPERT_MS:
                raise ValueError(f"ms_per_expert_at_tokens[{tokens}] must be a time in (0, {MAX_CPU_EXPERT_MS:g}] "
                                 f"ms, not {shown(ms)}")
        counts = [tokens for tokens, _ in table]
        if counts != sorted(set(counts)):
            raise ValueError("ms_per_expert_at_tokens must list each token count once, ascending")

    @property
    def num_params(self) -> int:
        """Weights of the measured expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.intermediate_size


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One number of a profile, with where it comes from."""

    value: float
    #: one of SOURCES
    source: str
    #: citation or method, for people
    note: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {shown(self.source)}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not _finite(self.value):
            raise ValueError(f"value must be a finite number, not {shown(self.value)}")
        if self.value < 0:
            raise ValueError(f"value must not be negative, got {self.value}")


#: the longest a layer's floor may be: beyond, a unit is off (seconds written as ms)
MAX_LAYER_FLOOR_MS = 100.0


@dataclass(frozen=True, kw_only=True)
class LayerFloor:
    """What a decoder layer takes on this stack however small it is, measured by ``calibrate`` on layers whose
    roofline is ~0: the kernels' launches and the gaps between them, which the roofline leaves out. On the lent
    H100 a graphed decode layer took 0.083 ms dense and 0.176 ms MoE (OLMoE's 3-layer decode: 0.268 ms measured
    per layer against a 0.090 ms roofline), and an eager MoE prefill layer 2.2-2.35 ms whatever its size (its
    router, top-k and grouped GEMM setup are issued from the host one by one)."""

    #: ms a dense layer adds to a step replayed from a CUDA graph (added to the roofline)
    graphed_dense_ms: float
    #: likewise a MoE layer (router, top-k, expert kernels)
    graphed_moe_ms: float
    #: ms an eager MoE layer takes at least, its kernels issued from the host (the roofline's floor)
    eager_moe_ms: float
    #: one of SOURCES
    source: str = "measured"
    note: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {shown(self.source)}")
        for key in ("graphed_dense_ms", "graphed_moe_ms", "eager_moe_ms"):
            _check_figure(key, getattr(self, key), 0, MAX_LAYER_FLOOR_MS, kind="ms")

    def layer_ms(self, roofline_ms: float, *, moe: bool, graphed: bool) -> float:
        """A layer's time from its roofline: the floor added when graphed; an eager MoE layer's at least its floor
        (an eager dense layer keeps its roofline: its host work hides under the GPU's on the sizes measured)."""
        if graphed:
            return roofline_ms + (self.graphed_moe_ms if moe else self.graphed_dense_ms)
        return max(roofline_ms, self.eager_moe_ms) if moe else roofline_ms


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What the planner needs to know about one GPU and its link to host memory."""

    name: str
    description: str
    #: GPU memory usable by programs
    gpu_memory_bytes: Figure
    hbm_bytes_per_s: Figure
    #: dense (not sparse) bf16 tensor-core rate
    bf16_flops_per_s: Figure
    #: dense fp8 rate; None on chips without fp8 tensor cores
    fp8_flops_per_s: Figure | None
    #: pinned host-to-device copy-engine bandwidth for layer-sized copies
    h2d_bytes_per_s: Figure
    #: fixed cost of one host-to-device copy, on top of bytes / bandwidth
    copy_overhead_us: Figure
    #: default share of GPU memory that weights may occupy (vLLM PR 6081's trigger)
    trigger: Figure
    #: GPU memory held back for activations, KV cache and the CUDA context
    reserve_bytes: Figure
    #: share of peak FLOP/s and HBM bandwidth that an eager decoder layer reaches
    compute_efficiency: Figure
    #: host memory this GPU's offloaded params may be pinned in (its share where GPUs share one host, as two
    #: B200s share a Grace); None where it depends on the machine, as on PCIe servers
    host_memory_bytes: Figure | None = None
    #: GPU memory a process holds beyond its tensors (CUDA context, library workspaces, allocator rounding);
    #: None: planner.search.serving.CUDA_CONTEXT_BYTES
    cuda_context_bytes: Figure | None = None
    #: GPU-to-GPU bandwidth per direction of each GPU (NVLink) that tensor-parallel all-reduces cross; None where
    #: the GPUs have no such link (make --tp refuses the profile then)
    gpu_link_bytes_per_s: Figure | None = None
    #: GPU memory NCCL's communicator holds outside torch's allocator on each tensor-parallel rank (its channels'
    #: buffers, from joining the group through the first all-reduce; calibrate and make --tp N --measure measure it
    #: where two GPUs or more are visible); None: planner.search.serving.NCCL_BYTES_PER_RANK
    nccl_bytes: Figure | None = None
    #: HBM bytes per second the passes that dequantize FP8 weights before each bf16 matmul move (run's FP8 path,
    #: planner.model.fp8_cost; calibrate measures it); None: FP8_DEQUANT_HBM_SHARE of hbm_bytes_per_s
    fp8_dequant_bytes_per_s: Figure | None = None
    #: the host CPU's rate at computing routed experts (calibrate measures it); None: not measured, and the
    #: planner computes no expert on the CPU
    cpu_experts: CpuExperts | None = None
    #: the smallest time a layer takes on this stack (calibrate measures it); None: not measured, and estimates
    #: are the roofline alone
    layer_floor: LayerFloor | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or not self.name.isprintable():
            raise ValueError(f"name must be a non-empty string of printable characters, not {shown(self.name)}")
        if not isinstance(self.description, str):
            raise ValueError("description must be text")
        for key, highest in FIGURE_MAX.items():
            figure = getattr(self, key)
            if figure is None:
                continue
            if key in POSITIVE_FIGURES and figure.value <= 0:
                raise ValueError(f"{key} must be positive" + (" (null on chips without fp8)" if key.startswith("fp8")
                                                             else ""))
            if figure.value < 0:
                raise ValueError(f"{key} must not be negative")
            if figure.value > highest:
                raise ValueError(f"{key} is {figure.value:g}, beyond any GPU (at most {highest:g}): check its unit")
            if key in FIGURE_MIN and 0 < figure.value < FIGURE_MIN[key]:
                raise ValueError(f"{key} is {figure.value:g}, below any GPU (at least {FIGURE_MIN[key]:g}): check its "
                                 "unit")
        for key in ("trigger", "compute_efficiency"):
            if not 0 < getattr(self, key).value <= 1:
                raise ValueError(f"{key} must be a share in (0, 1], got {getattr(self, key).value}")
        if self.compute_efficiency.value < FIGURE_MIN["compute_efficiency"]:
            raise ValueError(f"compute_efficiency {self.compute_efficiency.value:g} is below any GPU (at least "
                             f"{FIGURE_MIN['compute_efficiency']:g})")
        if self.reserve_bytes.value >= self.gpu_memory_bytes.value:
            raise ValueError("reserve_bytes must be less than gpu_memory_bytes")

    @property
    def weight_limit_bytes(self) -> int:
        """The most GPU memory weights may take: all of it less the reserve."""
        return int(self.gpu_memory_bytes.value - self.reserve_bytes.value)

    def figures(self) -> dict[str, float | None]:
        """Field name -> value, for plans and tables (the GPU link is recorded by tensor-parallel plans alone, the
        FP8 dequantizing rate in the compute source of the plans it prices)."""
        return {
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).value)
            for f in fields(self)
            if f.name not in ("name", "description", "gpu_link_bytes_per_s", "fp8_dequant_bytes_per_s", *_SECTIONS)
        }


#: the profile's optional sections beside its figures (not recorded in a plan's hardware section)
_SECTIONS = ("cpu_experts", "layer_floor")
_FIGURE_FIELDS = tuple(f.name for f in fields(HardwareProfile) if f.name not in ("name", "description", *_SECTIONS))
_OPTIONAL_FIELDS = ("fp8_flops_per_s", "host_memory_bytes", "cuda_context_bytes", "gpu_link_bytes_per_s",
                    "fp8_dequant_bytes_per_s", "nccl_bytes")


def profile_from_dict(data: object, origin: str) -> HardwareProfile:
    """Build a profile from parsed YAML, naming the field and the fix in any error."""
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: a profile is a YAML mapping of fields; see profiles/h100-sxm.yaml")
    known = {"name", "description", *_SECTIONS, *_FIGURE_FIELDS}
    unknown = sorted(set(data) - known, key=str)  # YAML keys may be numbers too
    if unknown:
        raise ProfileError(f"{origin}: unknown field(s) {shown(unknown, 60)}; the fields are those of "
                           "profiles/h100-sxm.yaml (fp8_flops_per_s, host_memory_bytes, cuda_context_bytes, "
                           "gpu_link_bytes_per_s, fp8_dequant_bytes_per_s, nccl_bytes, cpu_experts, layer_floor "
                           "optional)")
    missing = sorted(k for k in known - set(data) if k not in (*_OPTIONAL_FIELDS, *_SECTIONS))
    if missing:
        raise ProfileError(f"{origin}: missing field(s) {missing}; see profiles/h100-sxm.yaml for the format")
    kwargs = {"name": data["name"], "description": str(data.get("description") or "")}
    for key in _FIGURE_FIELDS:
        kwargs[key] = _figure(data.get(key), key, origin)
    kwargs["cpu_experts"] = _cpu_experts(data.get("cpu_experts"), origin)
    kwargs["layer_floor"] = _layer_floor(data.get("layer_floor"), origin)
    try:
        return HardwareProfile(**kwargs)
    except (TypeError, ValueError) as error:
        raise ProfileError(f"{origin}: {error}") from None


def _figure(raw: object, key: str, origin: str) -> Figure | None:
    if raw is None and key in _OPTIONAL_FIELDS:
        return None
    if not isinstance(raw, dict) or "value" not in raw or "source" not in raw:
        raise ProfileError(f"{origin}: field {key} must be a mapping with value, source and note")
    extra = sorted(set(raw) - {"value", "source", "note"}, key=str)
    if extra:
        raise ProfileError(f"{origin}: field {key} has unknown key(s) {extra}; use value, source and note")
    value = raw["value"]
    if key.endswith("_bytes") and isinstance(value, float):
        if not value.is_integer():
            raise ProfileError(f"{origin}: field {key} must be a whole number of bytes, got {value}")
        value = int(value)  # 1.0e+9 in YAML: a byte count all the same
    try:
        return Figure(value=value, source=raw["source"], note=str(raw.get("note", "")))
    except ValueError as error:
        raise ProfileError(f"{origin}: field {key}: {error}") from None


_CPU_KEYS = ("threads", "dtype", "hidden_size", "intermediate_size", "ms_per_expert_at_tokens", "weight_bytes_per_s",
             "flops_per_s", "overhead_us", "handoff_us", "source", "note")
#: the cpu_experts keys a section may leave out
_CPU_OPTIONAL = ("handoff_us", "source", "note")


def _cpu_experts(raw: object, origin: str) -> CpuExperts | None:
    """The profile's cpu_experts section (absent or null: not measured), every key checked; one line on a bad
    one."""
    if raw is None:
        return None
    where = f"{origin}: cpu_experts"
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be a mapping of {', '.join(_CPU_KEYS)}; offload-plan calibrate writes it")
    unknown = sorted(set(raw) - set(_CPU_KEYS), key=str)
    missing = [key for key in _CPU_KEYS if key not in raw and key not in _CPU_OPTIONAL]
    if unknown or missing:
        what = f"unknown key(s) {shown(unknown, 60)}" if unknown else f"missing key(s) {missing}"
        raise ProfileError(f"{where} has {what}; its keys are {', '.join(_CPU_KEYS)} "
                           f"({', '.join(_CPU_OPTIONAL)} optional)")
    table = raw["ms_per_expert_at_tokens"]
    if not isinstance(table, dict):
        raise ProfileError(f"{where}.ms_per_expert_at_tokens must map token counts to ms per expert (1: 0.25)")
    kwargs = {key: raw[key] for key in _CPU_KEYS if key in raw and key != "ms_per_expert_at_tokens"}
    kwargs["note"] = str(kwargs.get("note") or "")
    try:
        return CpuExperts(**kwargs, ms_per_expert_at_tokens=tuple(sorted(table.items(), key=_table_order)))
    except (TypeError, ValueError) as error:
        raise ProfileError(f"{where}: {error}") from None


_FLOOR_KEYS = ("graphed_dense_ms", "graphed_moe_ms", "eager_moe_ms", "source", "note")


def _layer_floor(raw: object, origin: str) -> LayerFloor | None:
    """The profile's layer_floor section (absent or null: not measured), every key checked; one line on a bad
    one."""
    if raw is None:
        return None
    where = f"{origin}: layer_floor"
    if not isinstance(raw, dict) or set(raw) - set(_FLOOR_KEYS) or set(_FLOOR_KEYS[:3]) - set(raw):
        raise ProfileError(f"{where} must be a mapping of {', '.join(_FLOOR_KEYS)} (source, note optional); "
                           "offload-plan calibrate writes it")
    try:
        return LayerFloor(**{**raw, "note": str(raw.get("note") or "")})
    except (TypeError, ValueError) as error:
        raise ProfileError(f"{where}: {error}") from None


def _table_order(item: tuple) -> tuple:
    """Token counts in order, anything that is no count last (refused by CpuExperts, by name)."""
    tokens = item[0]
    counted = isinstance(tokens, int) and not isinstance(tokens, bool)
    return (0, tokens, "") if counted else (1, 0, str(tokens))


def cpu_experts_to_dict(cpu: CpuExperts) -> dict:
    """The YAML-ready form of a profile's cpu_experts section (the inverse of its reader)."""
    out = {key: getattr(cpu, key) for key in _CPU_KEYS if key != "ms_per_expert_at_tokens"
           and not (key == "handoff_us" and cpu.handoff_us is None)}
    out["ms_per_expert_at_tokens"] = dict(cpu.ms_per_expert_at_tokens)
    return out


def list_profile_names() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.stem for p in profiles_dir().iterdir() if p.suffix in PROFILE_SUFFIXES)


def _close_names(name: str, names: list[str]) -> list[str]:
    """Names the user probably meant: those that extend what was typed (h100), else the closest spelling."""
    name = name.lower()
    return [n for n in names if n.startswith(name)] or difflib.get_close_matches(name, names, n=1, cutoff=0.5)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (``gb200``), or the user's own YAML file by path."""
    path = checked_path(name_or_path, ProfileError, "--gpu")
    if path.suffix not in PROFILE_SUFFIXES:
        path = profiles_dir() / f"{name_or_path.lower()}.yaml"
        if not path.is_file():
            names = list_profile_names()
            guess = f"did you mean {' or '.join(close)}? " if (close := _close_names(name_or_path, names)) else ""
            raise ProfileError(
                f"unknown GPU {name_or_path!r}; {guess}choose one of {', '.join(names)}, "
                "or pass a profile file (--gpu my-gpu.yaml)"
            )
    raw = read_capped(path, MAX_PROFILE_BYTES, ProfileError, "profile")
    data = load_yaml(raw, str(path), ProfileError, fix="fix the file")
    return profile_from_dict(data, str(path))


def with_measured_context(profile: HardwareProfile, context_bytes: int | None,
                          nccl_bytes: int | None = None) -> HardwareProfile:
    """The profile with ``context_bytes`` as its cuda_context_bytes and ``nccl_bytes`` as its nccl_bytes, measured
    on the local stack by make --measure (or recorded by a --measure plan, for check); each unchanged when None."""
    note = "outside torch's allocator on the local stack, measured by make --measure"
    changes = {key: Figure(value=int(value), source="measured", note=note)
               for key, value in (("cuda_context_bytes", context_bytes), ("nccl_bytes", nccl_bytes))
               if value is not None}
    try:
        return replace(profile, **changes) if changes else profile
    except ValueError as error:
        raise ProfileError(f"a measured figure (CUDA context or NCCL): {error}") from None


def profile_to_dict(profile: HardwareProfile) -> dict:
    """The YAML-ready form of a profile (the inverse of profile_from_dict)."""
    out: dict = {"name": profile.name, "description": profile.description}
    for key in _FIGURE_FIELDS:
        figure = getattr(profile, key)
        if figure is not None:
            out[key] = {"value": figure.value, "source": figure.source, "note": figure.note}
    if profile.cpu_experts is not None:
        out["cpu_experts"] = cpu_experts_to_dict(profile.cpu_experts)
    if profile.layer_floor is not None:
        out["layer_floor"] = {key: getattr(profile.layer_floor, key) for key in _FLOOR_KEYS}
    return out
