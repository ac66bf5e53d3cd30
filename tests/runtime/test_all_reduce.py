"""runtime.all_reduce: the tensor-parallel link measured where the GPUs allow it, assumed (with why) where not."""

import pytest

from planner.source.profile import load_profile

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_a_link_not_measurable_here_is_assumed_with_why():
    from runtime.all_reduce import measured_link

    other = measured_link(2, load_profile("gb200"), "h100-sxm")
    assert other.measured == "" and "the GPUs here are h100-sxm, the plan is for gb200" in other.assumed_why
    if torch.cuda.device_count() < 2:
        few = measured_link(2, load_profile("h100-sxm"), "h100-sxm")
        assert few.measured == "" and "fewer than the 2 ranks" in few.assumed_why
        assert few.bytes_per_s == load_profile("h100-sxm").gpu_link_bytes_per_s.value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_all_reduce_between_two_gpus_is_measured(tmp_path, monkeypatch):
    from runtime.all_reduce import measured_link
    from runtime.measure import local_profile_name

    monkeypatch.setenv("OFFLOAD_PLAN_CACHE", str(tmp_path))
    link = measured_link(2, load_profile(local_profile_name()), None)
    assert link.measured.startswith("measured: NCCL all-reduce on 2 x")
    assert 1 <= link.latency_us <= 500 and 10e9 <= link.bytes_per_s <= 2e12, link
    # NCCL's buffers measured beside the timings (about 0.8 GiB a rank on two H200s) and stated in the source
    assert 64 * 2**20 <= link.nccl_bytes <= 4 * 2**30 and "NCCL held" in link.measured, link


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_calibrate_measures_nccl_buffers_where_two_gpus_are_visible():
    from runtime.calibrate import nccl_figure

    figure = nccl_figure("test")
    assert figure.source == "measured" and 64 * 2**20 <= figure.value <= 4 * 2**30, figure
    assert f"{torch.cuda.device_count()}-GPU NCCL group" in figure.note
