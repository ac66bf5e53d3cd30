"""Write every plan under plans/ from the header-only checkpoints of scripts/real_checkpoints.py.

Each entry is one ``offload-plan make`` run from the repository root, so each plan's header holds the command
that regenerates it and ``offload-plan check plans/*.yaml`` can reproduce it. plans/README.md says why each
model, GPU and budget was chosen, and which combinations have no plan.

    PYTHONPATH=. python3 scripts/make_plans.py   # checkpoints, then every plan
    offload-plan check --update plans/*.yaml     # later: refresh the existing plans after a planner change
"""

import argparse
import subprocess
import sys

from scripts.real_checkpoints import REPO_ROOT, write_checkpoint

#: (model under plans/models, GPU profile, --budget, --params segments)
PLANS = (
    ("qwen3-8b", "h100-sxm", "40GiB", ()),
    ("qwen3-32b", "h100-sxm", "40GiB", ()),
    ("qwen3-32b", "gh200", "48GiB", ()),
    ("qwen3-32b", "gb200", "120GiB", ()),
    ("llama-3.1-70b", "h100-sxm", "40GiB", ()),
    ("llama-3.1-70b", "gh200", "64GiB", ()),
    ("llama-3.1-70b", "gb200", "96GiB", ()),
    ("mixtral-8x7b", "h100-sxm", "40GiB", ("experts",)),
    ("mixtral-8x7b", "h100-sxm", "60GiB", ("experts",)),
    ("mixtral-8x7b", "gh200", "64GiB", ("experts",)),
    ("mixtral-8x7b", "gb200", "120GiB", ("experts",)),
    ("gpt-oss-120b", "h100-sxm", "48GiB", ("experts",)),
    ("gpt-oss-120b", "gh200", "72GiB", ("experts",)),
    ("deepseek-v3", "h100-sxm", "64GiB", ("experts",)),
    ("kimi-k2", "h100-sxm", "64GiB", ("experts",)),
)


#: serving plans (make --concurrency auto --cuda-graph): (model, GPU profile, --context, --params segments)
SERVING_PLANS = (
    ("qwen3-32b", "gh200", 8192, ()),
    ("llama-3.1-70b", "h100-sxm", 8192, ()),
    ("gpt-oss-120b", "gh200", 16384, ("experts",)),
)


def serving_plan_path(model: str, gpu: str, context: int) -> str:
    """plans/MODEL-GPU-serve-CONTEXT.yaml, relative to the repository root."""
    return f"plans/{model}-{gpu}-serve-{context}.yaml"


def serving_command(model: str, gpu: str, context: int, params: tuple[str, ...]) -> list[str]:
    """The make invocation for one serving entry: the concurrency searched, decode replayed from CUDA graphs."""
    words = ["make", "--model", f".cache/checkpoints/{model}", "--gpu", gpu, "--context", str(context),
             "--concurrency", "auto", "--cuda-graph"]
    for segment in params:
        words += ["--params", segment]
    return words + ["-o", serving_plan_path(model, gpu, context)]


def plan_path(model: str, gpu: str, budget: str) -> str:
    """plans/MODEL-GPU-BUDGET.yaml, relative to the repository root."""
    return f"plans/{model}-{gpu}-{budget.lower()}.yaml"


def make_command(model: str, gpu: str, budget: str, params: tuple[str, ...]) -> list[str]:
    """The make invocation for one entry (the checkpoint path relative to the repository root)."""
    words = ["make", "--model", f".cache/checkpoints/{model}", "--gpu", gpu, "--budget", budget]
    for segment in params:
        words += ["--params", segment]
    return words + ["-o", plan_path(model, gpu, budget)]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            epilog="Takes no arguments: it writes every plan PLANS and SERVING_PLANS list").parse_args()
    for model in sorted({entry[0] for entry in PLANS + SERVING_PLANS}):
        write_checkpoint(model)
    commands = [make_command(*entry) for entry in PLANS] + [serving_command(*entry) for entry in SERVING_PLANS]
    for command in commands:
        subprocess.run([sys.executable, "-m", "offload_plan", *command], cwd=REPO_ROOT, check=True)


if __name__ == "__main__":
    main()
