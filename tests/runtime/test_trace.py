"""Recording routing traces (runtime.trace, ``offload-plan trace``): the counts are the routers' own choices, the
command records a tiny Qwen3-MoE on the CPU, and its bad inputs are one line; the prompt file is opened only if
it is a regular file (the routing-trace fuzz family found a FIFO or /dev/urandom as --prompts blocking trace
forever), and the fuzz family's own cases reproduce."""

import os

import pytest

from planner.source.checkpoint import load_checkpoint
from planner.model.experts import moe_geometry
from planner.model.layout import build_layout
from planner.source.routing_trace import check_against, read_trace
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

    from planner.source.routing_trace import trace_from_dict
    from tests.fuzz import base
    from tests.fuzz.traces import valid_trace

    data = valid_trace(random.Random(3), base())
    trace = trace_from_dict(data, "fuzz")
    assert [index for index, _ in trace.layers] == list(range(6)) and trace.top_k == 2


def test_trace_command_records_a_tiny_qwen3_moe_on_the_cpu(tmp_path):
    from tests.runtime_models import save_tiny_moe, save_word_tokenizer

    folder = save_tiny_moe(tmp_path / "tiny", num_layers=3)
    save_word_tokenizer(folder)
    (tmp_path / "prompts.txt").write_text("w1 w2 w3 w4 w5\n\nw9 w8 w7\n")
    result = run_cli(["trace", "--model", "tiny", "--prompts", "prompts.txt", "--device", "cpu", "-o", "trace.yaml"],
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    trace = read_trace(tmp_path / "trace.yaml")
    assert (trace.num_experts, trace.top_k, trace.num_tokens) == (4, 2, 8)
    assert [index for index, _ in trace.layers] == [0, 1, 2]
    assert all(sum(counts) == 16 for _, counts in trace.layers)
    checkpoint = load_checkpoint(str(folder))
    assert trace.model_fingerprint == checkpoint.fingerprint()
    geometry = moe_geometry(checkpoint.config, build_layout(checkpoint, None))
    check_against(trace, geometry, checkpoint.fingerprint(), "trace.yaml")
    again = run_cli(["trace", "--model", "tiny", "--prompts", "prompts.txt", "--device", "cpu"], cwd=tmp_path,
                    timeout=300)
    assert again.stdout.split("\n", 2)[2] == (tmp_path / "trace.yaml").read_text().split("\n", 2)[2]


def _tiny_routed_model():
    """A two-layer Qwen3-MoE, 4 experts, top-2, random weights (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_trace_counts_match_the_routers_own_choice():
    import torch

    from runtime.trace import count_routing

    model = _tiny_routed_model()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    expected = {}

    def gate_hook(index):
        def record(_module, _args, output):
            _, _, chosen = output  # Qwen3-MoE's router: (logits, scores, indices)
            expected[index] = tuple(torch.bincount(chosen.flatten(), minlength=4).tolist())
        return record

    handles = [layer.mlp.gate.register_forward_hook(gate_hook(i)) for i, layer in enumerate(model.model.layers)]
    num_tokens, counts = count_routing(model, [ids], "model.layers", 4)
    for handle in handles:
        handle.remove()
    assert num_tokens == 6
    assert counts == expected and all(sum(c) == 12 for c in counts.values())


def test_decode_trace_counts_only_the_generated_tokens_routing():
    import torch

    from runtime.trace import count_routing

    model = _tiny_routed_model()
    prompts = [torch.tensor([[1, 5, 9, 13, 17, 21]]), torch.tensor([[2, 4, 8]])]
    seen = {0: [], 1: []}

    def gate_hook(index):
        def record(_module, args, output):
            seen[index].append((args[0].shape[0], output[2]))  # (tokens in the call, the router's choice)
        return record

    handles = [layer.mlp.gate.register_forward_hook(gate_hook(i)) for i, layer in enumerate(model.model.layers)]
    num_tokens, counts = count_routing(model, prompts, "model.layers", 4, decode_tokens=5)
    for handle in handles:
        handle.remove()
    assert num_tokens == 2 * 5  # the prompts' 9 tokens are not counted
    for index, calls in seen.items():
        # per prompt: its prefill (all its tokens at once), then 5 one-token decode steps
        assert [tokens for tokens, _ in calls] == [6, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1]
        decode_choice = torch.cat([chosen for tokens, chosen in calls if tokens == 1])
        assert counts[index] == tuple(torch.bincount(decode_choice.flatten(), minlength=4).tolist())


def test_trace_decode_tokens_out_of_range_is_one_line(tmp_path):
    (tmp_path / "prompts.txt").write_text("hello\n")
    result = run_cli(["trace", "--model", "x", "--prompts", "prompts.txt", "--decode-tokens", "-3"], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, contains=("--decode-tokens",))


def test_trace_without_prompts_is_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    result = run_cli(["trace", "--model", "x", "--prompts", "empty.txt"], cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr, contains=("no prompt",))
