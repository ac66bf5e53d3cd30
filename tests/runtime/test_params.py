"""runtime.params: a parameter's own bytes and re-pointing it, for plain tensors and for DTensors (one rank's
shard under transformers' tensor parallelism; here a one-rank gloo mesh)."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from runtime.params import is_shard, local_bytes, local_shape, local_tensor, repoint  # noqa: E402


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch without distributed")
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("store") / "store"
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def test_a_plain_param_is_its_data():
    param = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16), requires_grad=False)
    assert not is_shard(param) and local_bytes(param) == 24 and local_shape(param) == (4, 3)
    target = torch.zeros(4, 3, dtype=torch.bfloat16)
    repoint(param, target)
    assert param.data_ptr() == target.data_ptr()


def test_a_dtensor_keeps_its_object_and_placements_and_reads_the_new_shard(mesh):
    from torch.distributed.tensor import DTensor, Shard

    whole = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    param = torch.nn.Parameter(DTensor.from_local(whole.clone(), mesh, [Shard(0)], run_check=False),
                               requires_grad=False)
    assert is_shard(param) and local_bytes(param) == 48 and local_shape(param) == (4, 3)
    target = torch.full((4, 3), 7.0)
    placements = param.placements
    repoint(param, target)
    assert isinstance(param, DTensor) and param.placements == placements
    with torch.no_grad():
        assert param.to_local().data_ptr() == target.data_ptr() and local_tensor(param).data_ptr() == target.data_ptr()
        assert torch.equal((param * 2).to_local(), target * 2)  # DTensor's ops read the new shard
    with pytest.raises(ValueError, match="cannot read"):
        repoint(param, torch.zeros(3, 4))
