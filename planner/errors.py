"""The project's exceptions: one base class, one subclass per kind of bad input.

The CLI maps every ``OffloadPlanError`` to a one-line message and a non-zero exit code; anything else is a
bug and keeps its traceback.
"""


def printable(text: object) -> str:
    """``text`` with every character that is not printable escaped (``\\n``, ``\\x1b``, ``\\ud800``).

    Messages echo what the user gave (paths, tensor names, profile names): a newline there must not split
    the one-line error, an escape sequence must not reach the terminal, and a lone surrogate (valid in JSON
    escapes, not in UTF-8) must not crash the print.
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value: object, max_chars: int = 80) -> str:
    """``repr(value)`` for a message: printable, and cut in the middle when long (a 10,000-element list echoed
    whole would bury the line's advice)."""
    return cut(printable(repr(value)), max_chars)


def cut(text: str, max_chars: int = 80) -> str:
    """``text`` cut in the middle to at most about ``max_chars`` characters."""
    if len(text) <= max_chars:
        return text
    half = (max_chars - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def brief(error: object, max_chars: int = 160) -> str:
    """The first line of ``error``'s text (a library's message, echoed in ours), cut to ``max_chars``: some
    libraries list every choice they know (transformers names ~200 config classes), which would bury the
    line's advice and break the ~300-character promise of every error line."""
    lines = str(error).strip().splitlines()
    text = printable(lines[0] if lines else type(error).__name__)
    return text if len(text) <= max_chars else text[:max_chars - 4] + " ..."


class OffloadPlanError(Exception):
    """Base class: a problem the user can fix. The message is one line: what is wrong and how to fix it.

    Whatever the message echoes, it is made printable here, so no raise site can break the one-line promise.
    """

    exit_code = 1

    def __init__(self, message: str = ""):
        super().__init__(printable(message))


class ModelInputError(OffloadPlanError):
    """The checkpoint cannot be read: missing file or shard, corrupt header, unknown layout."""

    exit_code = 2


class ProfileError(OffloadPlanError):
    """A hardware profile is unknown or malformed."""

    exit_code = 3


class PlanError(OffloadPlanError):
    """A plan file is malformed, or does not match its model or profile."""

    exit_code = 4


class InfeasibleError(OffloadPlanError):
    """No plan fits the budget, even with every layer offloaded."""

    exit_code = 5


class MeasuredOutOfMemoryError(InfeasibleError):
    """make --measure: a step did not fit the GPU memory the plan is made for, measured under that cap; the
    serving search takes its concurrency as not fitting."""


class UsageError(OffloadPlanError):
    """Command-line arguments that do not make sense together."""

    exit_code = 6


class RuntimeUnavailableError(OffloadPlanError):
    """The runtime cannot run here (no CUDA GPU, not enough GPU or pinned host memory)."""

    exit_code = 7


class PlanStaleError(PlanError):
    """A checked-in plan differs from what its recorded inputs give now (``check``): regenerate it."""

    exit_code = 8
