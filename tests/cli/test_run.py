"""``run --prompt`` follows the plan's ``workload.cuda_graph`` unless ``--cuda-graph``/``--eager`` overrides it
(issue 26: a plan made graphed ran eager, at 0.49 of its floor on the H100, where graphed ran at 1.0).

CPU only: the GPU-bound calls are replaced by recorders, so what is checked is the choice handed to the runtime;
the graphed path itself is tested on the GPU (tests/runtime/test_engine_gpu.py).
"""

from types import SimpleNamespace

import pytest

from tests.conftest import invoke, run_cli
from tests.runtime_models import save_tiny_llama

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """An eager and a graphed decode plan of one tiny Llama, side by side with it."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("llama"))
    workload = ["--tokens", "8", "--sequences", "8", "--context", "64", "--budget", "1MB"]
    for name, extra in (("eager.yaml", []), ("graphed.yaml", ["--cuda-graph"])):
        made = run_cli(["make", "-m", folder, "-g", "h100-sxm", *workload, *extra, "-o", name], cwd=folder)
        assert made.returncode == 0, made.stderr
    return folder


@pytest.fixture
def handed(monkeypatch):
    """The cuda_graph value ``run --prompt`` hands the runtime's generate, with the GPU calls stubbed out."""
    import runtime.run

    calls = []
    monkeypatch.setattr(runtime.run, "require_cuda", lambda what: None)
    monkeypatch.setattr(runtime.run, "check_stack_fits", lambda plan, device, **_: 0)
    monkeypatch.setattr(runtime.run, "cap_gpu_memory", lambda limit_bytes, device, booked_outside_bytes: None)
    monkeypatch.setattr(runtime.run, "load_with_plan", lambda plan, progress, source: SimpleNamespace(source=source))

    def generate(loaded, prompt, model_path, max_new_tokens, cuda_graph, compile_backend, adapter, plan_path):
        calls.append(cuda_graph)
        return "text", 0.578

    monkeypatch.setattr(runtime.run, "generate", generate)
    return calls


@pytest.mark.parametrize("plan, flags, graphed", [
    ("eager.yaml", [], False),
    ("graphed.yaml", [], True),
    ("graphed.yaml", ["--eager"], False),
    ("eager.yaml", ["--cuda-graph"], True),
])
def test_prompt_follows_the_plan_unless_a_flag_overrides(plans, handed, monkeypatch, plan, flags, graphed):
    monkeypatch.chdir(plans)
    result = invoke(["run", plan, "--prompt", "hello", *flags])
    assert result.exit_code == 0, result.stderr
    assert handed == [graphed]
    mode = "CUDA graph replays" if graphed else "eager steps"
    assert f"0.578 tokens/s with the plan applied ({mode})" in result.stderr
    assert result.stdout == "text\n"


def test_graphed_steps_resolves_the_tri_state():
    from offload_plan.commands.run import graphed_steps

    for made in (True, False):
        plan = SimpleNamespace(workload=SimpleNamespace(cuda_graph=made))
        assert graphed_steps(None, plan) is made
        assert graphed_steps(True, plan) is True and graphed_steps(False, plan) is False
