"""The reference pages against the code they describe (issue 40).

docs/reference/commands.md: every flag and argument of every command, read from the typer application itself,
has a row in its command's section, with the flag's default; no row names a flag the command does not have.
docs/reference/plan.md: every key a plan can hold, read from planner.plan.schema's dataclasses, has a row in its
section's table; no row names a key the schema does not hold; and the checked-in plans hold no other key.
"""

import dataclasses
import re
import types
import typing

import pytest
import typer.main
import yaml

from offload_plan.app import app
from planner.plan.schema import Plan
from tests.conftest import REPO_ROOT

COMMANDS_PAGE = REPO_ROOT / "docs" / "reference" / "commands.md"
PLAN_PAGE = REPO_ROOT / "docs" / "reference" / "plan.md"
GLOBAL_SECTION = "Global"
_HEADING = re.compile(r"^(#{2,3}) (\S+)")
_TICKED = re.compile(r"`([^`]+)`")


def _sections(path) -> dict[str, list[list[str]]]:
    """Each ``##``/``###`` section's table rows, as lists of cells, by the heading's first word; the rows
    before the first heading under ``""``. Header and separator rows are left out."""
    sections: dict[str, list[list[str]]] = {"": []}
    current = ""
    for line in path.read_text().splitlines():
        heading = _HEADING.match(line)
        if heading:
            current = heading.group(2)
            assert current not in sections, f"{path.name}: two sections named {current}"
            sections[current] = []
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells[0] not in ("flag", "key", "section"):
                sections[current].append(cells)
    return sections


def _named(rows: list[list[str]]) -> dict[str, list[str]]:
    """Each name a row's first cell holds in backticks (``--model``, ``-m``), to its row."""
    return {name: row for row in rows for name in _TICKED.findall(row[0])}


# --- commands ---------------------------------------------------------------------------------------------


def _group():
    return typer.main.get_command(app)


def _names_of(param) -> list[str]:
    """What the reference calls a parameter: every spelling of an option, an argument's metavar (PLAN)."""
    if not any(opt.startswith("-") for opt in param.opts):  # an argument (typer 0.28+ has its own click classes)
        return [param.name.upper()]
    return [*param.opts, *param.secondary_opts]


def _expected_flags() -> dict[str, dict[str, object]]:
    """Section -> each name a user may type -> its click parameter (None for the help option)."""
    group = _group()
    expected = {GLOBAL_SECTION: {name: None for name in group.context_settings["help_option_names"]}}
    expected[GLOBAL_SECTION].update({name: param for param in group.params for name in _names_of(param)})
    for command_name, command in group.commands.items():
        expected[command_name] = {name: param for param in command.params for name in _names_of(param)}
    return expected


def test_every_command_has_a_section():
    sections = _sections(COMMANDS_PAGE)
    missing = sorted(set(_expected_flags()) - set(sections))
    assert not missing, f"docs/reference/commands.md has no section for {missing}"


@pytest.mark.parametrize("command", sorted(_expected_flags()))
def test_every_flag_has_a_row_and_every_row_a_flag(command):
    documented = set(_named(_sections(COMMANDS_PAGE).get(command, [])))
    actual = set(_expected_flags()[command])
    assert not actual - documented, f"{command}: no row in docs/reference/commands.md for {sorted(actual - documented)}"
    assert not documented - actual, f"{command}: docs/reference/commands.md names {sorted(documented - actual)}, " \
                                    "which the command does not have"


def _default_words(param) -> list[str] | None:
    """What the default cell must say for this parameter, or None where it is free text (a computed default)."""
    if param.required:
        return ["required"]
    if getattr(param, "is_flag", False) and not param.secondary_opts:
        return ["on" if param.default else "off"]
    if getattr(param, "is_flag", False) and isinstance(param.default, bool):
        return [param.opts[0] if param.default else param.secondary_opts[0]]
    if param.default is None or isinstance(param.default, (tuple, list)):
        return None
    return [str(param.default)]


@pytest.mark.parametrize("command", sorted(_expected_flags()))
def test_every_default_is_the_flags(command):
    """A row's default cell (its second) starts with the flag's default, where the flag has a fixed one."""
    rows = _named(_sections(COMMANDS_PAGE).get(command, []))
    for name, param in _expected_flags()[command].items():
        words = None if param is None else _default_words(param)
        if words is None or name not in rows:
            continue
        cell = rows[name][1].strip("`")
        assert any(cell == word or cell.startswith(f"{word} ") or cell.startswith(f"{word}`") for word in words), \
            f"{command} {name}: docs/reference/commands.md says the default is {rows[name][1]!r}, the code {words[0]!r}"


def test_readme_lists_every_command():
    """The README's command list names each command the application has."""
    readme = (REPO_ROOT / "README.md").read_text()
    listed = set(re.findall(r"^offload-plan ([a-z-]+) ", readme, flags=re.MULTILINE))
    missing = sorted(set(_group().commands) - listed)
    assert not missing, f"README.md's command list does not name {missing}"


# --- the plan file ----------------------------------------------------------------------------------------


def _dataclass_in(annotation) -> type | None:
    """The dataclass an annotation holds: ``X``, ``X | None`` or ``tuple[X, ...]``; None for plain values."""
    if typing.get_origin(annotation) in (types.UnionType, typing.Union, tuple):
        inner = [arg for arg in typing.get_args(annotation) if arg not in (type(None), Ellipsis)]
        return _dataclass_in(inner[0]) if len(inner) == 1 else None
    return annotation if dataclasses.is_dataclass(annotation) else None


def _schema_tables() -> dict[str, set[str]]:
    """Section heading -> the keys its table must name: each top-level section of Plan (``layers`` holds its
    rows' keys) and each list of rows inside one (``serving.points``)."""
    hints = typing.get_type_hints(Plan)
    tables = {"": {field.name for field in dataclasses.fields(Plan)}}
    for name, annotation in hints.items():
        cls = _dataclass_in(annotation)
        if cls is None:
            continue
        tables[name] = {field.name for field in dataclasses.fields(cls)}
        for inner_name, inner in typing.get_type_hints(cls).items():
            row_cls = _dataclass_in(inner)
            if row_cls is not None:
                tables[f"{name}.{inner_name}"] = {field.name for field in dataclasses.fields(row_cls)}
    return tables


def _documented_keys() -> dict[str, set[str]]:
    """Section -> the first backticked name of each row (the key)."""
    return {section: {_TICKED.findall(row[0])[0] for row in rows if _TICKED.findall(row[0])}
            for section, rows in _sections(PLAN_PAGE).items()}


@pytest.mark.parametrize("section", sorted(_schema_tables()))
def test_every_plan_key_has_a_row_and_every_row_a_key(section):
    keys = _schema_tables()[section]
    documented = _documented_keys().get(section, set())
    where = f"docs/reference/plan.md's {section or 'section table'}"
    assert not keys - documented, f"{where} has no row for {sorted(keys - documented)}"
    assert not documented - keys, f"{where} names {sorted(documented - keys)}, which a plan does not hold"


def test_no_plan_section_beyond_the_schema():
    """The page documents no section (## or ###) the schema does not have."""
    extra = sorted(set(_documented_keys()) - set(_schema_tables()))
    assert not extra, f"docs/reference/plan.md has sections {extra} that a plan does not hold"


def _plan_files() -> list:
    return sorted((REPO_ROOT / "tests" / "golden").glob("*.yaml")) + sorted((REPO_ROOT / "plans").glob("*.yaml"))


def _keys_by_section(data: dict) -> dict[str, set[str]]:
    """A plan file's keys as the page's tables hold them: top level, each section's, each row list's."""
    found = {"": set(data)}
    for name, value in data.items():
        rows = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        for row in rows:
            for key, inner in row.items():
                found.setdefault(name, set()).add(key)
                if isinstance(inner, list) and inner and isinstance(inner[0], dict):
                    found.setdefault(f"{name}.{key}", set()).update(k for item in inner for k in item)
    return found


def test_checked_in_plans_hold_only_documented_keys():
    """What make writes (the golden plans and plans/, a serving, MoE and dense set) holds no key the page lacks."""
    documented = _documented_keys()
    assert _plan_files()
    for path in _plan_files():
        for section, keys in _keys_by_section(yaml.safe_load(path.read_text())).items():
            undocumented = keys - documented.get(section, set())
            assert not undocumented, f"{path.name}: {section or 'top level'} keys {sorted(undocumented)} have no row"


def test_every_benchmark_page_is_in_the_benchmarks_index():
    """benchmarks/README.md's table lists every dated result page (seven 2026-11-28 pages and six 2026-11-25 ones
    had been left out of it)."""
    index = (REPO_ROOT / "benchmarks" / "README.md").read_text()
    pages = sorted(path.name for path in (REPO_ROOT / "benchmarks").glob("20*.md"))
    missing = [name for name in pages if f"]({name})" not in index]
    assert pages and not missing, f"benchmarks/README.md does not list {missing}"
