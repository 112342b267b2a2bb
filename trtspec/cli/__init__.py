"""The `trtspec` command. Each command parses its options and makes one library call;
``main`` turns library errors into one line and exit code 2."""

from __future__ import annotations

import os
import sys

import click
from pydantic import ValidationError

from trtspec import __version__
from trtspec.cli import generate, measure


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """Measure whether speculative decoding pays off for your model, workload and GPU."""


for command in (generate.generate, measure.build, measure.eval_command, measure.audit,
                measure.decide, measure.prepare_data, measure.sync, measure.doctor):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Entry point: library errors become one red line and exit code 2, never a traceback."""
    try:
        cli.main(args=argv, prog_name="trtspec", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (ValueError, ValidationError, RuntimeError, FileExistsError) as e:
        if os.environ.get("TRTSPEC_DEBUG"):
            raise
        message = str(e).splitlines()[0] if not isinstance(e, ValidationError) else (
            "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()))
        click.secho(f"error: {message}", fg="red", err=True)
        sys.exit(2)
