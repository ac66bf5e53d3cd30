"""What the command tests of check, diff and export share: a plan made through the CLI, an edit of a file, the tiny
MoE checkpoint's shape, and check's exit codes (tests/conftest.py holds the ``dense`` and ``own_profile``
fixtures)."""

import yaml

from tests.conftest import invoke

MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate": 32}
# Exit codes of check, written out so a change is deliberate.
OK, MODEL, PROFILE, PLAN, INFEASIBLE, STALE = 0, 2, 3, 4, 5, 8


def cli_make(args, output="plan.yaml", model="ckpt") -> dict:
    """Run make on ``model`` with ``args`` through the CLI, writing ``output``; the plan it wrote."""
    result = invoke(["make", "--model", model, *args, "-o", output])
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load(open(output).read())


def replace_once(path, old: str, new: str) -> None:
    """Replace the first ``old`` in the file at ``path`` by ``new``; ``old`` must be there."""
    text = open(path).read()
    assert old in text
    open(path, "w").write(text.replace(old, new, 1))
