"""Where output goes: data and human reports on stdout, progress, warnings and errors on stderr.

stdout carries what a command is run for (a plan, JSON, show's report, diff's and profiles' tables, run's
measurements), so ``offload-plan show plan.yaml > report.txt`` keeps it; stderr carries progress, outcome
lines, notes and warnings. export's stdout is its flags alone, so ``$(offload-plan export ...)`` pastes them
into an engine's command line; its notes and restated prediction go to stderr.
"""

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
