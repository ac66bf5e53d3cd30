"""Fuzz regressions: each error class exits with its own code (run_case only says "error"), one case per class,
the same inputs as its class's module (tests/contract/test_fuzz_checkpoint.py, test_fuzz_documents.py,
test_fuzz_profile.py, test_fuzz_flags.py)."""

import tempfile
from pathlib import Path

from tests.fuzz import BASE_ARGS, base
from tests.fuzz.core import ALIAS_BOMB, invoke_cli_in
from tests.fuzz.regression import header_edit, make_args, overlap_second_tensor, plan_file, profile_file

MODEL, PROFILE, PLAN, USAGE = 2, 3, 4, 6


def test_exit_codes_match_error_classes():
    """One case per class, exit code checked."""
    cases = {"header-overlap": (make_args(), header_edit(overlap_second_tensor), MODEL),
             "plan-alias-bomb": (["show", "plan.yaml"], plan_file(raw=(ALIAS_BOMB + base().plan_text).encode()), PLAN),
             "profile-zero-fp8": (make_args(), profile_file(lambda p: p["fp8_flops_per_s"].update(value=0)), PROFILE),
             "prefetch-step-zero": ([*BASE_ARGS, "--prefetch-step", "0"], {}, USAGE)}
    for name, (args, files, exit_code) in cases.items():
        with tempfile.TemporaryDirectory() as folder:
            code, _, stderr, exception = invoke_cli_in(Path(folder), base().files() | files, args)
        assert exception is None and code == exit_code, (name, code, stderr)
