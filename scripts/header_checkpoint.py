"""Write a header-only checkpoint from a config.json: real tensor names, dtypes and shapes, no weights.

A thin wrapper around ``runtime.header_checkpoint.write_header_checkpoint`` (installed with the package; the
command ``offload-plan header-checkpoint CONFIG OUT`` calls the same function). OUT must be new, empty, or a
folder this tool wrote earlier: anything else is refused and left untouched. Needs torch and transformers.

    PYTHONPATH=. python3 scripts/header_checkpoint.py examples/llama-3.1-70b/config.json /tmp/llama-3.1-70b
"""

import argparse
import os
import sys
from pathlib import Path

from planner.errors import OffloadPlanError
from planner.source.header_checkpoint import DEFAULT_SHARD_BYTES
from planner.model.model_config import SAFETENSORS_DTYPES
from runtime.header_checkpoint import write_header_checkpoint


def parser() -> argparse.ArgumentParser:
    """CONFIG, OUT, --dtype, --shard-gib."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("config", type=Path, help="a config.json")
    result.add_argument("output", type=Path, help="folder to write: new, empty, or written by this tool before")
    result.add_argument("--dtype", choices=sorted(SAFETENSORS_DTYPES), default=None, help="default: the config's dtype")
    result.add_argument("--shard-gib", type=float, default=DEFAULT_SHARD_BYTES / 2**30, help="shard size (GiB)")
    return result


def main(argv: list[str] | None = None) -> int:
    """Write the checkpoint; bad input gets one line on stderr and the project's exit code."""
    args = parser().parse_args(argv)
    try:
        written = write_header_checkpoint(args.config, args.output, dtype=args.dtype,
                                          shard_bytes=int(args.shard_gib * 2**30))
    except OffloadPlanError as error:
        if os.environ.get("OFFLOAD_PLAN_DEBUG"):
            raise
        print(f"offload-plan: error: {error}", file=sys.stderr)
        return error.exit_code
    print(f"wrote {written.num_tensors} tensors in {written.num_shards} sparse shards to {written.folder}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
