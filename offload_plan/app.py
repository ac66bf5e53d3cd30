"""The ``offload-plan`` application: every command registered here, every error handled here, once.

- OffloadPlanError (bad input the user can fix): one line ``offload-plan: error: ...``, the error's exit code.
- A usage error (unknown option, missing argument): one line naming the command, exit 2.
- Anything else is a bug: one line naming the command and its input, exit 70 (EX_SOFTWARE).
OFFLOAD_PLAN_DEBUG=1 shows the traceback instead. Echoed input is escaped so it stays on one line.
"""

import os
import sys
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

try:  # typer 0.28+ carries its own copy of click, whose exceptions its parser raises
    from typer._click import exceptions as click_errors
except ImportError:  # older typer runs on click itself
    from click import exceptions as click_errors

from offload_plan import __version__
from offload_plan.commands import (calibrate, check, diff, export, header_checkpoint, make, profiles, run, show,
                                   trace)
from offload_plan.console import printable, say
from planner.errors import OffloadPlanError, brief

PROG_NAME = "offload-plan"
USAGE_EXIT_CODE = 2
BUG_EXIT_CODE = 70
INTERRUPTED_EXIT_CODE = 130
DEBUG_VARIABLE = "OFFLOAD_PLAN_DEBUG"


def error_line(message: str) -> None:
    """The one line every failure prints on stderr."""
    say(f"{PROG_NAME}: error: {printable(message)}")


def _debugging() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def _command_of(args: list[str], group: TyperGroup) -> str:
    """The command the user asked for (first word that names one), for messages."""
    return next((word for word in args if word in group.commands), PROG_NAME)


def _usage_line(error: click_errors.UsageError) -> str:
    message = error.format_message().rstrip(".")
    context = error.ctx
    if context is not None and context.parent is not None:
        return f"{context.info_name}: {message} (see {PROG_NAME} {context.info_name} -h)"
    return f"{message} (see {PROG_NAME} -h)"


class OffloadPlanGroup(TyperGroup):
    """A typer group whose ``main`` maps every failure to one line on stderr and an exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Parse ``args`` and run the command; exit (or return, without standalone_mode) with its code."""
        args = list(sys.argv[1:] if args is None else args)
        code = self._guarded(args, PROG_NAME, extra)  # one name, however started (script, -m, tests)
        if standalone_mode:
            sys.exit(code)
        return code

    def _guarded(self, args: list[str], prog_name: str, extra: dict) -> int:
        try:
            with self.make_context(prog_name, list(args), **extra) as context:
                self.invoke(context)
            return 0
        except typer.Exit as done:  # --help, --version, typer.Exit
            return done.exit_code
        except click_errors.UsageError as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # no command at all: click's help text (click 8.2+)
                error.show()
                return error.exit_code
            error_line(_usage_line(error))
            return USAGE_EXIT_CODE
        except click_errors.ClickException as error:
            error_line(error.format_message())
            return error.exit_code
        except (KeyboardInterrupt, typer.Abort):
            say(f"{PROG_NAME}: interrupted")
            return INTERRUPTED_EXIT_CODE
        except BrokenPipeError:
            sys.stderr.close()  # a reader that left early (| head): nothing more to say
            return 1
        except OffloadPlanError as error:
            if _debugging():
                raise
            error_line(str(error))
            return error.exit_code
        except Exception as error:
            if _debugging():
                raise
            error_line(
                f"{_command_of(args, self)} failed unexpectedly ({type(error).__name__}: {brief(error, 80)}) with "
                f"input {brief(repr(' '.join(args)), 60)}; this is a bug, rerun with {DEBUG_VARIABLE}=1 and report it "
                "with the traceback"
            )
            return BUG_EXIT_CODE


app = typer.Typer(
    cls=OffloadPlanGroup,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Plan, explain and apply how a model's weights are split between GPU memory and host memory.",
)

for _name, _function in (
    ("make", make.make),
    ("show", show.show),
    ("run", run.run),
    ("calibrate", calibrate.calibrate),
    ("profiles", profiles.profiles),
    ("check", check.check),
    ("diff", diff.diff),
    ("export", export.export),
    ("header-checkpoint", header_checkpoint.header_checkpoint),
    ("trace", trace.trace),
):
    app.command(_name)(_function)


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"{PROG_NAME} {__version__}\n")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_print_version, is_eager=True,
                                                     help="Print the version and exit.")] = None,
):
    """Plan, explain and apply how a model's weights are split between GPU memory and host memory."""


def main() -> None:
    """Entry point of the ``offload-plan`` script and of ``python -m offload_plan``: the process runs one command."""
    make.ONE_COMMAND_PROCESS = True
    app()
