"""Writing result files so that a kill never leaves half of one behind."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to a temporary sibling, fsync it, then rename it over ``path``: a reader
    sees the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
