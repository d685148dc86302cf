"""Atomic file writers: a reader (or a resumed run) never sees a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def atomic_path(path: Path):
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    The temporary is a hidden file named after the target and the writing process.  A process killed
    mid-write (SIGKILL runs no cleanup) leaves its temporary behind; the next write to the same target
    removes those of processes that no longer exist.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _remove_orphans(path: Path) -> None:
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_json(obj, path: str | os.PathLike) -> Path:
    """Write ``obj`` as indented JSON atomically (tensors and numbers with ``.item()`` are converted)."""
    path = Path(path)
    text = json.dumps(obj, indent=2, sort_keys=True, default=_jsonable)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
    return path


def save_torch(obj, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` atomically (checkpoints)."""
    path = Path(path)
    with atomic_path(path) as tmp:
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
