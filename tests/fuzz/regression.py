"""What the fuzz regressions (tests/contract/test_fuzz_<error class>.py) are built from and held to.

A regression is the fuzzer's base inputs (tests/fuzz/core.py) with one edit, run through the CLI in-process; an
invalid one must end in a clean one-line error that says what is wrong, within a second. The builders below
return the files a case writes over the base inputs; a ``Refusal`` pairs them with the command line and the words
its error line must hold (the project's words, never a dependency's: theirs change between releases).
"""

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.conftest import MAX_ERROR_LINE_CHARS
from tests.fuzz.adapters import adapter_files, adapter_plan_text
from tests.fuzz.core import BASE_ARGS, GUARD_NAME, SHARDS, Case, Result, base, framed, header_of, json_bytes, \
    run_case, yaml_text

SHARD = f"ckpt/{SHARDS[0]}"
INDEX = "ckpt/model.safetensors.index.json"
CONFIG = "ckpt/config.json"
#: a GPU-to-GPU link for profiles that make --tp reads
LINK = {"value": 4.5e11, "source": "assumed", "note": "a test link"}
#: the time a refusal may take: reading and refusing a bad input is quick, so anything slower is a near-hang
REFUSAL_MS = 1000


@dataclass(frozen=True)
class Refusal:
    """One regression: a command line, the files written over the base inputs, and the error line's words."""

    args: list[str]
    #: relative path -> bytes written over the base files
    files: dict
    #: a fragment the one error line must hold, or a tuple of alternatives
    fragment: str | tuple[str, ...]
    #: relative path -> one of tests.fuzz.core.SPECIAL_KINDS (a FIFO, a folder, a device)
    special: dict = field(default_factory=dict)
    #: start from the MoE base model instead of the dense one
    moe: bool = False


def run_regression(name: str, args, files=None, special=None, then=(), invalid=True, moe=False) -> Result:
    """Run one case in a fresh folder (5 s before it counts as a hang; the assertions ask for far less)."""
    case = Case(family="regression", mutation=name, args=list(args), invalid=invalid, files=dict(files or {}),
                special=dict(special or {}), then=tuple(then), moe=moe)
    with tempfile.TemporaryDirectory(prefix="fuzz-regression-") as root:
        return run_case(case, Path(root), time_limit_s=5.0)


def assert_refused(name: str, refusal: Refusal) -> None:
    """Run ``refusal``: a clean error of one short line holding its fragment, well within a second."""
    result = run_regression(name, refusal.args, refusal.files, refusal.special, moe=refusal.moe)
    assert result.verdict == "error", f"{result.verdict}: {result.detail} | {result.message}"
    fragments = (refusal.fragment,) if isinstance(refusal.fragment, str) else refusal.fragment
    assert any(text in result.message for text in fragments), result.message
    assert len(result.message) <= MAX_ERROR_LINE_CHARS, result.message
    assert result.elapsed_ms < REFUSAL_MS, f"refused, but only after {result.elapsed_ms:.0f} ms"


def make_args(*extra: str, output: str = GUARD_NAME) -> list[str]:
    """make over the base checkpoint and profile at the base budget, writing over the guarded file."""
    return [*BASE_ARGS, "--budget", base().budget, *extra, "-o", output]


def header_edit(edit, data_extra_bytes: int = 0, index_edit=None) -> dict:
    """The first shard with its header ``edit(header)`` (edited in place, or returned as raw JSON bytes), and the
    index's weight map edited by ``index_edit`` when given."""
    header = header_of(base().dense.shards[SHARDS[0]])
    data_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()) + data_extra_bytes
    edited = edit(header)
    files = {SHARD: framed(header if edited is None else edited, data_bytes)}
    if index_edit is not None:
        weight_map = dict(base().dense.weight_map)
        index_edit(weight_map)
        files[INDEX] = json.dumps({"weight_map": weight_map}).encode()
    return files


def first_tensor(header: dict) -> str:
    """The name of a header's first tensor."""
    return next(iter(header))


def overlap_second_tensor(header: dict) -> None:
    """A header edit: the second tensor's bytes moved two bytes back, into the first's."""
    second = header[list(header)[1]]
    second.update(data_offsets=[second["data_offsets"][0] - 2, second["data_offsets"][1] - 2])


def renamed_tensor(suffix: str) -> dict:
    """The first shard's first tensor renamed (``suffix`` appended) in its header and the index alike."""
    def edit(header):
        name = first_tensor(header)
        header[name + suffix] = header.pop(name)

    def index_edit(weight_map):
        name = first_tensor(header_of(base().dense.shards[SHARDS[0]]))
        weight_map[name + suffix] = weight_map.pop(name)
    return header_edit(edit, index_edit=index_edit)


def json_file(path: str, edit=None, raw: bytes | None = None, moe: bool = False) -> dict:
    """A base JSON file (the index or config.json) edited in place by ``edit``, or replaced by ``raw``."""
    data = json.loads((base().moe if moe else base().dense).files()[path])
    if edit is not None:
        edit(data)
    return {path: raw if raw is not None else json.dumps(data).encode()}


def config_file(edit, moe: bool = False, path: str = CONFIG) -> dict:
    """The base model's config.json edited in place by ``edit``, written at ``path``."""
    config = dict((base().moe if moe else base().dense).config)
    edit(config)
    return {path: json_bytes(config)}


def plan_file(edit=None, raw: bytes | None = None) -> dict:
    """plan.yaml: the base whole-layer plan edited in place by ``edit``, or replaced by ``raw``."""
    plan = base().plan_copy("plain")
    if edit is not None:
        edit(plan)
    return {"plan.yaml": raw if raw is not None else yaml.safe_dump(plan, sort_keys=False).encode()}


def serving_plan_file(edit) -> dict:
    """plan.yaml: the base serving plan edited in place by ``edit``."""
    plan = base().plan_copy("serving")
    edit(plan)
    return {"plan.yaml": yaml_text(plan).encode()}


def adapter_plan_file(edit) -> dict:
    """plan.yaml: the base adapter plan edited in place by ``edit``, beside the adapter's files."""
    plan = yaml.safe_load(adapter_plan_text())
    edit(plan)
    return {**adapter_files(), "plan.yaml": yaml_text(plan).encode()}


def profile_file(edit=None, raw: bytes | None = None) -> dict:
    """gpu.yaml: the base profile edited in place by ``edit``, or replaced by ``raw``."""
    profile = json.loads(json.dumps(base().profile))
    if edit is not None:
        edit(profile)
    return {"gpu.yaml": raw if raw is not None else yaml.safe_dump(profile).encode()}


def profile_value(key: str, value) -> dict:
    """gpu.yaml: the base profile with one figure's value replaced."""
    return profile_file(lambda profile: profile[key].update(value=value))


def linked_profile() -> dict:
    """gpu.yaml: the base profile with a GPU-to-GPU link, which make --tp needs."""
    return profile_file(lambda profile: profile.update(gpu_link_bytes_per_s=LINK))
