"""planner.make.inputs: make's options declared once, and the regenerate command that parses back to them."""


def test_make_options_and_regenerate_command_come_from_inputs():
    """One declaration: make's options are Inputs' fields, and the regenerate command parses back to the same
    Inputs through make's own parser (every field set away from its default)."""
    import shlex
    from dataclasses import fields

    import typer

    from offload_plan.app import app
    from planner.make.inputs import regenerate_command
    from planner.plan.schema import Inputs

    command = typer.main.get_command(app).commands["make"]
    assert [p.name for p in command.params if p.name not in ("help", "output")] == [f.name for f in fields(Inputs)]
    inputs = Inputs(model="org/model", revision="abc123", gpu="h100-sxm", budget="40GiB", trigger=0.5, tokens=64,
                    sequences=64, context=1024, params=("experts", "self_attn"), stack="model.layers", group_size=4,
                    num_in_group=2, prefetch_step=1, measure=True, measured_on="h100-sxm", cuda_graph=True,
                    host_memory="480GB")
    words = shlex.split(regenerate_command(inputs, "plan.yaml"))
    assert words[:2] == ["offload-plan", "make"] and words[-2:] == ["-o", "plan.yaml"]
    values = command.make_context("make", words[2:]).params
    assert values.pop("output").name == "plan.yaml"
    assert Inputs(**{k: tuple(v) if k == "params" else v for k, v in values.items()}) == inputs
    assert shlex.split(regenerate_command(Inputs(model="m", gpu="g"), None)) == \
        ["offload-plan", "make", "--model", "m", "--gpu", "g", "--tokens", "2048"]
