"""Atomic file writers: a reader (or a resumed run) never sees a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def _atomic_path(path: Path):
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_json(obj, path: str | os.PathLike) -> Path:
    """Write ``obj`` as indented JSON atomically (tensors and numbers with ``.item()`` are converted)."""
    path = Path(path)
    text = json.dumps(obj, indent=2, sort_keys=True, default=_jsonable)
    with _atomic_path(path) as tmp:
        Path(tmp).write_text(text)
    return path


def save_torch(obj, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` atomically (checkpoints)."""
    path = Path(path)
    with _atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return path


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} as JSON")
