"""Result files are replaced whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trtspec.build.files import write_atomic


def test_a_failed_write_leaves_the_old_file_whole(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "summary.json"
    write_atomic(path, '{"old": 1}\n')

    def crash(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, '{"new": 2, "much": "longer"}\n')
    assert path.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left
    monkeypatch.undo()
    write_atomic(path, '{"new": 2}\n')
    assert path.read_text() == '{"new": 2}\n'
