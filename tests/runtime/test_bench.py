"""runtime.bench: the decode bench's flags checked against the plan."""

import pytest

from tests.runtime_models import plan_with


def test_graph_and_compile_flags_need_a_decode_plan(llama):
    from planner.errors import UsageError
    from runtime.bench import check_decode_flags

    prefill = plan_with(llama, 3, 2, 1)
    for graphed, backend, flag in ((True, None, "--cuda-graph"), (False, "inductor", "--compile")):
        with pytest.raises(UsageError, match=f"{flag} applies to decode steps"):
            check_decode_flags(prefill, graphed, backend)
    check_decode_flags(plan_with(llama, 3, 2, 1, tokens=2, sequences=2, context=8), True, "inductor")
