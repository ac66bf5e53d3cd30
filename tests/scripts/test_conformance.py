"""scripts/conformance.py on the CPU: the arm list, the checkpoints' release format, make and the plan readers of
a few arms at tiny widths (run skipped: it needs the GPU), and the verdicts on made-up run figures."""

import json

import pytest

from scripts import conformance


def test_list_covers_the_issue_targets(capsys):
    """At least 60 arms over at least 10 architectures, 4 of them MoE; every mode and both caps; each model's
    serving arms at concurrency 1 with --measure first."""
    assert conformance.main(["--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = lines[:-1]
    assert lines[-1].startswith(f"{len(names)} arms over {len(conformance.MODELS)} models; about ")
    assert len(names) >= 60
    assert len(conformance.MODELS) >= 10 and sum(model.moe for model in conformance.MODELS.values()) >= 4
    modes = {name.split("/")[1] for name in names}
    assert modes == set(conformance.MODE_NAMES)
    assert {name.split("/")[2] for name in names} == {"loose", "tight"}
    assert {name for name in names if name.endswith("whole-layer")} and any("/measure" in n for n in names)
    for model in conformance.MODELS:
        own = [name for name in names if name.startswith(model + "/")]
        assert own[0] == f"{model}/serving-1/loose/measure"
    for model in (model for model in conformance.MODELS.values() if model.moe):  # routed and whole layers
        assert {f"{model.name}/{arm}" for arm in ("serving-1/tight/measure", "serving-1/tight/measure/whole-layer",
                                                   "serving-4/tight/estimate", "decode-1/tight/estimate")} < set(names)
    everything = [arm.name for model in conformance.MODELS.values() for arm in conformance.arms_for(model, None,
                                                                                                    True)]
    assert set(names) < set(everything) and len(set(everything)) == len(everything)


def test_filters_and_unknown_names(capsys):
    assert conformance.main(["--list", "--models", "mixtral,phi3", "--modes", "decode,serving-4"]) == 0
    names = capsys.readouterr().out.strip().splitlines()[:-1]
    assert names and {n.split("/")[0] for n in names} == {"mixtral", "phi3"}
    assert {n.split("/")[1] for n in names} <= {"decode", "serving-4"}
    with pytest.raises(SystemExit, match="unknown model or mode no-such"):
        conformance.main(["--list", "--models", "no-such"])


def test_models_left_without_arms_are_not_built(capsys):
    """Adapters arms are for dense models: a MoE model the mode filter leaves no arm is neither listed nor counted
    in the device-time estimate (it would otherwise write its checkpoint for nothing)."""
    assert conformance.main(["--list", "--models", "mixtral,phi3", "--modes", "adapters", "--all-arms"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert {n.split("/")[0] for n in lines[:-1]} == {"phi3"}
    assert "over 1 models" in lines[-1] and "mixtral" not in lines[-1]


def test_tiny_sweep_makes_and_reads_plans_on_the_cpu(tmp_path):
    """Two MoE models, one in planner.source.release_format's layout (Mixtral's w1/w2/w3), one through transformers'
    save_pretrained (OLMoE): per-expert tensors, a tokenizer; every command of every arm exits 0 or its row
    holds a one-line error; rows.jsonl and table.md are written."""
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    args = ["--tiny", "--no-run", "--out", str(out), "--checkpoints", str(checkpoints), "--models", "mixtral,olmoe",
            "--modes", "serving-4,decode", "--all-arms"]
    assert conformance.main(args) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    facts = {row["model"]: row for row in rows if row["kind"] == "checkpoint"}
    assert facts["mixtral"]["expert_tensor_names"] == [
        f"model.layers.N.block_sparse_moe.experts.N.{w}.weight" for w in ("w1", "w2", "w3")]
    assert facts["olmoe"]["expert_tensor_names"] == [
        f"model.layers.N.mlp.experts.N.{p}_proj.weight" for p in ("down", "gate", "up")]
    assert (checkpoints / "olmoe-tiny" / "tokenizer.json").is_file()
    arms = [row for row in rows if row["kind"] == "arm"]
    # serving-4 and decode, estimated and --measure, and (MoE) decode whole-layer, each at 2 caps
    assert len(arms) == 2 * 10
    for row in arms:
        failed = {name for name, code in row["exit"].items() if code != 0}
        assert failed <= set(row["errors"]) and set(row["errors"]) - failed <= {"diff"}  # diff: skipped
        assert all("\n" not in error and error for error in row["errors"].values())
    assert {row["errors"]["make"].split(":")[1] for row in arms if row["measure"]} == {" error"}  # no CUDA here
    mixtral = [row for row in arms if row["model"] == "mixtral" and not row["measure"]]
    assert all(row["verdicts"]["exit_ok"] for row in mixtral), [row["errors"] for row in mixtral]
    assert {row["plan"]["regime"] for row in mixtral if row["experts"] == "whole-layer"} == {"whole_layer"}
    assert all(set(row["exit"]) == {"make", "show", "export_vllm", "export_sglang", "check", "diff"}
               for row in mixtral)
    assert "| mixtral/decode/tight/estimate | make:0 " in (out / "table.md").read_text()
    assert conformance.main(args + ["--models", "mixtral", "--modes", "prefill"]) == 0  # folders reused
    again = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()][len(rows):]
    assert again[0]["kind"] == "checkpoint" and again[0]["write_s"] < 1


def _fake_plan(num_experts: int, resident: int | None, offloaded: int = 0):
    """What moe_tight_cap reads of a plan: routed layers keeping ``resident`` experts (None: no layer routed)."""
    from types import SimpleNamespace

    layers = [SimpleNamespace(routed=resident is not None, resident=tuple(range(resident or 0)))] * 3
    return SimpleNamespace(experts=SimpleNamespace(regime="whole_layer" if resident is None else "routed",
                                                   num_experts=num_experts, layers=layers),
                           offload=SimpleNamespace(layers=[0] * offloaded))


def test_moe_tight_cap_takes_the_routed_cap_nearest_the_target_where_whole_layers_fit():
    """Routed below 80 of 100 units, all resident above; resident experts grow with the cap; whole layers fit from 60
    units: the cap is the one nearest 45% on the host of those where whole layers fit (a routed cap nearer the target
    below 60 is passed over), and a model routed at no cap gets none."""
    def plan(cap_bytes, **whole_layer):
        if whole_layer:
            if cap_bytes < 60:
                raise ValueError("below the leanest whole-layer placement")
            return _fake_plan(64, None, offloaded=2)
        if cap_bytes < 30:
            raise ValueError("does not fit")
        return _fake_plan(64, None if cap_bytes >= 80 else round(64 * (cap_bytes - 30) / 50))

    chosen = conformance.moe_tight_cap(plan, 100, whole_layer={"prefetch_step": 1})
    assert chosen["regime"] == "routed" and chosen["whole_layer_offloaded"] == 2 and chosen["cap_bytes"] >= 60
    assert conformance.ROUTED_SHARE_BAND[0] <= chosen["host_share"][0] <= chosen["host_share"][1] <= 0.6
    assert conformance.moe_tight_cap(plan, 100)["cap_bytes"] < 60  # without the whole-layer condition: nearer 45%
    assert conformance.moe_tight_cap(lambda cap, **_: _fake_plan(8, None), 100)["cap_bytes"] is None


def test_dry_run_plans_header_only_checkpoints_without_measuring(tmp_path):
    """--dry-run: a header-only checkpoint (no weights on disk), the caps row, every arm made estimated (--measure
    dropped) and read back; the arms MoE models get."""
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    assert conformance.main(["--dry-run", "--tiny", "--out", str(out), "--checkpoints", str(checkpoints),
                             "--models", "mixtral"]) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    folder = checkpoints / "mixtral-tiny-header"
    assert json.loads((folder / ".offload-plan-checkpoint").read_text())["kind"] == "header-only"
    assert sum(path.stat().st_blocks for path in folder.glob("*.safetensors")) * 512 < 2**20  # sparse
    facts = next(row for row in rows if row["kind"] == "checkpoint")
    assert facts["expert_tensor_names"] == [
        f"model.layers.N.block_sparse_moe.experts.N.{w}.weight" for w in ("w1", "w2", "w3")]
    caps = next(row for row in rows if row["kind"] == "caps")
    assert set(caps["routed_search"]) == {"serving-1", "decode-1"}
    arms = [row for row in rows if row["kind"] == "arm"]
    assert [row["arm"] for row in arms] == [arm.name for arm in conformance.arms_for(conformance.MODELS["mixtral"],
                                                                                      None)]
    assert all(row["exit"]["make"] == 0 and row["verdicts"]["exit_ok"] for row in arms), [r["errors"] for r in arms]
    assert {row["plan"]["regime"] for row in arms if row["experts"] == "whole-layer"} == {"whole_layer"}


def _serving_row(peak_bytes: int, decode_ms: float, text: str) -> dict:
    bench = {"peak_gpu_bytes": peak_bytes, "predicted_total_gpu_bytes": 9 * 2**30, "gpu_memory_bytes": 10 * 2**30,
             "decode_step_ms": decode_ms, "predicted_decode_step_ms": 10.0, "prefill_chunk_ms": 100.0,
             "predicted_prefill_chunk_ms": 95.0, "outside_allocator_start_bytes": 2**30}
    return {"exit": {"make": 0, "bench": 0, "prompt": 0}, "errors": {}, "bench": bench, "text": text,
            "plan": {"memory": {"gpu_memory_bytes": 10 * 2**30, "total_gpu_bytes": 9 * 2**30}}}


@pytest.mark.parametrize(("measure", "peak_gib", "decode_ms", "text", "expected"), [
    (True, 9.5, 10.5, "w1 w2", dict(peak_le_cap=True, peak_ge=True, error_within=True, tokens_equal=True)),
    (True, 10.5, 11.5, "w1 w3", dict(peak_le_cap=False, peak_ge=True, error_within=False, tokens_equal=False)),
    (False, 7.0, 11.5, "w1 w2", dict(peak_le_cap=True, peak_ge=False, error_within=True, tokens_equal=True)),
])
def test_verdicts(measure, peak_gib, decode_ms, text, expected):
    arm = conformance.Arm("qwen2-moe", "serving-1", "tight", measure)
    row = _serving_row(int(peak_gib * 2**30), decode_ms, text)
    verdicts = conformance.verdicts(arm, row, "w1 w2")
    assert verdicts["exit_ok"] and verdicts["no_oom"]
    assert verdicts["peak_le_cap"] == expected["peak_le_cap"]
    assert verdicts["peak_ge_0.9_predicted"] == expected["peak_ge"]
    assert verdicts["error_within"] == expected["error_within"]
    assert verdicts["tokens_equal"] == expected["tokens_equal"]
    assert row["peak_over_cap"] == pytest.approx(peak_gib / 10)


def test_verdicts_of_a_run_out_of_memory():
    arm = conformance.Arm("mixtral", "serving-4", "loose", False)
    row = {"exit": {"make": 0, "bench": 5, "prompt": 0}, "text": None, "plan": {"memory": {}},
           "errors": {"bench": "offload-plan: error: out of GPU memory while serving: the plan predicts 8 GiB"}}
    verdicts = conformance.verdicts(arm, row, "w1")
    assert verdicts == {"exit_ok": False, "no_oom": False, "peak_le_cap": None, "peak_ge_0.9_predicted": None,
                        "error_within": None, "tokens_equal": False}
    text = conformance.report([{"kind": "arm", "arm": arm.name, "measure": False, "seconds": 1.0} | row
                               | {"verdicts": verdicts}], 1.0)
    assert "| exit_ok | 0 | 1 | 0 |" in text and "| peak_le_cap | 0 | 0 | 1 |" in text


def test_a_routed_arm_shows_what_its_steps_fetched_against_the_plan():
    """The arm's line carries run --bench --json's routed figures: bytes measured over predicted, and the
    prediction's accuracy measured over planned (means over ranks)."""
    routed = {"num_steps": 60, "fetched_bytes_per_step": 900.0, "predicted_bytes_per_step": 1000,
              "bytes_per_step_by_kind": {"prefetched": 600.0, "wasted": 100.0, "missed": 200.0, "unpredicted": 0.0},
              "rank_accuracy": [0.95, None, 0.77], "planned_rank_accuracy": [0.9, 0.66]}
    assert conformance.routing_text({"routed": routed}) == "0.90, 0.86 / 0.78"
    assert conformance.routing_text({"routed": routed | {"rank_accuracy": []}}) == "0.90"
    assert conformance.routing_text({}) == "-"
    cpu = {"handoff": "doorbell", "pairs_per_step": 16.6, "host_ms_per_step": 8.46, "planned_cpu_ms_per_step": 5.12,
           "host_cpu_scale": 1.69, "step_ms_at_host_cpu_rate": 11.54}
    assert conformance.routing_text({"routed": routed | {"cpu": cpu}, "decode_step_ms": 11.63}) == (
        "0.90, 0.86 / 0.78; CPU at 1.69x its price, the plan there 11.54 ms (+0.8%)")
    # where run re-split its tables at the host's rate, the plan there with the tables made again
    resplit = cpu | {"step_ms_resplit_at_host_cpu_rate": 9.81, "resplit": {"events": [{"scale": 1.7}]}}
    assert conformance.routing_text({"routed": routed | {"cpu": resplit}, "decode_step_ms": 9.9}) == (
        "0.90, 0.86 / 0.78; CPU at 1.69x its price, the plan there re-split 9.81 ms (+0.9%)")
    unchanged = resplit | {"resplit": {"events": []}}
    assert conformance.routing_text({"routed": routed | {"cpu": unchanged}, "decode_step_ms": 11.63}).endswith(
        "the plan there 11.54 ms (+0.8%)")


def test_adapters_arms_make_and_read_plans_with_adapters_on_the_cpu(tmp_path):
    """The adapters mode (dense models only): random LoRA adapters on every linear of the decoder, written beside
    the checkpoint in PEFT's format (Phi-3's fused qkv_proj and gate_up_proj included), a plan of 4 sequences
    with 2 slots at each cap, read back by every reader; the bench's adapter stream is priced as its error."""
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    assert conformance.main(["--tiny", "--no-run", "--out", str(out), "--checkpoints", str(checkpoints), "--models",
                             "phi3,mixtral", "--modes", "adapters", "--all-arms"]) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    arms = [row for row in rows if row["kind"] == "arm"]
    assert [row["arm"] for row in arms] == ["phi3/adapters/loose/estimate", "phi3/adapters/tight/estimate"]
    assert all(set(row["exit"].values()) == {0} for row in arms), [row["errors"] for row in arms]
    config = json.loads((checkpoints / "phi3-tiny-adapters" / "a0" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    plan = arms[0]["plan"]
    assert plan["adapters"]["num_slots"] == conformance.ADAPTER_SLOTS
    bench = {"plan_mode": "pipelined", "modes": [{"mode": "blocking", "total_ms": 90.0, "predicted_total_ms": 60.0},
                                                 {"mode": "pipelined", "total_ms": 110.0, "predicted_total_ms": 100.0}]}
    assert conformance.prediction_errors(bench) == {"adapter_stream": pytest.approx(0.10)}


def test_a_split_at_a_near_tie_is_told_from_a_fault():
    torch = pytest.importorskip("torch")
    reference = [torch.tensor([4.0, 1.0, 0.0]), torch.tensor([2.0, 1.99, 0.0]), torch.tensor([0.0, 4.0, 1.0])]
    same = conformance.first_split(reference, reference, 2**-6)
    assert same == {"split_at": None, "worst_share": 0.0, "within_tolerance": True, "equal_share": 1.0,
                    "shares": [0.0, 0.0, 0.0]}
    # step 1 is a near tie (gap 0.01 of 2.0): a nudge within the tolerance takes the other token
    nudged = [reference[0], torch.tensor([1.995, 2.0, 0.0]), torch.tensor([0.0, 4.0, 1.0])]
    tie = conformance.first_split(nudged, reference, 2**-6)
    assert tie["split_at"] == 1 and tie["near_tie"] and tie["within_tolerance"]
    # a split where the reference's top two are far apart, the logits far off: a fault
    far = [reference[0], torch.tensor([3.0, 0.0, 0.0]), reference[2]]
    wrong = [reference[0], torch.tensor([0.0, 3.0, 0.0]), reference[2]]
    fault = conformance.first_split(wrong, far, 2**-6)
    assert fault["split_at"] == 1 and not fault["near_tie"] and not fault["within_tolerance"]


def test_first_split_counts_the_logits_bitwise_equal_up_to_the_split():
    torch = pytest.importorskip("torch")
    reference = [torch.tensor([1.0, 3.0, 2.0]), torch.tensor([4.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 2.0])]
    other = [reference[0] + torch.tensor([0.0, 0.0, 0.01]), torch.tensor([3.99, 4.0, 0.0]), reference[2]]
    split = conformance.first_split(other, reference, 2**-6)
    assert split["split_at"] == 1 and split["equal_share"] == 3 / 6 and not split["near_tie"]


def test_a_cpu_experts_plan_passes_the_tokens_verdict_only_at_a_near_tie_within_the_tolerance():
    """Text equal passes; a differing text passes only with a first_split that found a near tie and logits within
    the tolerance up to it (a CPU-experts plan's), and fails with none (any other plan) or with a fault."""
    row = {"exit": {"prompt": 0}, "text": "w1 w2"}
    assert conformance.tokens_equal(row, "w1 w2") is True
    row["text"] = "w1 w3"
    assert conformance.tokens_equal(row, "w1 w2") is False
    tie = {"split_at": 1, "near_tie": True, "within_tolerance": True, "margin_share": 0.004, "worst_share": 0.008}
    assert conformance.tokens_equal(row | {"logits": tie}, "w1 w2") is True
    for broken in ({"near_tie": False}, {"within_tolerance": False}):
        assert conformance.tokens_equal(row | {"logits": tie | broken}, "w1 w2") is False
    row |= {"logits": tie, "verdicts": {"tokens_equal": True}}
    assert conformance.tokens_text(row) == "True: near tie at step 1 (top-two gap 0.40%, logits within 0.80%)"


def _routing_record(torch, forward, step, layer, ids, weights, hidden, experts_share=0.003):
    return {"forward": forward, "step": step, "layer": layer, "ids": torch.tensor(ids),
            "weights": torch.tensor(weights), "hidden": torch.tensor(hidden), "experts_share": experts_share}


def test_routing_flip_finds_the_first_call_whose_routing_differs_and_its_inputs_distance():
    """Equal routing: None; a weight past the tolerance (sparsemixer's threshold) or another expert (a top-k tie)
    at the first such call, in the reference's order of ranks; near_tie by the input's distance; calls that do not
    align: None."""
    torch = pytest.importorskip("torch")
    reference = [_routing_record(torch, 0, None, 0, [[1, 2], [3, 0]], [[0.6, 0.4], [0.5, 0.5]], [[1.0, -2.0]]),
                 _routing_record(torch, 1, 0, 0, [[5, 6]], [[1.0, 1.0]], [[2.0, 0.0]]),
                 _routing_record(torch, 2, 1, 0, [[5, 6]], [[1.0, 1.0]], [[2.0, 0.0]])]
    tolerance = 2**-6
    same_ranks_swapped = [reference[0] | {"ids": torch.tensor([[2, 1], [3, 0]]),
                                          "weights": torch.tensor([[0.4, 0.6], [0.5, 0.5]])}, *reference[1:]]
    assert conformance.routing_flip(same_ranks_swapped, reference, tolerance) is None
    # step 0: the second expert's weight halves on an input 0.5% off: a near tie
    weight = [reference[0], reference[1] | {"weights": torch.tensor([[1.0, 0.5]]),
                                            "hidden": torch.tensor([[2.01, 0.0]])}, reference[2]]
    flip = conformance.routing_flip(weight, reference, tolerance)
    assert flip["step"] == 0 and flip["near_tie"] and not flip["other_expert"]
    assert flip["weight_gap"] == pytest.approx(0.5) and flip["input_share"] == pytest.approx(0.005)
    # another expert on an input 10% off: no tie
    other = [reference[0], reference[1] | {"ids": torch.tensor([[5, 7]]), "hidden": torch.tensor([[2.2, 0.0]])},
             reference[2]]
    flip = conformance.routing_flip(other, reference, tolerance)
    assert flip["other_expert"] and not flip["near_tie"]
    # a weight nudged within the tolerance is no flip
    nudged = [reference[0], reference[1] | {"weights": torch.tensor([[1.0, 0.99]])}, reference[2]]
    assert conformance.routing_flip(nudged, reference, tolerance) is None
    assert conformance.routing_flip([reference[1]], [reference[0]], tolerance) is None  # not aligned


def test_routing_records_each_experts_call_with_its_decode_step():
    """A tiny PhiMoE forward twice (a prompt, then one decode step): one record per layer per forward, the
    prompt's with no step, the decode's at step 0, the router's ids and weights as the experts module got them;
    hooks gone after."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                       num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    records = []
    with torch.no_grad(), conformance.routing_records(model, records) as forwards:
        model(torch.tensor([[1, 2, 3]]))
        forwards["decode_from"] = forwards["count"]
        model(torch.tensor([[4]]))
    assert [(r["forward"], r["step"], r["layer"], tuple(r["ids"].shape)) for r in records] == \
        [(0, None, 0, (3, 2)), (0, None, 1, (3, 2)), (1, 0, 0, (1, 2)), (1, 0, 1, (1, 2))]
    assert all(r["hidden"].shape[-1] == 32 and r["experts_share"] is None for r in records)
    assert not model.model.layers[0].mlp.experts._forward_hooks and not model._forward_pre_hooks


def test_a_router_near_tie_explains_a_split_only_with_the_arithmetic_within_the_tolerance(monkeypatch):
    """routing_against: a flip on an input within the tolerance, every routed call within it of its fp32 experts
    and every step before the flip within it: router_tie (the tokens verdict passes); an expert call past the
    tolerance, or logits past it before the flip, or a flip on a distant input: no tie (it fails)."""
    torch = pytest.importorskip("torch")
    reference_logits = [torch.tensor([4.0, 1.0, 0.0]), torch.tensor([4.0, 1.0, 0.0]), torch.tensor([0.0, 4.0, 1.0])]
    reference = [_routing_record(torch, 1 + step, step, 0, [[5, 6]], [[1.0, 1.0]], [[2.0, 0.0]]) for step in range(3)]

    def decode(logits, records):
        def greedy(path, num_tokens, graphed=None, routing=None):
            routing.extend(reference if path.name == "reference.yaml" else records)
            return [], reference_logits if path.name == "reference.yaml" else logits
        monkeypatch.setattr(conformance, "greedy_logits", greedy)
        return conformance.routing_against(conformance.Path("plan.yaml"), conformance.Path("reference.yaml"), 2**-6)

    flipped = [reference[0], reference[1] | {"weights": torch.tensor([[1.0, 0.5]])}, reference[2]]
    jumped = [reference_logits[0], torch.tensor([1.0, 4.0, 0.0]), torch.tensor([0.0, 1.0, 4.0])]
    tie = decode(jumped, flipped)
    assert tie["router_tie"] and tie["flip"]["step"] == 1 and tie["split_at"] == 1
    assert tie["experts_worst_share"] == 0.003 and tie["experts_calls"] == 3
    row = {"exit": {"prompt": 0}, "text": "w1 w3", "verdicts": {"tokens_equal": True},
           "logits": {"split_at": 1, "near_tie": False, "within_tolerance": False, "margin_share": 0.75,
                      "worst_share": 0.75, "routing": tie}}
    assert conformance.tokens_equal(row, "w1 w2") is True
    assert "from a router's near tie at step 1, layer 0" in conformance.tokens_text(row)
    wrong_expert = [record | {"experts_share": 0.05} if record["step"] == 0 else record for record in flipped]
    assert not decode(jumped, wrong_expert)["router_tie"]
    off_before = [torch.tensor([4.0, 1.5, 0.0]), *jumped[1:]]
    assert not decode(off_before, flipped)["router_tie"]
    far = [reference[0], flipped[1] | {"hidden": torch.tensor([[2.5, 0.0]])}, reference[2]]
    assert not decode(jumped, far)["router_tie"]
    row["logits"]["routing"] = decode(jumped, far)
    assert conformance.tokens_equal(row, "w1 w2") is False


def test_only_swiglu_experts_are_checked_against_fp32():
    """experts_fp32 computes gate_up and down with the module's activation: a layer with biases or other params
    (gpt-oss's) is not checked (its experts_share stays None) rather than computed wrong."""
    from types import SimpleNamespace

    swiglu = SimpleNamespace(param_names=["gate_up_proj", "down_proj"], modules={0: SimpleNamespace(act_fn=abs)})
    assert conformance.swiglu_experts(swiglu, 0)
    biased = SimpleNamespace(param_names=["down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"],
                             modules=swiglu.modules)
    assert not conformance.swiglu_experts(biased, 0)
    assert not conformance.swiglu_experts(SimpleNamespace(param_names=swiglu.param_names,
                                                          modules={0: SimpleNamespace()}), 0)
