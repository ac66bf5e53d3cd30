"""planner.search.cpu_experts: a routed layer's misses split between the link and the CPU, by properties over a
grid of rates, and the profile's cpu_experts section read strictly."""

import itertools

import pytest

from planner.errors import ProfileError
from planner.search import cpu_experts
from planner.search.cpu_experts import (CPU_WITHIN_LINK_FACTOR, balanced_cpu_experts, cpu_expert_ms, decode_split,
                                        link_expert_ms, max_cpu_tokens_per_expert, prefill_split, split_layer,
                                        tokens_per_touched_expert)
from planner.source.profile import CpuExperts, load_profile, profile_from_dict, profile_to_dict

#: Qwen3-30B-A3B's expert: H 2048, I 768, bf16 (9 MiB)
QWEN_PARAMS = 3 * 2048 * 768
QWEN_BYTES = 2 * QWEN_PARAMS
LINK_BYTES_PER_S = 0.89 * 55e9


def _cpu(ms_at_1: float = 0.2, per_token_ms: float = 0.05, overhead_us: float = 10.0) -> CpuExperts:
    """A CPU whose Qwen3-30B-A3B expert takes ms_at_1 at one token and per_token_ms more per token."""
    table = tuple((t, ms_at_1 + (t - 1) * per_token_ms) for t in (1, 2, 4, 8, 16))
    return CpuExperts(threads=16, dtype="fp32", hidden_size=2048, intermediate_size=768,
                      ms_per_expert_at_tokens=table,
                      weight_bytes_per_s=4 * QWEN_PARAMS / ((ms_at_1 - overhead_us / 1e3) / 1e3),
                      flops_per_s=2 * QWEN_PARAMS / (per_token_ms / 1e3), overhead_us=overhead_us)


def _split(cpu, num_missed, tokens=1.0, handoff_ms=0.05, overlap_ms=0.0):
    return split_layer(num_missed=num_missed, expert_bytes=QWEN_BYTES, expert_params=QWEN_PARAMS,
                       link_bytes_per_s=LINK_BYTES_PER_S, cpu=cpu, tokens_per_expert=tokens, compute_ms=0.3,
                       gpu_overlap_ms=overlap_ms, handoff_ms=handoff_ms)


@pytest.fixture(autouse=True)
def side_by_side(monkeypatch):
    """The split with the CPU path beside the link (the balanced split these tests hold), a pair at the profile's
    lone rate (test_a_pair_in_the_step_is_priced_at_the_lone_rate_times_the_factor); with the host node in Python
    the H100 measured it after the link (test_a_serial_cpu_path_takes_every_miss_or_none)."""
    monkeypatch.setattr(cpu_experts, "CPU_PATH_OVERLAPS_LINK", True)
    monkeypatch.setattr(cpu_experts, "CPU_IN_STEP_FACTOR", 1.0)
    monkeypatch.setattr(cpu_experts, "CPU_IN_STEP_EXTRA_MS", 0.0)


@pytest.mark.parametrize(("ms_at_1", "num_missed", "handoff_ms"), [(0.05, 5.1, 0.05), (0.18, 5.1, 0.05),
                                                                   (0.185, 5.8, 0.35), (0.05, 20.0, 0.35)])
def test_a_serial_cpu_path_takes_every_miss_or_none(ms_at_1, num_missed, handoff_ms):
    serial = split_layer(num_missed=num_missed, expert_bytes=QWEN_BYTES, expert_params=QWEN_PARAMS,
                         link_bytes_per_s=LINK_BYTES_PER_S, cpu=_cpu(ms_at_1), tokens_per_expert=1.0, compute_ms=0.3,
                         handoff_ms=handoff_ms, overlapped=False)
    assert serial.cpu_experts in (0.0, num_missed)
    assert serial.stall_ms <= serial.fetch_only_stall_ms + 1e-12
    cpu_all = handoff_ms + num_missed * serial.cpu_ms_per_expert
    assert (serial.cpu_experts == num_missed) == (cpu_all < serial.fetch_only_stall_ms)
    if serial.cpu_experts:
        assert serial.stall_ms == pytest.approx(cpu_all)  # nothing fetched: the CPU path alone


GRID = list(itertools.product((0.05, 0.1, 0.2, 0.35, 0.6), (0.5, 1.3, 5.1, 20.0), (0.0, 0.05, 0.3)))


@pytest.mark.parametrize(("ms_at_1", "num_missed", "handoff_ms"), GRID)
def test_the_split_is_never_worse_than_fetching_only(ms_at_1, num_missed, handoff_ms):
    split = _split(_cpu(ms_at_1), num_missed, handoff_ms=handoff_ms)
    assert split.stall_ms <= split.fetch_only_stall_ms + 1e-12
    assert split.layer_ms == pytest.approx(0.3 + split.stall_ms)
    assert split.cpu_experts + split.link_experts == pytest.approx(num_missed)
    assert 0 <= split.cpu_share <= 1
    if split.cpu_experts > 0:
        assert split.declined is None and split.stall_ms < split.fetch_only_stall_ms
    else:
        assert split.declined and split.stall_ms == pytest.approx(split.fetch_only_stall_ms)


@pytest.mark.parametrize(("ms_at_1", "num_missed", "handoff_ms"), GRID)
def test_a_taken_split_ends_both_paths_together(ms_at_1, num_missed, handoff_ms):
    split = _split(_cpu(ms_at_1), num_missed, handoff_ms=handoff_ms)
    if 0 < split.cpu_experts < num_missed:  # not clamped: balanced
        assert split.link_ms == pytest.approx(split.cpu_ms, rel=1e-9)
        # moving any share of an expert either way makes the later path later
        for delta in (0.01, -0.01):
            cpu_path = handoff_ms + (split.cpu_experts + delta) * split.cpu_ms_per_expert
            link_path = (split.link_experts - delta) * split.link_ms_per_expert
            assert max(cpu_path, link_path) > split.stall_ms


def test_balanced_split_closed_form():
    # 5 misses, link 0.2 ms and CPU 0.3 ms an expert, 0.1 ms fixed: 0.2 (5 - n) = 0.1 + 0.3 n -> n = 1.8
    assert balanced_cpu_experts(5, 0.2, 0.3, 0.1) == pytest.approx(1.8)
    assert balanced_cpu_experts(0.2, 0.2, 0.3, 0.1) == 0.0  # the fixed cost outlasts every fetch
    assert balanced_cpu_experts(2, 0.2, 0.3, -5.0) == 2  # the GPU's own work hides more than every miss


def test_the_cpu_is_declined_where_slower_than_the_factor_times_the_link():
    """Just within CPU_WITHIN_LINK_FACTOR the CPU still takes a share (the split's optimum); just beyond, none."""
    link_ms = link_expert_ms(QWEN_BYTES, LINK_BYTES_PER_S)
    fast = _cpu(ms_at_1=(CPU_WITHIN_LINK_FACTOR - 0.1) * link_ms)
    slow = _cpu(ms_at_1=(CPU_WITHIN_LINK_FACTOR + 0.1) * link_ms)
    assert _split(fast, 5.1).cpu_experts > 0
    declined = _split(slow, 5.1)
    assert declined.cpu_experts == 0 and declined.stall_ms == declined.fetch_only_stall_ms
    assert f"{CPU_WITHIN_LINK_FACTOR + 0.1:.2f}x the link's" in declined.declined
    assert f"more than {CPU_WITHIN_LINK_FACTOR:g}x" in declined.declined


def test_no_cpu_figures_and_no_misses_are_declined_with_reasons():
    assert "no cpu_experts" in _split(None, 5.1).declined
    assert "misses no expert" in _split(_cpu(), 0.0).declined


def test_a_gpu_overlap_lets_the_cpu_take_more():
    alone, overlapped = _split(_cpu(0.3), 5.1), _split(_cpu(0.3), 5.1, overlap_ms=0.2)
    assert overlapped.cpu_experts > alone.cpu_experts and overlapped.stall_ms < alone.stall_ms


def test_cpu_expert_ms_reads_the_table_and_scales_to_other_shapes():
    cpu = _cpu(ms_at_1=0.2, per_token_ms=0.05, overhead_us=10.0)
    assert cpu_expert_ms(cpu, QWEN_PARAMS, 1) == pytest.approx(0.2)
    assert cpu_expert_ms(cpu, QWEN_PARAMS, 3) == pytest.approx(0.3)  # between 2 and 4
    assert cpu_expert_ms(cpu, QWEN_PARAMS, 0.4) == pytest.approx(0.2)  # under one token: the first row
    assert cpu_expert_ms(cpu, QWEN_PARAMS, 32) == pytest.approx(0.2 + 31 * 0.05)  # the fitted FLOP rate beyond
    # Mixtral's expert (H 4096, I 14336) is 37.3x Qwen3's: the time past the overhead scales with it
    mixtral = 3 * 4096 * 14336
    assert cpu_expert_ms(cpu, mixtral, 1) == pytest.approx(0.01 + 0.19 * mixtral / QWEN_PARAMS)


def test_tokens_per_touched_expert():
    assert tokens_per_touched_expert(1, 8 / 128) == pytest.approx(1.0)
    # 16 sequences, 8 of 128: each touched expert gets 16 x 8/128 / (1 - (15/16)^16) = 1.56
    assert tokens_per_touched_expert(16, 8 / 128) == pytest.approx(1 / (1 - (15 / 16) ** 16))
    assert tokens_per_touched_expert(0, 0.1) == 0.0


def test_decode_split_at_more_sequences_reads_the_cpu_at_more_tokens():
    cpu = _cpu(0.2, per_token_ms=0.05)
    one = decode_split(num_tokens=1, top_k=8, num_experts=128, num_missed=5.1, expert_bytes=QWEN_BYTES,
                       expert_params=QWEN_PARAMS, routed_fetch_bytes_per_s=LINK_BYTES_PER_S, cpu=cpu, compute_ms=0.3)
    many = decode_split(num_tokens=64, top_k=8, num_experts=128, num_missed=50.0, expert_bytes=QWEN_BYTES,
                        expert_params=QWEN_PARAMS, routed_fetch_bytes_per_s=LINK_BYTES_PER_S, cpu=cpu,
                        compute_ms=0.3)
    assert one.tokens_per_expert == pytest.approx(1.0) and many.tokens_per_expert > 4
    assert many.cpu_ms_per_expert > one.cpu_ms_per_expert


def test_prefill_gives_the_cpu_experts_only_where_few_tokens_reach_each():
    cpu = _cpu(0.2, per_token_ms=0.05)
    link_ms = link_expert_ms(QWEN_BYTES, 55e9)
    threshold = max_cpu_tokens_per_expert(cpu, QWEN_PARAMS, link_ms)
    bound_ms = CPU_WITHIN_LINK_FACTOR * link_ms
    assert cpu_expert_ms(cpu, QWEN_PARAMS, threshold) <= bound_ms < cpu_expert_ms(cpu, QWEN_PARAMS, threshold + 1)

    def chunk(num_tokens):
        return prefill_split(num_tokens=num_tokens, top_k=8, num_experts=128, num_non_resident=80,
                             expert_bytes=QWEN_BYTES, expert_params=QWEN_PARAMS, h2d_bytes_per_s=55e9, cpu=cpu,
                             compute_ms=5.0)

    few = 128 * threshold // 8  # a chunk whose experts each get `threshold` tokens
    assert chunk(few).cpu_experts > 0
    assert chunk(few + 64).cpu_experts == 0 and "fetching only" in chunk(few + 64).declined
    assert max_cpu_tokens_per_expert(_cpu(ms_at_1=10.0), QWEN_PARAMS, link_ms) == 0


def test_bad_split_inputs_are_refused():
    with pytest.raises(ValueError):
        _split(_cpu(), -1.0)
    with pytest.raises(ValueError):
        cpu_expert_ms(_cpu(), 0, 1)


# ---- the profile's section ----------------------------------------------------------------------------------------


def _profile_dict(**cpu_keys) -> dict:
    data = profile_to_dict(load_profile("h100-sxm"))
    section = {"threads": 16, "dtype": "fp32", "hidden_size": 2048, "intermediate_size": 768,
               "ms_per_expert_at_tokens": {1: 0.2, 4: 0.35, 16: 0.95}, "weight_bytes_per_s": 1e11,
               "flops_per_s": 1e12, "overhead_us": 10.0, "source": "measured", "note": "test"}
    data["cpu_experts"] = {**section, **cpu_keys}
    return data


def test_profiles_without_cpu_experts_still_read_and_plan_alike():
    profile = load_profile("h100-sxm")
    assert profile.cpu_experts is None and "cpu_experts" not in profile_to_dict(profile)
    with_cpu = profile_from_dict(_profile_dict(), "test.yaml")
    assert with_cpu.figures() == profile.figures()  # plans' hardware section unchanged


def test_the_cpu_section_round_trips():
    profile = profile_from_dict(_profile_dict(), "test.yaml")
    assert profile.cpu_experts.ms_per_expert_at_tokens == ((1, 0.2), (4, 0.35), (16, 0.95))
    assert profile_from_dict(profile_to_dict(profile), "again.yaml") == profile
    assert profile.cpu_experts.handoff_us is None and "handoff_us" not in profile_to_dict(profile)["cpu_experts"]
    measured = profile_from_dict(_profile_dict(handoff_us=42.5), "test.yaml")
    assert measured.cpu_experts.handoff_us == 42.5
    assert profile_from_dict(profile_to_dict(measured), "again.yaml") == measured


@pytest.mark.parametrize(("keys", "named"), [
    ({"threads": 0}, "threads"),
    ({"threads": 16.5}, "threads"),
    ({"dtype": "fp8"}, "dtype"),
    ({"weight_bytes_per_s": 1.0}, "weight_bytes_per_s"),
    ({"flops_per_s": float("nan")}, "flops_per_s"),
    ({"overhead_us": -1}, "overhead_us"),
    ({"handoff_us": -3.0}, "handoff_us"),
    ({"handoff_us": "fast"}, "handoff_us"),
    ({"ms_per_expert_at_tokens": {}}, "ms_per_expert_at_tokens"),
    ({"ms_per_expert_at_tokens": {1: 0.0}}, "ms_per_expert_at_tokens"),
    ({"ms_per_expert_at_tokens": {"one": 0.2}}, "ms_per_expert_at_tokens"),
    ({"ms_per_expert_at_tokens": [0.2, 0.3]}, "ms_per_expert_at_tokens"),
    ({"ms_per_expert_at_tokens": {0: 0.2}}, "ms_per_expert_at_tokens"),
    ({"source": "guessed"}, "source"),
    ({"threads_per_core": 2}, "threads_per_core"),
])
def test_bad_cpu_figures_are_refused_in_one_line(keys, named):
    with pytest.raises(ProfileError) as caught:
        profile_from_dict(_profile_dict(**keys), "bad.yaml")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("bad.yaml: cpu_experts") and named in message


def test_a_cpu_section_missing_a_key_or_not_a_mapping_is_refused():
    data = _profile_dict()
    del data["cpu_experts"]["flops_per_s"]
    with pytest.raises(ProfileError, match="missing key.*flops_per_s"):
        profile_from_dict(data, "bad.yaml")
    data["cpu_experts"] = "fast"
    with pytest.raises(ProfileError, match="must be a mapping"):
        profile_from_dict(data, "bad.yaml")


def test_a_pair_in_the_step_is_priced_at_the_lone_rate_times_the_factor(monkeypatch):
    """Inside the captured step a pair costs CPU_IN_STEP_FACTOR x calibrate's lone expert (the host node in C adds
    no per-pair cost of its own: its fixed part is the handoff); a factor that makes a CPU more than twice the
    link's time for an expert declines it."""
    cpu = _cpu(ms_at_1=0.15)
    lone_ms = cpu_expert_ms(cpu, QWEN_PARAMS, 1.0)
    monkeypatch.undo()
    assert cpu_expert_ms(cpu, QWEN_PARAMS, 1.0) == pytest.approx(cpu_experts.CPU_IN_STEP_FACTOR * lone_ms
                                                                  + cpu_experts.CPU_IN_STEP_EXTRA_MS)
    link_ms = link_expert_ms(QWEN_BYTES, LINK_BYTES_PER_S)
    monkeypatch.setattr(cpu_experts, "CPU_IN_STEP_FACTOR", (CPU_WITHIN_LINK_FACTOR + 1) * link_ms / lone_ms)
    split = _split(cpu, num_missed=4.0)
    assert split.cpu_experts == 0 and f"more than {CPU_WITHIN_LINK_FACTOR:g}x" in split.declined
