"""planner.views.show: what show prints and where each hardware figure comes from (the serving chart:
test_show_serving.py; the experts paragraph: test_show_experts.py)."""

from dataclasses import replace

from rich.console import Console

from planner.plan.file import read_plan
from planner.views.show import PROVENANCE_FIGURES
from tests.conftest import REPO_ROOT


def test_show_states_where_each_hardware_figure_comes_from():
    """A gb200 plan's link figure is GB300's, assumed, on a link two GPUs share: show says so (issue 26)."""
    from planner.views.show import provenance_table, show_plan

    plan = read_plan(REPO_ROOT / "plans" / "llama-3.1-70b-gb200-96gib.yaml")
    console = Console(width=120, record=True)
    show_plan(plan, console, layer_table=False)
    text = console.export_text()
    assert "link 211.5 GB/s (assumed: see Hardware figures below)" in text
    assert "GB300's measured pinned H2D" in text and "shared by the superchip's 2 GPUs" in text
    table = provenance_table(plan)
    assert table.row_count == sum(getattr(plan.hardware, key) is not None for key, _, _ in PROVENANCE_FIGURES)
    changed = replace(plan, hardware=replace(plan.hardware, h2d_bytes_per_s=100e9))
    console = Console(width=120, record=True)
    console.print(provenance_table(changed))
    assert "the plan's own figure: its profile now gives another" in console.export_text()


def _regime_plans() -> dict[str, str]:
    """One plan of every regime show prints, as make writes it: whole layers offloaded, a weights plan of MoE
    experts under CUDA graphs, serving, adapters, routed experts (weights and serving), tensor parallel."""
    import tempfile
    from pathlib import Path

    from tests.fuzz import BASE_ARGS, base
    from tests.fuzz.adapters import adapter_plan_text as _adapter_plan_text
    from tests.fuzz.core import invoke_cli_in, yaml_text as _yaml

    plans = {"offloaded": base().plan_text, "experts-graph": base().graph_plan_text,
             "serving": base().serving_plan_text, "adapters": _adapter_plan_text()}
    # room for the KV cache, activations and the runtime's 320 MiB beside the weights-only plans' tiny budgets
    profile = dict(base().profile, gpu_link_bytes_per_s={"value": 4.5e11, "source": "assumed", "note": "test"},
                   gpu_memory_bytes={"value": 4e9, "source": "assumed", "note": "test"})
    made = {"routed": (True, ["--tokens", "1", "--context", "64", "--budget", "61440B"]),
            "routed-serving": (True, ["--context", "64", "--concurrency", "2", "--chunk", "64", "--gpu-memory",
                                      "329878KiB"]),  # 2198 KiB and the runtime's 320 MiB
            "tp2": (False, ["--budget", base().budget, "--tp", "2"])}
    for name, (moe, flags) in made.items():
        with tempfile.TemporaryDirectory(prefix="regime-") as folder:
            files = base().files(moe) | {"gpu.yaml": _yaml(profile).encode()}
            code, stdout, stderr, _ = invoke_cli_in(Path(folder), files, [*BASE_ARGS, *flags])
            assert code == 0, stderr
            plans[name] = stdout
    return plans


def _memory_rows(plan) -> dict[str, int]:
    """show's memory table as label -> bytes."""
    from planner.views.show import show_plan

    console = Console(width=240, record=True)
    show_plan(plan, console, layer_table=False)
    text = console.export_text()
    rows = {}
    for line in text[text.index("Memory"):].splitlines()[4:]:
        cells = [cell.strip() for cell in line.split("│")]
        if len(cells) < 4:
            break
        rows[cells[1]] = int(cells[2].replace(",", ""))
    return rows


def test_show_memory_rows_add_up_in_every_regime():
    """The weight rows sum to "GPU: total weights", and the whole-GPU rows (weights, adapter slots, KV cache,
    activations, graph pool, context) to "GPU: total" (issue 39: a routed plan's rows summed to a tenth of its
    total, with no row for its resident experts)."""
    import yaml

    from planner.plan.file import plan_from_dict

    plans = _regime_plans()
    assert "regime: routed" in plans["routed"] and "regime: routed" in plans["routed-serving"]
    for name, text in plans.items():
        plan = plan_from_dict(yaml.safe_load(text), name)
        rows = list(_memory_rows(plan).items())
        labels = [label for label, _ in rows]
        weights_end = labels.index("GPU: total weights")
        assert sum(value for _, value in rows[:weights_end]) == rows[weights_end][1], (name, rows)
        if "GPU: total" in labels:
            parts = [value for label, value in rows[weights_end + 1:labels.index("GPU: total")]
                     if label.startswith("GPU:") and label != "GPU: budget"]
            assert rows[weights_end][1] + sum(parts) == dict(rows)["GPU: total"], (name, rows)
        if plan.experts is not None and plan.experts.fetch_slots:
            assert any("resident experts" in label for label in labels), (name, labels)


def test_show_labels_routed_layers_and_draws_their_fetches():
    """A routed layer is "routed" in the layer table with its fetch in the copy column, and the timeline's link
    row shows the fetches; a count of one is singular ("1 sequence")."""
    import yaml

    from planner.plan.file import plan_from_dict
    from planner.views.show import show_plan

    plan = plan_from_dict(yaml.safe_load(_regime_plans()["routed"]), "routed")
    console = Console(width=160, record=True)
    show_plan(plan, console, layer_table=True)
    text = console.export_text()
    table = text[text.index("Layers (steady-state step)"):text.index("One step")]
    assert table.count(" routed ") == plan.model.num_layers and " resident " not in table
    link_row = next(line for line in text.splitlines() if line.startswith("copy    |"))
    assert "=" in link_row
    assert "1 sequences" not in text and "1 tokens" not in text and "1 sequence" in text


def test_diff_of_two_dense_plans_has_no_experts_line():
    from planner.views.diff import compare_plans, summary_sentences

    plan = read_plan(REPO_ROOT / "tests" / "golden" / "dense-budget.yaml")
    other = read_plan(REPO_ROOT / "tests" / "golden" / "dense-fits.yaml")
    data = compare_plans(plan, other)
    assert "experts" not in data
    assert not any("xpert" in sentence for sentence in summary_sentences(data))
