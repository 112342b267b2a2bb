"""`trtspec approve`: register a decided eval as the approved serving policy of its recipe."""

from __future__ import annotations

from pathlib import Path

import click

from trtspec.cli.evaluation import ENGINES_HELP, engines_root


@click.command()
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--reviewer", required=True, help="who approves it (recorded on the version)")
@click.option("--note", default=None, help="why, or anything a later reader should know")
@click.option("--mlflow-uri", default=None,
              help="tracking URI [default: the eval's, $MLFLOW_TRACKING_URI, sqlite:///mlflow.db]")
@click.option("--engines", default=None, type=click.Path(), help=ENGINES_HELP)
def approve(eval_dir: str, reviewer: str, note: str | None, mlflow_uri: str | None,
            engines: str | None) -> None:
    """Register EVAL_DIR's decision as a new version of the registered model named after its
    recipe, with the alias `approved`. Refused (exit 2, nothing registered) without a GO
    verdict, with a failed or missing required exactness audit, when the build changed since
    the eval, or when the eval was never decided."""
    from trtspec.report.approve import ALIAS
    from trtspec.report.approve import approve as register

    root, _ = engines_root(Path(eval_dir) / "recipe.yaml", engines)
    done = register(eval_dir, reviewer, note, mlflow_uri, root)
    click.echo(f"approved: registered model {done.name} version {done.version} (alias {ALIAS}) "
               f"at {done.uri}, run {done.run_id}")
    click.echo(f"  verdicts: {done.tags['verdicts']}; audit: {done.tags['audit']}")
    click.echo(f"  policy: {done.tags['policy']}; serve it with `trtspec serve RECIPE --policy "
               f"models:/{done.name}@{ALIAS}` (MLFLOW_TRACKING_URI={done.uri})")
