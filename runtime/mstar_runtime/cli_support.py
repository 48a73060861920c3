"""What `mstarc` and `mstar-run` share on top of click: the version line, and running a click
command with M*'s exit codes and diagnostics format.

    sys.exit(run_command(command, "mstar-run", argv))

Exit codes: what the command returns (0 success, 1 a user error); 2 bad usage, printed as
the usage line and `PROG: error: MESSAGE` (raised as `SystemExit(2)`, as argparse did, so
callers that pass `argv` see the same); 3 an internal error, a bug: the traceback, then
`PROG: internal error: ...`; 130 after Ctrl-C. Shell completion is click's:
`eval "$(_MSTAR_RUN_COMPLETE=bash_source mstar-run)"` (zsh_source, fish_source).

Imports neither torch nor the compiler: both command lines use it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from typing import Any

import click

EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 3, 130
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def version() -> str:
    """The installed package's version and the plan schema this code reads and writes."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from mstar_runtime.plan.planfile import SCHEMA_MAJOR, SCHEMA_MINOR

    try:
        v = dist_version("mstar")
    except PackageNotFoundError:  # run from a source tree that was never installed
        v = "unknown (not installed)"
    return f"{v} (plan schema {SCHEMA_MAJOR}.{SCHEMA_MINOR})"


def version_option(prog: str) -> Any:
    """`--version`: `PROG VERSION (plan schema M.N)`, computed only when asked."""
    def show(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(f"{prog} {version()}")
            ctx.exit(0)

    return click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=show,
                        help="Print the version and the plan schema, then exit.")


def usage_error(e: click.UsageError, prog: str) -> None:
    """Print a usage error as `Usage: ...` then `PROG: error: MESSAGE`, and exit 2."""
    if isinstance(e, click.exceptions.NoArgsIsHelpError):  # a bare `mstarc`: the help, as a usage error
        click.echo(e.format_message(), err=True)
        raise SystemExit(EXIT_USAGE)
    if e.ctx is not None:
        click.echo(e.ctx.get_usage(), err=True)
        click.echo(f"Try '{e.ctx.command_path} --help' for help.", err=True)
    click.echo(f"{prog}: error: {e.format_message()}", err=True)
    raise SystemExit(EXIT_USAGE)


def run_command(command: click.Command, prog: str, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`) and run `command`; its exit status (see the module
    docstring). A usage error raises `SystemExit(2)`."""
    try:
        rv = command.main(args=list(argv) if argv is not None else None, prog_name=prog, standalone_mode=False)
    except click.UsageError as e:
        usage_error(e, prog)
        raise AssertionError("unreachable") from None
    except click.ClickException as e:  # click's own failures that are not usage (a file it could not open)
        click.echo(f"{prog}: error: {e.format_message()}", err=True)
        return e.exit_code
    except click.Abort:  # Ctrl-C while click parsed
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug: say so, with the traceback to report
        traceback.print_exc()
        print(f"{prog}: internal error: {type(e).__name__}: {e} (this is a bug in M*, not in your input; the "
              "traceback above says where)", file=sys.stderr)
        return EXIT_INTERNAL
    return int(rv) if isinstance(rv, int) else 0


__all__ = ["CONTEXT_SETTINGS", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_USAGE", "run_command", "usage_error",
           "version", "version_option"]
