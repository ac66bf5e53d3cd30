"""planner.source.profile: GPU profiles read into the figures make plans with."""

import pytest

from tests.conftest import invoke
from tests.helpers import gpu_profile, write_profile


def test_profile_with_float_byte_counts_gives_a_readable_plan(workdir, good_plan):
    data = gpu_profile(gpu_memory_bytes={"value": 1.0e9, "source": "assumed"})
    write_profile(workdir / "float.yaml", data)
    made = invoke(["make", "--model", "ckpt", "--gpu", "float.yaml", "-o", "float-plan.yaml"])
    assert made.exit_code == 0, made.stderr
    shown = invoke(["show", "float-plan.yaml", "--json"])
    assert shown.exit_code == 0, shown.stderr


# ---- layer_floor ---------------------------------------------------------------------------------------------

def test_the_layer_floor_reads_and_round_trips_and_old_profiles_have_none(tmp_path):
    from planner.source.profile import LayerFloor, load_profile, profile_from_dict, profile_to_dict

    assert load_profile("gh200").layer_floor is None
    measured = load_profile("h100-sxm")
    assert isinstance(measured.layer_floor, LayerFloor) and measured.layer_floor.graphed_moe_ms > 0
    again = profile_from_dict(profile_to_dict(measured), "again")
    assert again == measured
    assert "layer_floor" not in measured.figures()  # plans record the estimate's source line, not the section


@pytest.mark.parametrize("floor, words", [
    ({"graphed_dense_ms": 0.1, "graphed_moe_ms": 0.2}, ("layer_floor must be a mapping",)),
    ({"graphed_dense_ms": 0.1, "graphed_moe_ms": 0.2, "eager_moe_ms": 2, "extra": 1}, ("layer_floor must be",)),
    ({"graphed_dense_ms": -1, "graphed_moe_ms": 0.2, "eager_moe_ms": 2}, ("graphed_dense_ms", "from 0 to 100")),
    ({"graphed_dense_ms": 0.1, "graphed_moe_ms": 1e9, "eager_moe_ms": 2}, ("graphed_moe_ms",)),
    ({"graphed_dense_ms": 0.1, "graphed_moe_ms": 0.2, "eager_moe_ms": "fast"}, ("eager_moe_ms",)),
    ("0.1 ms", ("layer_floor must be a mapping",)),
])
def test_a_bad_layer_floor_is_one_line_naming_the_key(floor, words):
    from planner.errors import ProfileError
    from planner.source.profile import load_profile, profile_from_dict, profile_to_dict

    data = {**profile_to_dict(load_profile("h100-sxm")), "layer_floor": floor}
    with pytest.raises(ProfileError) as refused:
        profile_from_dict(data, "mine.yaml")
    message = str(refused.value)
    assert "\n" not in message and all(word in message for word in words)


def test_the_floor_is_added_to_a_graphed_layer_and_bounds_an_eager_moe_layer():
    from planner.source.profile import LayerFloor

    floor = LayerFloor(graphed_dense_ms=0.08, graphed_moe_ms=0.18, eager_moe_ms=2.3)
    assert floor.layer_ms(0.1, moe=False, graphed=True) == pytest.approx(0.18)
    assert floor.layer_ms(0.1, moe=True, graphed=True) == pytest.approx(0.28)
    assert floor.layer_ms(0.6, moe=True, graphed=False) == 2.3
    assert floor.layer_ms(9.0, moe=True, graphed=False) == 9.0
    assert floor.layer_ms(0.6, moe=False, graphed=False) == 0.6  # eager dense: the roofline stands
