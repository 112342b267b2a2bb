"""The `trtspec` command. Each command parses its options and makes one library call;
``main`` turns library errors into one line and exit code 2."""

from __future__ import annotations

import os
import sys

import click
from pydantic import ValidationError

from trtspec import __version__
from trtspec.cli import approve, distill, evaluation, generate, measure, serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """Measure whether speculative decoding pays off for your model, workload and GPU."""


for command in (generate.generate, measure.build, evaluation.eval_command, measure.audit,
                measure.decide, measure.prepare_data, measure.sync, measure.doctor,
                serve.serve, approve.approve, distill.distill):
    cli.add_command(command)


EXIT_ERROR, EXIT_BUG = 2, 3  # 0 and 1 are verdicts (all GO / not all GO), never errors


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors become one red line, never a traceback. Exit 2 for a problem with
    the input or the environment (recipe, folder, file, server), 3 for a bug in trtspec
    (TRTSPEC_DEBUG=1 shows its traceback); exit 1 stays reserved for verdicts."""
    try:
        cli.main(args=argv, prog_name="trtspec", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:  # one line too, with where to look (not click's usage block)
        where = e.ctx.command_path if e.ctx else "trtspec"
        click.secho(f"error: {_one_line(click.ClickException(e.format_message()))} (see "
                    f"'{where} --help')", fg="red", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (ValueError, ValidationError, RuntimeError, OSError) as e:
        if os.environ.get("TRTSPEC_DEBUG"):
            raise
        click.secho(f"error: {_one_line(e)}", fg="red", err=True)
        sys.exit(EXIT_ERROR)
    except Exception as e:
        if os.environ.get("TRTSPEC_DEBUG"):
            raise
        click.secho(f"internal error: {type(e).__name__}: {_one_line(e)} (a trtspec bug; "
                    "TRTSPEC_DEBUG=1 shows the traceback)", fg="red", err=True)
        sys.exit(EXIT_BUG)


def _one_line(e: BaseException) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
