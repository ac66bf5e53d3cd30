"""offload-plan's command line: ``offload-plan COMMAND`` or ``python -m offload_plan COMMAND``.

``app`` registers every command (one module each under ``commands/``); ``runtime_seam`` is the one door to
the PyTorch runtime, so an install without torch can still plan, show, check, diff and export.
"""

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _version() -> str:
    """The installed distribution's version, else pyproject.toml's (a checkout run with PYTHONPATH)."""
    try:
        return version("offload-plan")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return found.group(1) if found else "unknown"


__version__ = _version()
