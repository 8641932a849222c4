"""Writing and comparing output files (shared by apply and check)."""

from __future__ import annotations

import difflib
import importlib.metadata
import os
import tempfile
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "generated"


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def unified_diff(old: str, new: str, path: Path) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"a/{path.name}",
            f"b/{path.name}",
        )
    )


def package_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"
