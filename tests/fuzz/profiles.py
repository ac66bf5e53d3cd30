"""Fuzz family of hardware profiles: figures, sources, names and YAML structure, read by make."""

import json

import yaml

from tests.fuzz.core import (Base, Case, DEEP_LEVELS, HUGE_INT, JUNK, make_case)


PROFILE_FIGURES = ("gpu_memory_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "fp8_flops_per_s", "h2d_bytes_per_s",
                   "copy_overhead_us", "trigger", "reserve_bytes", "compute_efficiency", "host_memory_bytes",
                   "nccl_bytes")
#: the figures a profile may leave out (or set null)
OPTIONAL_FIGURES = ("fp8_flops_per_s", "host_memory_bytes", "cuda_context_bytes", "nccl_bytes")
#: (lowest, highest) plausible value of each figure; lowest is exclusive where zero makes no sense
PROFILE_RANGES = {"gpu_memory_bytes": (0, 2**50), "hbm_bytes_per_s": (0, 1e16), "bf16_flops_per_s": (0, 1e19),
                  "fp8_flops_per_s": (0, 1e19), "h2d_bytes_per_s": (0, 1e14), "copy_overhead_us": (-1, 1e6),
                  "trigger": (0, 1), "reserve_bytes": (-1, 2**50), "compute_efficiency": (0, 1),
                  "host_memory_bytes": (0, 2**60), "nccl_bytes": (-1, 2**50)}


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


def _layer_floor(rng) -> tuple[object, bool]:
    """A layer_floor section with one thing changed, and whether the reader must refuse it."""
    floor = {"graphed_dense_ms": 0.08, "graphed_moe_ms": 0.18, "eager_moe_ms": 2.3}
    change = rng.choice((*sorted(floor), "extra", "missing", "whole", "valid"))
    if change == "whole":
        section = rng.choice((5, "x", [], None))
        return section, section is not None
    if change == "extra":
        return {**floor, "surprise": 1}, True
    if change == "missing":
        floor.pop(rng.choice(sorted(floor)))
        return floor, True
    if change == "valid":
        return floor, False
    value = rng.choice((*JUNK, 0, 0.5, 100, 101, -1.0, float("nan"), float("inf"), True))
    floor[change] = value
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value == value and 0 <= value <= 100
    return floor, not ok


#: a measured cpu_experts section (planner.source.profile.CpuExperts), which the cpu_handoff kind mutates
CPU_EXPERTS = {"threads": 12, "dtype": "bf16", "hidden_size": 2048, "intermediate_size": 768,
               "ms_per_expert_at_tokens": {1: 0.15, 4: 0.165, 16: 0.48}, "weight_bytes_per_s": 7.1e10,
               "flops_per_s": 5.0e11, "overhead_us": 18.0, "handoff_us": 15.0, "source": "measured",
               "note": "added by the fuzzer"}


def _cpu_handoff(rng) -> tuple[dict, bool]:
    """A cpu_experts section whose measured handoff (handoff_us, optional, 0 to 1e6 us) is changed or left out,
    and whether the reader must refuse it."""
    section = dict(CPU_EXPERTS)
    change = rng.choice(("value", "value", "absent", "null"))
    if change == "absent":
        del section["handoff_us"]
        return section, False
    value = None if change == "null" else rng.choice((*JUNK, 0, 0.0, 14.9, 1e6, 1e6 + 1, -0.5, float("nan"),
                                                      float("inf"), 10**400, True))
    section["handoff_us"] = value
    ok = value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and value == value
                           and 0 <= value <= 1e6)
    return section, not ok


def gen_profiles(rng, base_: Base) -> Case:
    """Mutate a profile (figures, sources, names, YAML structure) and make a plan with it."""
    profile = json.loads(json.dumps(base_.profile))
    kind = rng.choice(("value", "value", "value", "source", "note", "name", "delete", "add", "figure_junk",
                       "layer_floor", "cpu_handoff", "alias_bomb", "deep", "huge_int", "big_file", "duplicate",
                       "not_mapping", "utf8", "alias"))
    invalid, raw = True, None
    if kind == "value":
        key = rng.choice(PROFILE_FIGURES)
        profile.setdefault(key, {"value": 2**40, "source": "assumed", "note": "added by the fuzzer"})
        value = rng.choice((*JUNK, 0, 0.0, 1, 1e9, 1e12, 0.5, 2.0, float("nan"), float("inf"), 10**400,
                            profile[key]["value"] * 2))
        profile[key]["value"] = value
        invalid = _figure_invalid(key, value, profile)
        if value is None and key in OPTIONAL_FIGURES:
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
        invalid = key not in (*OPTIONAL_FIGURES, "description", "cpu_experts", "layer_floor")
    elif kind == "add":
        profile[rng.choice(("surprise", "name\n"))] = 1
        profile[rng.choice((5, 1.5, True, None))] = 1  # YAML keys need not be strings
    elif kind == "layer_floor":
        profile["layer_floor"], invalid = _layer_floor(rng)
    elif kind == "cpu_handoff":
        profile["cpu_experts"], invalid = _cpu_handoff(rng)
    elif kind == "figure_junk":
        key = rng.choice(PROFILE_FIGURES)
        profile[key] = rng.choice((5, "x", [], None, {"value": 1}, {"source": "assumed"}))
        invalid = not (profile[key] is None and key in OPTIONAL_FIGURES)
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
    case = make_case("profiles", kind, invalid, {"gpu.yaml": raw}, rng)
    case.args = [a for a in case.args]  # budget from the base, which the test profile allows
    if rng.random() < 0.3:  # the profile's trigger decides the budget
        at = case.args.index("--budget")
        del case.args[at:at + 2]
    return case
