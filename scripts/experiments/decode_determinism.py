"""Where does eager decode stop being reproducible? Run one decode step twice from the same state and name the
first module whose inputs were equal and whose outputs were not.

The decode benchmark found the all-resident Qwen3-8B-shaped model's eager step giving different logits on
two runs from the same cache and ids (batch 16 and up), so bitwise comparisons there need a known cause.
Each setting below is tried in turn: torch's defaults, deterministic algorithms, and each SDPA backend.

    PYTHONPATH=. python3 scripts/experiments/decode_determinism.py --batch 16      # on a machine with a GPU
"""

import os
from contextlib import nullcontext

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs it before CUDA starts

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from runtime.timing import random_ids  # noqa: E402
from scripts.benchmarking import CONTEXT_TOKENS, checkpoint_parser, log, write_random_checkpoint  # noqa: E402
from runtime.graph import DecodeLoop, cache_tokens_for  # noqa: E402
from runtime.load import build_model  # noqa: E402
SETTINGS = {
    "defaults": (False, None),
    "deterministic algorithms": (True, None),
    "deterministic + SDPA math": (True, SDPBackend.MATH),
    "deterministic + SDPA efficient": (True, SDPBackend.EFFICIENT_ATTENTION),
    "deterministic + SDPA cuDNN": (True, SDPBackend.CUDNN_ATTENTION),
}


def first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((first_tensor(item) for item in value if first_tensor(item) is not None), None)
    return getattr(value, "logits", None)


def recorded_step(model, loop: DecodeLoop) -> list[tuple[str, torch.Tensor | None, torch.Tensor | None]]:
    """(module name, first input, first output) of every module, in the order their forwards finished."""
    records, hooks = [], []
    for name, module in model.named_modules():
        def hook(module, args, kwargs, output, name=name):
            inputs = first_tensor(args) if args else first_tensor(list(kwargs.values()))
            out = first_tensor(output)
            records.append((name, None if inputs is None else inputs.clone(), None if out is None else out.clone()))
        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    saved = loop.save_state()
    with torch.inference_mode():
        loop._step(0, join=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    loop.restore_state(saved)
    for hook in hooks:
        hook.remove()
    return records


def first_culprit(first, second, modules: dict) -> str:
    """The first module whose inputs agree and outputs differ, or where the runs first diverge."""
    for (name, in_a, out_a), (_, in_b, out_b) in zip(first, second):
        same_in = in_a is None or torch.equal(in_a, in_b)
        same_out = out_a is None or torch.equal(out_a, out_b)
        if same_in and not same_out:
            diff = (out_a.float() - out_b.float()).abs().max().item()
            return f"{name or '(model)'} ({type(modules[name]).__name__}): same input, output differs by {diff:.3g}"
        if not same_in:
            return f"{name}: inputs already differ (cause not inside a module)"
    return "none: both runs equal bit for bit"


def main() -> None:
    parser = checkpoint_parser("/tmp/decode-determinism")  # --out is unused: the verdicts are printed
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    args = parser.parse_args()
    write_random_checkpoint(args.config, args.checkpoint)
    model = build_model(str(args.checkpoint), None).cuda()
    for batch in args.batch:
        loop = DecodeLoop(model, batch=batch, max_cache_tokens=cache_tokens_for(CONTEXT_TOKENS),
                          device=torch.device("cuda"), steps_per_call=1)
        loop.prefill(random_ids(model, (batch, CONTEXT_TOKENS), torch.device("cuda"), seed=batch))
        for setting, (deterministic, backend) in SETTINGS.items():
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            try:
                with sdpa_kernel(backend) if backend is not None else nullcontext():
                    verdict = first_culprit(recorded_step(model, loop), recorded_step(model, loop),
                                            dict(model.named_modules()))
            except RuntimeError as error:
                verdict = f"not run: {str(error).splitlines()[0][:120]}"
            log(f"batch {batch}, {setting}: {verdict}")
        del loop


if __name__ == "__main__":
    main()
