"""Where output goes: data and human reports on stdout, progress, warnings and errors on stderr."""

import sys

from rich.console import Console

# A pipe or file gets 120 columns (rich's default of 80 breaks the timeline); a terminal keeps its own width.
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 120)


def printable(text: str) -> str:
    """``text`` with control characters (newlines, escapes) written as escapes: one line, no terminal tricks."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def say(message: str) -> None:
    """One line for people on stderr (progress, outcome), taken literally: no rich markup."""
    stderr.print(message, markup=False, soft_wrap=True)


def warn(message: str) -> None:
    """``offload-plan: warning: ...`` on stderr."""
    say(f"offload-plan: warning: {printable(message)}")
