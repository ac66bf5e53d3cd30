"""What each released engine version accepts and wires, as data read from its released source.

Each EngineVersion was read from the wheel on PyPI named in ``wheel`` (``pip download --no-deps``): the flags
``export`` writes, each with the type and range the version's argument parser and config validation accept
(``FlagSpec.source`` names the file), and which model families each offloading mechanism is wired for.
planner.views.export writes only flags listed here, checks every value against its FlagSpec (``check_flags``), and
scripts/engine_check.py runs the engines' own parsers on the same exports.

Facts, per version:

vLLM 0.33.0
- ``vllm/config/offload.py``: ``--offload-group-size`` (int >= 0; > 0 picks the prefetch backend),
  ``--offload-num-in-group`` (int >= 1, at most the group size), ``--offload-prefetch-step`` (int >= 1 once the
  group size is > 0), ``--offload-params SEG ...`` (whole dot-separated segments of the layer's param names);
  ``--cpu-offload-gb`` (float GiB >= 0, the UVA backend).
- ``vllm/model_executor/offloader/prefetch.py``: ``PrefetchOffloader.wrap_modules`` offloads layer i of the
  layers ``make_layers`` (``vllm/model_executor/models/utils.py``) builds when ``i % G >= G - K``, skips a
  layer no param of which matches, and ``_get_next_prefetch_index`` keeps every static-buffer slot's owner when
  P does not divide the offloaded layers (no corruption in this version). Every architecture in
  ``prefetch_architectures`` builds its layers with ``make_layers`` (Qwen3 and Gemma-3 through Qwen2Model and
  Gemma3ForCausalLM).
- MLA attention backends (``vllm/v1/attention/backends/mla/``): FLASH_ATTN_MLA takes multiples of 16,
  FLASHMLA 64 only, FLASHINFER_MLA 32 or 64, CUTLASS_MLA 128; ``platforms/cuda.py`` tries FLASH_ATTN_MLA first on
  Hopper and FLASHINFER_MLA first on Blackwell, and ``--block-size`` set by the user precludes every backend that
  does not take it. 64 is taken by the first choice of both and by FlashMLA; 16 rules FlashInfer-MLA and FlashMLA
  out. Other models keep CacheConfig's default of 16.
- ``vllm/config/lora.py``: ``--max-lora-rank`` one of MaxLoRARanks; ``--max-cpu-loras`` >= ``--max-loras``.

SGLang 0.5.23
- ``sglang/srt/arg_groups/fields/exec_.py`` ``ExecOffload``: ``cpu_offload_gb`` (int GiB), ``offload_group_size``,
  ``offload_num_in_group``, ``offload_prefetch_step``, ``offload_mode`` (str); no parameter selection flag.
- ``sglang/srt/utils/offloader.py``: ``--cpu-offload-gb`` > 0 builds OffloaderV1, which moves the params of the
  layers ``make_layers`` builds into pinned host memory, layer 0 onward, until that many GiB, and copies a layer's
  params to the GPU inside its forward on the compute stream: every offloaded byte is read at use, no prefetch.
  ``--offload-group-size`` > 0 builds OffloaderV2, whose ``wrap_modules`` calls ``submodule_accessor(module)``
  for every layer the rule picks; only ``models/deepseek_v2.py`` passes one (DeepSeek-V2/V3/V3.2, Kimi-K2): it
  moves the MoE layers' ``mlp.experts`` ``w13_weight`` and ``w2_weight`` (FP8 block scales stay on the GPU) and
  nothing of a dense layer, which still takes its place in the prefetch order. Every other model calls
  ``make_layers`` without it, so V2 fails there at start-up. V2 prefetches P positions ahead,
  ``(index + P) % N``, into tensors it allocates at each onload (no static slots, no P-divides-N assertion).
- ``ExecOffload.offload_mode`` values: ``_BaseParamOffloader.create``'s keys (cpu, shm_cpu, sharded_gpu, meta).
- ``sglang/srt/arg_groups/lora_hook.py``: ``--max-loaded-loras`` >= ``--max-loras-per-batch``.
"""

import math
from dataclasses import dataclass

from planner.errors import UsageError

#: the architectures whose model code builds its decoder layers with make_layers in both engines' releases
#: (vLLM: models/{llama,qwen2,qwen3,qwen3_moe,mixtral,gpt_oss,deepseek_v2,gemma3,gemma3_mm}.py;
#: SGLang: models/{llama,qwen2,qwen3,qwen2_moe,qwen3_moe,mixtral,gpt_oss,deepseek_v2,gemma3_causal,gemma3_mm}.py)
MAKE_LAYERS_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                             "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "GptOssForCausalLM",
                             "LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                             "Qwen3MoeForCausalLM")
#: architectures with MLA attention (vLLM's ModelConfig.use_mla for the DeepSeek-V2 family of configs)
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class FlagSpec:
    """One flag a version's argument parser accepts: its value's type and range, and where that is written."""

    flag: str
    #: int, float, str, switch (no value) or list (one or more values)
    kind: str
    #: the smallest value accepted (None: no bound), and whether the bound itself is refused
    minimum: float | None = None
    minimum_exclusive: bool = False
    maximum: float | None = None
    #: the values accepted (empty: any of the kind)
    choices: tuple[str, ...] = ()
    #: the file of the released package that defines the flag and its range
    source: str

    def __post_init__(self):
        if self.kind not in ("int", "float", "str", "switch", "list"):
            raise ValueError(f"FlagSpec.kind {self.kind!r} is not one of int, float, str, switch, list")

    def problem(self, values: list[str]) -> str | None:
        """Why these values are refused, or None."""
        if self.kind == "switch":
            return f"{self.flag} takes no value" if values else None
        if not values:
            return f"{self.flag} needs a value"
        if self.kind != "list" and len(values) != 1:
            return f"{self.flag} takes one value, not {len(values)}"
        return next((p for p in map(self._value_problem, values) if p is not None), None)

    def _value_problem(self, value: str) -> str | None:
        if self.choices and value not in self.choices:
            return f"{self.flag} {value}: not one of {', '.join(self.choices)}"
        if self.kind not in ("int", "float"):
            return None
        try:
            number = int(value) if self.kind == "int" else float(value)
        except ValueError:
            return f"{self.flag} {value}: not an {self.kind}"
        low_ok = self.minimum is None or (number > self.minimum if self.minimum_exclusive else number >= self.minimum)
        high_ok = self.maximum is None or number <= self.maximum
        return None if low_ok and high_ok else f"{self.flag} {value}: out of range"


@dataclass(frozen=True, kw_only=True)
class PrefetchWiring:
    """Which architectures a version's prefetch offloader (--offload-group-size) is wired for, and what it moves."""

    architectures: tuple[str, ...]
    #: architectures whose model code fixes what moves (the selection flag is not used), and what it moves
    fixed_selection: tuple[tuple[str, str], ...] = ()
    #: a rule layer with nothing to move still takes a position in the prefetch order (SGLang's V2)
    empty_layers_take_positions: bool = False
    #: the version has a flag that selects params by segments (vLLM's --offload-params)
    params_flag: str | None = None
    #: the version refuses a prefetch depth P that does not divide the offloaded layers (make --for searches only
    #: depths that do); neither pinned release does
    must_divide: bool = False
    source: str


@dataclass(frozen=True, kw_only=True)
class EngineVersion:
    """One released version of an engine: the flags export writes and what its offloaders are wired for."""

    engine: str
    version: str
    #: the PyPI wheel these facts were read from
    wheel: str
    flags: tuple[FlagSpec, ...]
    prefetch: PrefetchWiring
    #: architectures where the version reads offloaded params at use with no prefetch (--cpu-offload-gb), used
    #: where its prefetch offloader is not wired
    read_at_use_architectures: tuple[str, ...]
    #: the flag of that mechanism and whether it takes whole GiB (SGLang's field is an int)
    read_at_use_flag: str
    read_at_use_whole_gib: bool
    #: KV cache block tokens written with --block-size (None: the engine pages by its own default, no flag), and
    #: the block for MLA architectures
    block_tokens: int | None
    mla_block_tokens: int | None

    def spec(self, flag: str) -> FlagSpec | None:
        """The FlagSpec of ``flag``, None if the version has no such flag."""
        return next((spec for spec in self.flags if spec.flag == flag), None)

    @property
    def label(self) -> str:
        return f"{self.display_name} {self.version}"

    @property
    def display_name(self) -> str:
        return {"vllm": "vLLM", "sglang": "SGLang"}[self.engine]

    def prefetch_wired(self, architecture: str | None) -> bool:
        """The prefetch offloader runs for this architecture."""
        return architecture in self.prefetch.architectures

    def read_at_use_wired(self, architecture: str | None) -> bool:
        return architecture in self.read_at_use_architectures

    def block_tokens_for(self, architecture: str | None) -> int | None:
        return self.mla_block_tokens if architecture in MLA_ARCHITECTURES else self.block_tokens


def _int(flag, source, minimum=None, minimum_exclusive=False):
    return FlagSpec(flag=flag, kind="int", minimum=minimum, minimum_exclusive=minimum_exclusive, source=source)


VLLM_SOURCES = {"offload": "vllm/config/offload.py", "cache": "vllm/config/cache.py",
                "scheduler": "vllm/config/scheduler.py", "model": "vllm/config/model.py",
                "parallel": "vllm/config/parallel.py", "lora": "vllm/config/lora.py",
                "frontend": "vllm/entrypoints/common/cli_args.py"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

VLLM_0_33_0 = EngineVersion(
    engine="vllm", version="0.33.0", wheel="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    flags=(
        _int("--tensor-parallel-size", VLLM_SOURCES["parallel"], 1),
        _int("--offload-group-size", VLLM_SOURCES["offload"], 0),
        _int("--offload-num-in-group", VLLM_SOURCES["offload"], 1),
        _int("--offload-prefetch-step", VLLM_SOURCES["offload"], 1),
        FlagSpec(flag="--offload-params", kind="list", source=VLLM_SOURCES["offload"]),
        FlagSpec(flag="--cpu-offload-gb", kind="float", minimum=0, source=VLLM_SOURCES["offload"]),
        _int("--max-num-seqs", VLLM_SOURCES["scheduler"], 1),
        _int("--max-model-len", VLLM_SOURCES["model"], -1),
        _int("--max-num-batched-tokens", VLLM_SOURCES["scheduler"], 1),
        _int("--block-size", VLLM_SOURCES["cache"], 0, minimum_exclusive=True),
        FlagSpec(flag="--gpu-memory-utilization", kind="float", minimum=0, minimum_exclusive=True, maximum=1,
                 source=VLLM_SOURCES["cache"]),
        FlagSpec(flag="--kv-cache-dtype", kind="str", choices=("auto", "float16", "bfloat16", "fp8", "fp8_e4m3",
                                                              "fp8_e5m2"), source=VLLM_SOURCES["cache"]),
        FlagSpec(flag="--enable-lora", kind="switch", source=VLLM_SOURCES["lora"]),
        _int("--max-loras", VLLM_SOURCES["lora"], 1),
        _int("--max-cpu-loras", VLLM_SOURCES["lora"], 1),
        FlagSpec(flag="--max-lora-rank", kind="int", choices=tuple(map(str, VLLM_LORA_RANKS)),
                 source=VLLM_SOURCES["lora"]),
        FlagSpec(flag="--lora-modules", kind="list", source=VLLM_SOURCES["frontend"]),
    ),
    prefetch=PrefetchWiring(architectures=MAKE_LAYERS_ARCHITECTURES, params_flag="--offload-params",
                            source="vllm/model_executor/offloader/prefetch.py, vllm/model_executor/models/utils.py"),
    read_at_use_architectures=MAKE_LAYERS_ARCHITECTURES, read_at_use_flag="--cpu-offload-gb",
    read_at_use_whole_gib=False, block_tokens=16, mla_block_tokens=64,
)

SGLANG_SOURCES = {name: f"sglang/srt/arg_groups/fields/{file}" for name, file in (
    ("offload", "exec_.py"), ("parallel", "parallel.py"), ("schedule", "schedule.py"), ("model", "model.py"),
    ("lora", "lora.py"))}
#: the architectures of sglang/srt/models/deepseek_v2.py's EntryClass, the one model passing submodule_accessor
SGLANG_V2_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
SGLANG_V2_MOVES = "experts"

SGLANG_0_5_23 = EngineVersion(
    engine="sglang", version="0.5.23", wheel="sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
    flags=(
        _int("--tp-size", SGLANG_SOURCES["parallel"], 1),
        _int("--offload-group-size", SGLANG_SOURCES["offload"]),
        _int("--offload-num-in-group", SGLANG_SOURCES["offload"]),
        _int("--offload-prefetch-step", SGLANG_SOURCES["offload"]),
        FlagSpec(flag="--offload-mode", kind="str", choices=("cpu", "shm_cpu", "sharded_gpu", "meta"),
                 source=SGLANG_SOURCES["offload"] + ", sglang/srt/utils/offloader.py"),
        _int("--cpu-offload-gb", SGLANG_SOURCES["offload"], 0),
        _int("--max-running-requests", SGLANG_SOURCES["schedule"], 1),
        _int("--context-length", SGLANG_SOURCES["model"], 1),
        _int("--chunked-prefill-size", SGLANG_SOURCES["schedule"], 1),
        FlagSpec(flag="--mem-fraction-static", kind="float", minimum=0, minimum_exclusive=True, maximum=1,
                 source=SGLANG_SOURCES["schedule"]),
        FlagSpec(flag="--kv-cache-dtype", kind="str", choices=("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16",
                                                              "bfloat16", "nvfp4", "fp4_mx_block16"),
                 source=SGLANG_SOURCES["model"]),
        FlagSpec(flag="--enable-lora", kind="switch", source=SGLANG_SOURCES["lora"]),
        FlagSpec(flag="--lora-paths", kind="list", source=SGLANG_SOURCES["lora"]),
        _int("--max-loras-per-batch", SGLANG_SOURCES["lora"], 1),
        _int("--max-loaded-loras", SGLANG_SOURCES["lora"], 1),
    ),
    prefetch=PrefetchWiring(architectures=SGLANG_V2_ARCHITECTURES,
                            fixed_selection=tuple((a, SGLANG_V2_MOVES) for a in SGLANG_V2_ARCHITECTURES),
                            empty_layers_take_positions=True,
                            source="sglang/srt/utils/offloader.py, sglang/srt/models/deepseek_v2.py"),
    read_at_use_architectures=MAKE_LAYERS_ARCHITECTURES, read_at_use_flag="--cpu-offload-gb",
    read_at_use_whole_gib=True, block_tokens=None, mla_block_tokens=None,
)

#: every pinned version per engine, oldest first (the default is the newest)
ENGINE_VERSIONS: dict[str, tuple[EngineVersion, ...]] = {"vllm": (VLLM_0_33_0,), "sglang": (SGLANG_0_5_23,)}


def engine_version(engine: str, version: str | None = None) -> EngineVersion:
    """The pinned version of ``engine`` (default: the newest); UsageError naming the pinned ones otherwise."""
    versions = ENGINE_VERSIONS[engine]
    if version is None:
        return versions[-1]
    found = next((v for v in versions if v.version == version), None)
    if found is None:
        raise UsageError(f"--engine-version {version}: offload-plan pins {engine} "
                         f"{', '.join(v.version for v in versions)}; choose one of them")
    return found


def split_flags(flags: tuple[str, ...] | list[str]) -> list[tuple[str, list[str]]]:
    """The flags as (flag, its values): every word up to the next word starting with --."""
    pairs: list[tuple[str, list[str]]] = []
    for word in flags:
        if word.startswith("--"):
            pairs.append((word, []))
        elif pairs:
            pairs[-1][1].append(word)
        else:
            pairs.append(("", [word]))
    return pairs


def flag_problems(flags: tuple[str, ...] | list[str], version: EngineVersion) -> list[str]:
    """Every flag the version does not accept, or whose value it refuses (the static check)."""
    problems = []
    for flag, values in split_flags(flags):
        spec = version.spec(flag)
        if spec is None:
            problems.append(f"{version.label} has no flag {flag or ' '.join(values)!r}")
            continue
        problem = spec.problem(values)
        if problem is not None:
            problems.append(f"{version.label}: {problem}")
    return problems


def whole_gib(num_bytes: int) -> int:
    """Bytes rounded up to whole GiB."""
    return math.ceil(num_bytes / GIB)
