"""The plan file: written by one function with fixed YAML settings, read back strictly.

Same inputs, same bytes: stable key order, block style (one line per layer row so diffs stay readable),
floats rounded to fixed decimals, no timestamps, host names or absolute paths. A header comment holds the
command that regenerates the file. Written atomically: a failed write never leaves a partial file. Read as a
whole: every section against its dataclass (types by introspection of the annotations), then the rules across
fields (planner.plan.rules); a schema 1 plan is upgraded first (planner.plan.migration).
"""

import os
import tempfile
import types
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import yaml

from planner.errors import PlanError, printable, shown
from planner.plan.adapters_section import AdapterRow, AdaptersSection
from planner.plan.experts_section import (OPTIONAL_EXPERT_LAYER, OPTIONAL_EXPERTS, OPTIONAL_EXPERTS_SET, CpuPlacement,
                                          ExpertLayer, ExpertsPlan, ExpertsPoint)
from planner.plan.schema import (MAX_PLAN_BYTES, MAX_PLAN_FLOAT, MAX_PLAN_INT, MS_DECIMALS, OPTIONAL_HARDWARE,
                                 OPTIONAL_INPUTS, OPTIONAL_OFFLOAD, OPTIONAL_WORKLOAD, OPTIONAL_SECTIONS,
                                 READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, SECTIONS, LayerRow, Plan, ServingRow,
                                 ServingSection)
from planner.plan.migration import upgraded_from_1
from planner.plan.rules import first_broken_rule
from planner.source.untrusted import checked_path, load_yaml, read_capped


class _FlowRow(dict):
    """A mapping dumped on one line: per-layer rows, so a moved layer is a one-line diff."""


class _Dumper(yaml.SafeDumper):
    pass


def _represent_flow_row(dumper, data):
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True)


def _represent_flow_list(dumper, data):
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


class _FlowList(list):
    """A short list of scalars dumped on one line (layer indices, params)."""


_Dumper.add_representer(_FlowRow, _represent_flow_row)
_Dumper.add_representer(_FlowList, _represent_flow_list)


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data in schema key order (also what ``show --json`` prints)."""
    out: dict = {"schema_version": plan.schema_version}
    for name in SECTIONS:
        section = asdict(getattr(plan, name))
        out[name] = {key: _plain(value) for key, value in section.items()}
    # written only when given, so plans without adapters keep their bytes
    for key in OPTIONAL_INPUTS:
        if out["inputs"][key] == _plain(OPTIONAL_INPUTS[key]):
            del out["inputs"][key]
    for key, default in OPTIONAL_OFFLOAD.items():
        if out["offload"][key] == default:
            del out["offload"][key]
    for section, optional in (("workload", OPTIONAL_WORKLOAD), ("hardware", OPTIONAL_HARDWARE)):
        for key, default in optional.items():
            if out[section][key] == default:
                del out[section][key]
    out["layers"] = [{key: _plain(value) for key, value in asdict(row).items()} for row in plan.layers]
    if plan.serving is not None:
        out["serving"] = {key: _plain(value) for key, value in asdict(plan.serving).items() if key != "points"}
        out["serving"]["points"] = [{key: _plain(value) for key, value in asdict(row).items()}
                                    for row in plan.serving.points]
    if plan.adapters is not None:
        out["adapters"] = {key: _plain(value) for key, value in asdict(plan.adapters).items() if key != "items"}
        out["adapters"]["items"] = [{key: _plain(value) for key, value in asdict(row).items()}
                                    for row in plan.adapters.items]
    if plan.experts is not None:
        rows = {"layers", "points"}
        out["experts"] = {key: _plain(value) for key, value in asdict(plan.experts).items() if key not in rows
                          and not (key in OPTIONAL_EXPERTS and plan.experts.fetch_slots == 0)
                          and not (key in OPTIONAL_EXPERTS_SET and value is None)}
        if plan.experts.cpu is not None:
            out["experts"]["cpu"] = {key: _plain(value) for key, value in asdict(plan.experts.cpu).items()}
        for name in sorted(rows):
            out["experts"][name] = [{key: _plain(value) for key, value in asdict(row).items()
                                     if not (key in OPTIONAL_EXPERT_LAYER and _plain(value) == _plain(
                                         OPTIONAL_EXPERT_LAYER[key]))}
                                    for row in getattr(plan.experts, name)]
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float):
        return round(value, MS_DECIMALS) if abs(value) < 1e6 else value
    return value


def render_plan(plan: Plan, command: str) -> str:
    """The plan's file text: header comment with the regenerating command, then block-style YAML."""
    data = plan_to_dict(plan)
    for name in ("inputs", "offload", "model"):
        for key, value in data[name].items():
            if isinstance(value, list):
                data[name][key] = _FlowList(value)
    data["layers"] = [_FlowRow(row) for row in data["layers"]]
    if "serving" in data:
        data["serving"]["points"] = [_FlowRow(row) for row in data["serving"]["points"]]
    if "adapters" in data:
        data["adapters"]["items"] = [_FlowRow(row) for row in data["adapters"]["items"]]
    if "experts" in data:
        for name in ("layers", "points"):
            data["experts"][name] = [_FlowRow({key: _FlowList(value) if isinstance(value, list) else value
                                               for key, value in row.items()}) for row in data["experts"][name]]
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120, allow_unicode=False)
    header = (
        "# Offload plan written by offload-plan. Do not edit by hand; regenerate with:\n"
        f"#   {command}\n"
    )
    return header + body


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file.

    Every problem with the destination (a folder, a missing or unwritable folder, a full disk) is one PlanError
    line, and the file that was there before is left as it was.
    """
    from planner.source.outputs import destination_problem

    path = checked_path(path, PlanError, "output")
    directory = path.parent if str(path.parent) else Path(".")
    shown = printable(path)
    problem = destination_problem(path)
    if problem is not None:
        raise PlanError(problem)
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise PlanError(f"cannot write in {printable(directory)} ({error.strerror}); check its permissions or choose "
                        "another path") from None
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise PlanError(f"cannot write {shown} ({error.strerror}); check the path, its permissions and free "
                            "space") from None
        raise


def read_plan(path: Path, *, derived: bool = True) -> Plan:
    """Load and validate a plan file; any problem is a one-line PlanError naming the field. ``derived``: refuse a
    plan whose stored figures disagree with what its other fields give (check reads without, to diff it)."""
    path = Path(path)
    raw = read_capped(path, MAX_PLAN_BYTES, PlanError, "plan")
    data = load_yaml(raw, str(path), PlanError, fix="regenerate it with make")
    return plan_from_dict(data, str(path), derived=derived)


def plan_from_dict(data: object, origin: str, *, derived: bool = True) -> Plan:
    """Build a Plan from parsed YAML; a schema 1 plan is upgraded to the current schema first. ``derived``: as
    read_plan's."""
    if not isinstance(data, dict):
        raise PlanError(f"{origin}: not a plan (expected a mapping); regenerate it with offload-plan make")
    expected = {"schema_version", "layers", *SECTIONS}
    if set(data) - set(OPTIONAL_SECTIONS) != expected:
        problems = sorted((set(data) - set(OPTIONAL_SECTIONS)) ^ expected, key=str)  # YAML keys may be numbers too
        raise PlanError(f"{origin}: plan keys differ from schema {SCHEMA_VERSION} at {shown(problems, 120)}; "
                        "regenerate it")
    version = data["schema_version"]
    if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:  # 1.0 and true are not 1
        raise PlanError(f"{origin}: schema_version {shown(version)} is not one of "
                        f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}; regenerate it with this offload-plan")
    if version == 1:
        data = upgraded_from_1(data, origin)
    kwargs: dict = {"schema_version": SCHEMA_VERSION}
    if isinstance(data["inputs"], dict):
        data = dict(data, inputs={**{key: list(value) if isinstance(value, tuple) else value
                                     for key, value in OPTIONAL_INPUTS.items()}, **data["inputs"]})
    if isinstance(data["offload"], dict):  # plans written before these keys, and prefetch plans, omit them
        data = dict(data, offload={**OPTIONAL_OFFLOAD, **data["offload"]})
    if isinstance(data["workload"], dict):  # written only when true
        data = dict(data, workload={**OPTIONAL_WORKLOAD, **data["workload"]})
    if isinstance(data["hardware"], dict):  # written only when measured
        data = dict(data, hardware={**OPTIONAL_HARDWARE, **data["hardware"]})
    for name, cls in SECTIONS.items():
        kwargs[name] = _section(cls, data[name], f"{origin}: {name}")
    rows = data["layers"]
    if not isinstance(rows, list):
        raise PlanError(f"{origin}: layers must be a list of rows; regenerate the plan")
    kwargs["layers"] = tuple(_section(LayerRow, row, f"{origin}: layers[{i}]") for i, row in enumerate(rows))
    if data.get("serving") is not None:
        kwargs["serving"] = _serving_section(data["serving"], f"{origin}: serving")
    if data.get("adapters") is not None:
        kwargs["adapters"] = _adapters_section(data["adapters"], f"{origin}: adapters")
    if data.get("experts") is not None:
        experts = data["experts"]
        if isinstance(experts, dict):
            experts = {**OPTIONAL_EXPERTS, **OPTIONAL_EXPERTS_SET, **experts}
            if isinstance(experts.get("layers"), list):  # absent: refused below, naming the key
                experts["layers"] = [{**{key: _plain(value) for key, value in OPTIONAL_EXPERT_LAYER.items()}, **row}
                                     if isinstance(row, dict) else row
                                     for row in experts["layers"]]
        kwargs["experts"] = _section(ExpertsPlan, experts, f"{origin}: experts",
                                     rows={"layers": ExpertLayer, "points": ExpertsPoint},
                                     nested={"cpu": CpuPlacement})
    misplaced = [i for i, row in enumerate(kwargs["layers"]) if row.index != i]
    if misplaced:
        raise PlanError(f"{origin}: layers[{misplaced[0]}] has index {kwargs['layers'][misplaced[0]].index}; rows must "
                        "be numbered 0, 1, 2, ... in order: regenerate the plan")
    try:
        plan = Plan(**kwargs)
    except ValueError as error:
        raise PlanError(f"{origin}: {error}; regenerate the plan") from None
    broken = first_broken_rule(plan, derived=derived)
    if broken is not None:
        raise PlanError(f"{origin}: {broken}; a plan make could not have written: regenerate it with make")
    return plan


def _serving_section(raw: object, origin: str) -> ServingSection:
    """The serving section: flat fields, and its points as rows."""
    return _section(ServingSection, raw, origin, rows={"points": ServingRow})


def _adapters_section(raw: object, origin: str) -> AdaptersSection:
    """The adapters section: flat fields, and its items as rows."""
    return _section(AdaptersSection, raw, origin, rows={"items": AdapterRow})


_TYPES = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}




def _section(cls, raw: object, origin: str, rows: dict[str, type] | None = None,
             nested: dict[str, type] | None = None):
    """One section (or row) checked against its dataclass; ``rows``: fields that hold a list of rows of a class;
    ``nested``: fields that hold one (optional) section of a class."""
    if not isinstance(raw, dict):
        raise PlanError(f"{origin} must be a mapping; regenerate the plan")
    names = [f.name for f in fields(cls)]
    if set(raw) != set(names):
        wrong = sorted(set(raw) ^ set(names), key=str)
        raise PlanError(f"{origin}: keys {shown(wrong, 120)} differ from the schema; regenerate the plan")
    values = {}
    for f in fields(cls):
        if rows and f.name in rows:
            values[f.name] = _rows(rows[f.name], raw[f.name], f"{origin}.{f.name}")
        elif nested and f.name in nested:
            values[f.name] = None if raw[f.name] is None else _section(nested[f.name], raw[f.name],
                                                                       f"{origin}.{f.name}")
        else:
            values[f.name] = _check_type(raw[f.name], f.type, f"{origin}.{f.name}", f.metadata.get("lowest", 0))
    try:
        return cls(**values)
    except ValueError as error:
        raise PlanError(f"{origin}: {error}; regenerate the plan") from None


def _rows(cls, raw: object, origin: str) -> tuple:
    if not isinstance(raw, list):
        raise PlanError(f"{origin} must be a list of rows; regenerate the plan")
    return tuple(_section(cls, row, f"{origin}[{i}]") for i, row in enumerate(raw))


def _check_type(value: Any, annotation: Any, origin: str, lowest: int = 0) -> Any:
    """Check one field against its annotation (int, float, str, bool, optional, tuples and str->int dicts), read
    by introspection: ``X | None`` is a union with NoneType, ``tuple[int, ...]`` and ``dict[str, int]`` generics."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        if value is None:
            if type(None) in args:
                return None
        annotation = next(arg for arg in args if arg is not type(None))
        args = typing.get_args(annotation)
    if value is None:
        raise PlanError(f"{origin} must not be null; regenerate the plan")
    origin_type = typing.get_origin(annotation)
    if origin_type is tuple:
        inner = args[0]
        if not isinstance(value, list) or not all(_is(v, inner) for v in value):
            raise PlanError(f"{origin} must be a list of {inner.__name__}; regenerate the plan")
        if inner is int and not all(_plausible(v) for v in value):
            raise PlanError(f"{origin} must hold whole numbers from 0 to {MAX_PLAN_INT}; regenerate the plan")
        if inner is float and not all(_plausible(v) for v in value):
            raise PlanError(f"{origin} must hold numbers from 0 to {MAX_PLAN_FLOAT:g}; regenerate the plan")
        return tuple(value)
    if origin_type is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and _is(v, int) and _plausible(v)
                                                  for k, v in value.items()):
            raise PlanError(f"{origin} must be a mapping of names to whole numbers; regenerate the plan")
        return value
    base = annotation
    if base is bool:
        if not isinstance(value, bool):
            raise PlanError(f"{origin} must be true or false, got {shown(value)}; regenerate the plan")
        return value
    if not _is(value, base):
        raise PlanError(f"{origin} must be {base.__name__}, got {shown(value)}; regenerate the plan")
    if base in (int, float) and not _plausible(value, lowest):
        raise PlanError(f"{origin} is {value!r}; plan numbers are finite, not negative and below "
                        f"{MAX_PLAN_INT if base is int else MAX_PLAN_FLOAT:g}: regenerate the plan")
    return float(value) if base is float else value


def _plausible(value: int | float, lowest: int = 0) -> bool:
    limit = MAX_PLAN_INT if isinstance(value, int) else MAX_PLAN_FLOAT
    return lowest <= value <= limit  # False for NaN too


def _is(value: Any, kind: type) -> bool:
    return not isinstance(value, bool) and isinstance(value, _TYPES[kind])
