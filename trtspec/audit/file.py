"""``audit.json``: where either audit keeps its result in an eval folder, and how ``decide`` and
the report read it back (the one file both kinds share)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trtspec.build.files import write_atomic

AUDIT = "audit.json"


def read_audit(eval_dir: str | Path) -> dict[str, Any] | None:
    path = Path(eval_dir) / AUDIT
    return json.loads(path.read_text()) if path.is_file() else None


def write_audit(eval_dir: str | Path, audit: dict[str, Any]) -> Path:
    return write_atomic(Path(eval_dir) / AUDIT, json.dumps(audit, indent=2) + "\n")
