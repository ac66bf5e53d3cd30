"""runtime.tensor_parallel: a TP rank's plan applied to transformers' own sharded model, on two gloo ranks on
the CPU (the CPU stand-in's copies, at once and as late as CUDA allows). The offloaded rank's logits equal the
untouched TP model's bit for bit, which holds only if every collective transformers' TP forwards run still runs
(an experts module all-reduces its output only while its params are sharded DTensors), decode steps included,
and the rank's weights
in the arena are the plan's bytes plus what transformers holds beyond vLLM's split. The launch checks are one
line each. With two GPUs the same ranks run on NCCL, decode steps replayed from CUDA graphs with the all-reduces
captured inside (``torchrun --nproc-per-node 2 -m offload_plan run PLAN --bench`` loads this way;
scripts/bench_tp_offload.py times it)."""

import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch without distributed", allow_module_level=True)

from planner.errors import UsageError  # noqa: E402
from planner.make.make_plan import make_plan  # noqa: E402
from planner.plan.schema import Inputs  # noqa: E402
from planner.plan.file import read_plan, render_plan, write_atomic  # noqa: E402
from runtime.tensor_parallel import Rank, check_launch, check_rank_plan, launched_rank  # noqa: E402
from scripts.bench_tp import save_random_model  # noqa: E402
from scripts.bench_tp_offload import tiny_config  # noqa: E402

BUDGET = "12MiB"
PROMPT_TOKENS = 16


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def rank_plan(request, tmp_path_factory):
    """(checkpoint folder, the path of its make --tp 2 plan offloading some layers)."""
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    save_random_model(tiny_config(request.param), folder, "cpu")
    inputs = Inputs(model=str(folder), gpu="h100-sxm", budget=BUDGET, tokens=PROMPT_TOKENS, sequences=1, context=0,
                    tp=2)
    planned = make_plan(inputs)
    assert planned.plan.offload.layers, "the budget must offload some layers for the test to mean anything"
    path = folder / "plan.tp2.yaml"
    write_atomic(path, render_plan(planned.plan, "make --tp 2 (tests/runtime/test_tensor_parallel.py)"))
    return folder, path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: the decode check: a 32-token prompt for 2 sequences, then decode steps (graphed on the GPUs)
DECODE = {"tokens": 2, "sequences": 2, "context": 64, "cuda_graph": True}
PREFILL = {"tokens": PROMPT_TOKENS, "sequences": 1, "context": 0, "cuda_graph": False}


def _rank_main(local_rank: int, device_type: str, folder, plan_path, port: int, out, lazy_copies: bool) -> None:
    """One rank: transformers' TP model untouched and with the rank's plan applied, the same prefill step and
    decode steps through both; its figures saved to ``out``/rank<N>.pt for the parent to check."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(local_rank))
    torch.set_num_threads(1)
    from runtime.backend import CpuStandIn
    from runtime.load_source import open_source
    from runtime.params import is_shard
    from runtime.tensor_parallel import engine_bytes, held_beyond_plan_bytes, load_rank_with_plan, load_tp_model
    from runtime.tensor_parallel import start_rank
    from scripts.bench_tp_offload import step_logits

    device = start_rank(launched_rank(), device_type)
    plan = read_plan(plan_path)
    reference = load_tp_model(folder, device)
    expected = [step_logits(reference, workload, device) for workload in (PREFILL, DECODE)]
    num_shards = sum(is_shard(p) for p in reference.parameters())
    del reference
    backend = CpuStandIn(lazy_copies=lazy_copies) if device_type == "cpu" else None
    loaded = load_rank_with_plan(plan, open_source(plan, str(folder)), device, backend)
    got = [step_logits(loaded.model, PREFILL, device), step_logits(loaded.model, PREFILL, device)]
    got.append(step_logits(loaded.model, DECODE, device, loaded.engine))
    wanted = [expected[0], expected[0], expected[1]]
    torch.save({"equal": [len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                          for a, b in zip(got, wanted)],
                "shards": (num_shards, sum(is_shard(p) for p in loaded.model.parameters())),
                "arena_bytes": engine_bytes(loaded.engine), "weights_gpu_bytes": loaded.weights_gpu_bytes,
                "moved_bytes": sum(item.num_bytes for layout in loaded.engine.layouts for item in layout),
                "beyond_plan_bytes": held_beyond_plan_bytes(loaded.model, 2)}, out / f"rank{local_rank}.pt")
    loaded.engine.close()
    dist.destroy_process_group()


def _check_ranks(device_type: str, folder, plan_path, out, lazy_copies: bool = False) -> None:
    torch.multiprocessing.spawn(_rank_main, args=(device_type, folder, plan_path, _free_port(), out, lazy_copies),
                                nprocs=2, join=True)
    plan = read_plan(plan_path)
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        assert got["equal"] == [True, True, True], f"rank {rank}: prefill, prefill again, decode"
        before, after = got["shards"]
        assert before > 0 and after == before, "every sharded param must stay a DTensor"
        assert got["moved_bytes"] == sum(plan.layers[i].offloaded_bytes for i in plan.offload.layers)
        # the arena holds the plan's resident bytes and slots, plus what transformers keeps beyond vLLM's split
        planned = plan.memory.gpu_bytes - plan.memory.allocation_slack_bytes
        assert got["arena_bytes"] - got["beyond_plan_bytes"] == pytest.approx(planned, abs=64 * 1024)
        if device_type == "cuda":  # what the GPU holds after loading: the arena, nothing of transformers' load
            assert got["weights_gpu_bytes"] == pytest.approx(got["arena_bytes"], abs=2 << 20)


@pytest.mark.parametrize("lazy_copies", [False, True], ids=["copies-at-once", "copies-late"])
def test_a_rank_plan_on_transformers_shards_equals_the_tp_model_bit_for_bit(rank_plan, lazy_copies, tmp_path):
    _check_ranks("cpu", *rank_plan, tmp_path, lazy_copies)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_rank_plan_on_two_gpus_equals_the_tp_model_bit_for_bit_graphed(rank_plan, tmp_path):
    _check_ranks("cuda", *rank_plan, tmp_path)


def _plan(tp: int):
    from types import SimpleNamespace

    return SimpleNamespace(inputs=SimpleNamespace(tp=tp))


def test_launch_checks_are_one_line_and_say_how_to_launch():
    assert launched_rank({}) is None and launched_rank({"WORLD_SIZE": "1"}) is None
    assert launched_rank({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == Rank(1, 2, 1)
    assert check_launch(_plan(1), "p.yaml", {}) is None
    assert check_launch(_plan(2), "p.yaml", {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}) == Rank(0, 2, 0)
    with pytest.raises(UsageError, match="torchrun --nproc-per-node 4 -m offload_plan run p.yaml --bench"):
        check_launch(_plan(4), "p.yaml", {})
    with pytest.raises(UsageError, match="one rank of TP=2 .* 4 process"):
        check_launch(_plan(2), "p.yaml", {"WORLD_SIZE": "4", "RANK": "0"})
    with pytest.raises(UsageError, match="one-GPU plan but torchrun started 2"):
        check_launch(_plan(1), "p.yaml", {"WORLD_SIZE": "2", "RANK": "0"})


def test_a_rank_plan_with_routed_experts_or_adapters_is_refused_in_one_line():
    from types import SimpleNamespace

    routed = SimpleNamespace(experts=SimpleNamespace(layers=[SimpleNamespace(regime="routed")]), adapters=None)
    with pytest.raises(UsageError, match="routed experts under --tp") as caught:
        check_rank_plan(routed)
    assert "\n" not in str(caught.value) and "--experts" not in str(caught.value)
    with pytest.raises(UsageError, match="adapters"):
        check_rank_plan(SimpleNamespace(experts=None, adapters=SimpleNamespace(items=())))
    check_rank_plan(SimpleNamespace(experts=SimpleNamespace(layers=[SimpleNamespace(regime="whole_layer")]),
                                    adapters=None))
