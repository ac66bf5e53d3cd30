"""offload-plan trace's prompt file is opened only if it is a regular file (the routing-trace fuzz family found
a FIFO or /dev/urandom as --prompts blocking trace forever), and the fuzz family's own cases reproduce."""

import os

import pytest

from tests.conftest import assert_one_line_error, run_cli


@pytest.mark.parametrize("kind", ["fifo", "urandom", "folder"])
def test_trace_prompts_that_are_not_a_regular_file_are_one_line(tmp_path, kind):
    prompts = tmp_path / "prompts.txt"
    if kind == "fifo":
        os.mkfifo(prompts)
    elif kind == "urandom":
        prompts.symlink_to("/dev/urandom")
    else:
        prompts.mkdir()
    result = run_cli(["trace", "--model", "x", "--prompts", "prompts.txt", "--device", "cpu"], cwd=tmp_path,
                     timeout=60)
    assert_one_line_error(result.returncode, result.stderr, contains=("prompts.txt", "regular file"))


def test_the_trace_family_makes_valid_traces_the_model_accepts():
    """The family's valid traces are valid (else its mutations would prove nothing): each row sums to
    num_tokens x top_k with no count above num_tokens, over the base MoE model's six layers."""
    import random

    from planner.routing_trace import trace_from_dict
    from tests.fuzz import base
    from tests.fuzz.traces import valid_trace

    data = valid_trace(random.Random(3), base())
    trace = trace_from_dict(data, "fuzz")
    assert [index for index, _ in trace.layers] == list(range(6)) and trace.top_k == 2
