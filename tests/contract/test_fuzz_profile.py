"""Fuzz regressions, class: a GPU profile's figure out of range (zero, beyond any GPU, a denormal rate that the
cost model and the search would divide by) or a field of the wrong type.
"""

import pytest

from tests.fuzz import BASE_ARGS
from tests.fuzz.regression import Refusal, assert_refused, make_args, profile_file, profile_value

SERVING = ("--context", "64", "--concurrency", "8")

# name -> the refusal
CASES = {
    # issue 16: tracebacks in profile_from_dict, _figure, __post_init__, roofline_ms
    "profile-int-beyond-float": Refusal(make_args(), profile_file(lambda p: p["hbm_bytes_per_s"].update(value=10**29)),
                                        "beyond any GPU"),
    "profile-zero-fp8": Refusal(make_args(), profile_file(lambda p: p["fp8_flops_per_s"].update(value=0)),
                                "fp8_flops_per_s must be positive"),
    "profile-name-list": Refusal(make_args(), profile_file(lambda p: p.update(name=[])), "name must be"),
    # issue 25: extreme finite rates, which cost, search and its overflow guard divided by
    "rate-denormal": Refusal(make_args(), profile_value("h2d_bytes_per_s", 5e-324), "below any GPU"),
    "rate-1e-300": Refusal(make_args(), profile_value("hbm_bytes_per_s", 1e-300), "below any GPU"),
    "flops-1e-300-serving": Refusal([*BASE_ARGS, *SERVING], profile_value("bf16_flops_per_s", 1e-300),
                                    "below any GPU"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_profile_refused(name):
    assert_refused(name, CASES[name])
