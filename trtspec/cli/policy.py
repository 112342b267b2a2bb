"""`trtspec serve --policy`: what a decided eval (or its policy file) says to serve, for
trtspec's own server and for trtllm-serve alike."""

from __future__ import annotations

import json
from pathlib import Path

import click

from trtspec.build.open import PLAIN
from trtspec.serve.slots import DraftPolicy


def policy_arg(value: str | None) -> str | None:
    """--policy: a registry reference as given (checked when it is fetched), else a file or
    folder that must exist."""
    if value is None or value.startswith("models:/"):
        return value
    return click.Path(exists=True).convert(value, None, None)


def policy_from_eval(folder: Path, method: str | None, notes: list[str],
                     label: str | None = None) -> tuple[str, DraftPolicy | None]:
    """(method, D by running requests) from ``folder``: a policy file
    (``schedules/trtspec-policy.yaml``, :func:`trtspec.analysis.policy.read_policy`), or a decided
    eval (its policy file, else :func:`trtspec.analysis.policy.serve_policy` of its decision.json;
    another ``method`` than the file's is derived from decision.json). Says in ``notes`` what the
    eval did not measure. ``label`` names it in messages [default: the path] (a registered
    version: its models:/ reference)."""
    from trtspec.analysis.policy import POLICY, read_policy, serve_policy
    from trtspec.analysis.schedules import SCHEDULES

    shown = label or str(folder)
    written = folder / SCHEDULES / POLICY
    if folder.is_file() or (written.is_file() and method is None):
        try:
            policy = read_policy(folder if folder.is_file() else written)
        except ValueError as e:
            raise click.UsageError(f"--policy {shown}: {e}") from None
        if method is not None and method != policy.method:
            raise click.UsageError(f"--policy {shown} serves {policy.method}: drop --method "
                                   f"{method}, or pass the decided eval's folder")
    else:
        path = folder / "decision.json"
        if not path.is_file():
            raise click.UsageError(f"--policy {shown}: no decision.json (run `trtspec decide "
                                   f"{folder}` first)")
        decision = json.loads(path.read_text())
        if any(v["condition"].startswith("endpoint/") for v in decision["verdicts"]):
            raise click.UsageError(f"--policy {shown}: an endpoint eval measured a server's "
                                   "own policy, not trtspec's methods: use an in-process eval")
        try:
            policy = serve_policy(decision, method)
        except ValueError as e:
            raise click.UsageError(f"--policy {shown}: --method {e}") from None
    if policy.text is None:
        notes.append(f"--policy {shown}: no condition is GO, so every request is decoded "
                     "plainly")
        return PLAIN, None
    measured = [c for c, _ in policy.schedule]
    notes.append(f"--policy {shown}: {policy.method} by running requests up to "
                 f"{measured[-1]}; more running requests are decoded plainly (not measured, "
                 "or past the crossover)")
    return policy.method, DraftPolicy.parse(policy.text)
