"""Is the sampler exact? A chi-square audit of speculative output against the target's exact
distribution, in process (``inprocess``: the built models, through the serving scheduler) or
against a running endpoint (``endpoint``: first tokens of the speculating server against the
plain one). Both write one ``audit.json`` beside the eval's records, which ``decide`` gates on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

AUDIT = "audit.json"


def read_audit(eval_dir: str | Path) -> dict[str, Any] | None:
    path = Path(eval_dir) / AUDIT
    return json.loads(path.read_text()) if path.is_file() else None
