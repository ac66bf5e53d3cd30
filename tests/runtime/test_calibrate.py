"""runtime.calibrate: the host-to-device line fit and the efficiency restated for a measured compute rate."""

import pytest


def test_h2d_line_fit_weighs_every_size_alike():
    from runtime.calibrate import _fit_line

    sizes = [2**e for e in range(20, 31)]
    exact = [(b, 0.010 + 1e3 * b / 54.5e9) for b in sizes]
    slope, intercept = _fit_line(exact)
    assert abs(1e3 / slope - 54.5e9) < 1e6 and abs(intercept - 0.010) < 1e-9
    # One slow 1 GiB copy (45 GB/s) must not set the bandwidth for every layer-sized copy.
    skewed = exact[:-1] + [(sizes[-1], 1e3 * sizes[-1] / 45e9)]
    assert 1e3 / _fit_line(skewed)[0] > 50e9


def test_calibrated_efficiency_keeps_the_fitted_layer_time():
    from planner.model.cost import LayerCost, roofline_ms
    from planner.source.profile import load_profile
    from runtime.calibrate import restated_efficiency

    base = load_profile("h100-sxm")
    measured_rate = 779e12
    calibrated = base.__class__(**{**vars(base), "compute_efficiency": restated_efficiency(base, measured_rate),
                                   "bf16_flops_per_s": base.bf16_flops_per_s.__class__(value=measured_rate,
                                                                                       source="measured")})
    flops = 3.5e12
    # equal up to the 4 significant digits the profile keeps
    cost = LayerCost(flops=flops, hbm_bytes=0)
    assert roofline_ms(cost, calibrated) == pytest.approx(roofline_ms(cost, base), rel=1e-4)
