"""Hugging Face hub access: repo ids, whether the hub answers, small files and shard headers through
``huggingface_hub``, the local cache first.

Small files (an index, a config.json) are fetched with hf_hub_download, or served from the cache; a shard's header
comes from the cache when the shard is there, else from HTTP range requests: tensor data is never downloaded. With
HF_HUB_OFFLINE, or when the hub's host does not answer within seconds, only the cache is read and a file it lacks
is one line. planner.source.checkpoint and planner.model.adapters read the hub through here.
"""

import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from planner.errors import ModelInputError, shown
from planner.source.safetensors_header import TensorEntry, entries_from_header, read_entries

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: seconds to wait for the hub's host before treating it as unreachable (instead of the client's minute of retries)
HUB_CONNECT_TIMEOUT_S = 3.0


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` has a hub repo id's shape (org/name), as opposed to a path (``./org/name``, ``/abs``)."""
    return bool(_REPO_ID_RE.fullmatch(text)) and not text.startswith((".", "/"))


def check_repo_id(repo_id: str) -> None:
    """The hub's own rules for a repo id (no '..', '--', leading or trailing '.' or '-'), in one line."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        reason = str(error).splitlines()[0] if str(error).strip() else "not a repo id"
        raise ModelInputError(f"{shown(repo_id)} is not a valid Hugging Face repo id ({shown(reason)}); check it, "
                              "or give a local folder as ./PATH") from None


def hub_unreachable() -> str | None:
    """Why the hub cannot be used now (HF_HUB_OFFLINE, or its host not answering within seconds), else None."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(constants.ENDPOINT)
    host, port = endpoint.hostname or "", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        return f"{host} cannot be reached ({error.strerror or type(error).__name__})"
    return None


def hub_file(repo_id: str, filename: str, revision: str | None, *, required: bool,
             offline: str | None = None) -> Path | None:
    """The local path of ``filename`` of the repo at ``revision`` through hf_hub_download (the cache only when
    ``offline`` says why the hub is not used); None for a file the repo lacks unless ``required``; every hub
    failure one line."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub import errors as hub_errors

    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=offline is not None))
    except hub_errors.RepositoryNotFoundError:
        raise ModelInputError(
            f"{repo_id}: no such repository on the hub, or it is private/gated: check the id, or log in "
            "with `hf auth login`"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise ModelInputError(f"{repo_id}: revision {revision!r} does not exist; check --revision") from None
    except hub_errors.LocalEntryNotFoundError:
        if required:
            raise offline_error(repo_id, filename, offline) from None
        return None
    except hub_errors.EntryNotFoundError:
        if required:
            raise ModelInputError(f"{repo_id}: has no {filename}") from None
        return None
    except (OSError, hub_errors.HfHubHTTPError) as error:
        raise ModelInputError(f"{repo_id}: cannot reach the hub ({type(error).__name__}); retry, or set "
                              "HF_HUB_OFFLINE=1 to use the local cache") from None


def offline_error(repo_id: str, filename: str, why: str | None = None) -> ModelInputError:
    """The one-line error for a file the hub cannot be asked for and the local cache does not hold."""
    return ModelInputError(
        f"{repo_id}: {filename} is not in the local Hugging Face cache and the hub is not used "
        f"({why or 'HF_HUB_OFFLINE or no network'}); go online once, or pass a local folder as --model"
    )


def commit_of(cached_path: Path) -> str | None:
    """hf_hub_download returns .../snapshots/<commit>/<file>: the commit the files were read at."""
    parts = cached_path.parts
    if "snapshots" in parts:
        return parts[parts.index("snapshots") + 1]
    return None


def shard_headers(repo_id: str, commit: str | None, files: list[str],
                  offline: str | None) -> dict[str, list[TensorEntry]]:
    """Each of ``files``' tensor entries: from the cached shard where it is there, else from the hub's headers."""
    from huggingface_hub import try_to_load_from_cache

    per_file: dict[str, list[TensorEntry]] = {}
    missing = []
    for name in files:
        cached = try_to_load_from_cache(repo_id, name, revision=commit)
        if isinstance(cached, str):
            per_file[name] = read_entries(Path(cached), name)
        else:
            missing.append(name)
    if missing and offline:
        raise offline_error(repo_id, missing[0], offline)
    if missing:
        per_file.update(_remote_headers(repo_id, commit, missing))
    return per_file


def _remote_headers(repo_id: str, commit: str | None, files: list[str]) -> dict[str, list[TensorEntry]]:
    """Shard headers over HTTP range requests (a few KB each): the weights are never downloaded."""
    from huggingface_hub import constants, get_safetensors_metadata

    if constants.HF_HUB_OFFLINE:
        raise offline_error(repo_id, files[0])
    try:
        metadata = get_safetensors_metadata(repo_id, revision=commit)
    except Exception as error:  # the hub client raises many types; all mean the same to the user
        raise ModelInputError(
            f"{repo_id}: cannot read shard headers from the hub ({type(error).__name__}: {error}); retry, or "
            "download the shards' headers into the cache"
        ) from None
    per_file = {}
    for name in files:
        file_meta = metadata.files_metadata.get(name)
        if file_meta is None:
            raise ModelInputError(f"{repo_id}: the hub has no header for shard {name}")
        header = {
            tensor_name: {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
            for tensor_name, info in file_meta.tensors.items()
        }
        per_file[name] = entries_from_header(header, name, f"{repo_id}/{name}")
    return per_file
