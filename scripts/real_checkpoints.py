"""Write header-only checkpoints with the real tensor names, dtypes and shapes of public models.

Each ``plans/models/NAME/config.json`` is the model's public config.json. From it this script writes
``.cache/checkpoints/NAME/``: the config, ``model.safetensors.index.json`` and sparse shards (headers only: the
disk holds a few MB, the files have their full sizes). Names, dtypes and shapes are each release's own, as
``planner.source.release_format`` writes them for ``offload-plan header-checkpoint`` (one tensor per expert, FP8 block
scales, MXFP4 blocks and scales, DeepSeek-V3's multi-token-prediction layer at index ``num_hidden_layers``).

The same configs give the same bytes (sorted names, fixed shard size), so plans made from these folders are
reproducible; ``offload-plan check`` recomputes their fingerprints. The per-family tables write checkpoints only:
the planner's cost model reads names, never an architecture table.

    PYTHONPATH=. python3 scripts/real_checkpoints.py                 # every model under plans/models
    PYTHONPATH=. python3 scripts/real_checkpoints.py mixtral-8x7b    # one of them

Each folder is written as ``planner.source.header_checkpoint`` writes: a folder this script did not make is refused,
never replaced. (With the package installed, ``PYTHONPATH=.`` is not needed.)
"""

import argparse
import json
import sys
from pathlib import Path

from planner.errors import OffloadPlanError, UsageError
from planner.source.header_checkpoint import write_checkpoint_folder
from planner.source.release_format import release_specs

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "plans" / "models"
OUTPUT_DIR = REPO_ROOT / ".cache" / "checkpoints"
SHARD_BYTES = 5 * 2**30


def tensor_specs(config: dict) -> list:
    """(name, dtype, shape) of every tensor of the release checkpoint, sorted by name."""
    return release_specs(config)


def write_checkpoint(name: str, output_dir: Path = OUTPUT_DIR) -> Path:
    """Write .cache/checkpoints/NAME from plans/models/NAME/config.json, replacing an earlier run's folder."""
    config_path = MODELS_DIR / name / "config.json"
    config = json.loads(config_path.read_text())
    folder = output_dir / name
    write_checkpoint_folder(config_path=config_path, specs=tensor_specs(config), out_dir=folder,
                            shard_bytes=SHARD_BYTES)
    return folder


def parser() -> argparse.ArgumentParser:
    """NAME ..., --output."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("names", nargs="*", help="models under plans/models (default: all)")
    result.add_argument("--output", type=Path, default=OUTPUT_DIR, help="where to write (default: .cache/checkpoints)")
    return result


def model_names(names: list[str]) -> list[str]:
    """The names asked for, or every model under plans/models; an unknown name is a one-line error."""
    known = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UsageError(f"no plans/models/{unknown[0]}/config.json; choose from {', '.join(known)}")
    return names or known


def main(argv: list[str] | None = None) -> int:
    """Write each model's folder; bad input gets one line on stderr and the project's exit code."""
    args = parser().parse_args(argv)
    try:
        for name in model_names(args.names):
            print(f"wrote {write_checkpoint(name, args.output)}")
    except OffloadPlanError as error:
        print(f"offload-plan: error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
