"""The checkpoint ``run`` loads, resolved once (--model, else the plan's source, from any directory; a hub id to its
local snapshot) with its headers and config.json parsed once, and checked against the plan's fingerprint.
"""

from dataclasses import dataclass
from pathlib import Path

from planner.errors import ModelInputError, PlanError
from planner.plan.schema import Plan
from planner.source.checkpoint import Checkpoint, load_checkpoint, resolve_local_source

@dataclass(frozen=True, kw_only=True)
class LoadSource:
    """The checkpoint one load reads, resolved and parsed once: the fingerprint check, the experts check, the
    skeleton, the reads and the tokenizer all take this record instead of resolving the path or parsing the
    headers and config.json again."""

    #: --model, else the plan's source, as given (for messages)
    name: str
    #: the local folder (or .safetensors file) holding the weights: the path given, or the hub snapshot
    folder: Path
    #: every tensor's header entry (with its file offset) and config.json, parsed once
    checkpoint: Checkpoint


def open_source(plan: Plan, model: str | None, plan_path: Path | None = None) -> LoadSource:
    """Resolve the checkpoint once (--model, else the plan's source: a relative path from here or from the plan's
    folder, a hub id to its local snapshot) and read its headers and config.json once."""
    name = model if model is not None else plan.model.source
    if model is None and plan_path is not None:
        name = resolve_local_source(name, plan_path)  # run works from any directory
    folder = local_weights(name, plan.model.revision)
    return LoadSource(name=name, folder=folder, checkpoint=load_checkpoint(str(folder)))


def check_fingerprint(plan: Plan, source: LoadSource) -> None:
    """The checkpoint's tensor names, dtypes and shapes must be the ones the plan was made for."""
    fingerprint = source.checkpoint.fingerprint()
    if fingerprint != plan.model.fingerprint:
        raise PlanError(
            f"plan was made for a checkpoint with fingerprint {plan.model.fingerprint[:19]}..., but {source.name} "
            f"has {fingerprint[:19]}...: regenerate the plan for this checkpoint with offload-plan make"
        )


def local_weights(model: str, revision: str | None) -> Path:
    """The local folder holding the weights: the path given, or the hub repo's snapshot in the local Hugging
    Face cache. Tensor data is only ever read from local files: a repo not in the cache is a one-line error
    saying how to fetch it."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    folder = cached_snapshot(model, revision, ["*.json", "*.safetensors"])
    if folder is None or not list(folder.glob("*.safetensors")):
        revision_flag = f" --revision {revision}" if revision else ""
        raise ModelInputError(
            f"the weights of {model} are not in the local Hugging Face cache; fetch them with "
            f"`hf download {model}{revision_flag}` (older hubs: `huggingface-cli download {model}{revision_flag}`), "
            "or pass a local folder with --model"
        )
    return folder


def cached_snapshot(repo_id: str, revision: str | None, allow_patterns: list[str]) -> Path | None:
    """The repo's snapshot folder in the local Hugging Face cache (never the network), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub_errors

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=allow_patterns))
    except (hub_errors.LocalEntryNotFoundError, OSError, ValueError):
        return None
