"""Resumable chapter runs: each finished training saved, and restored instead of trained when the run is repeated.

With ``SPHEREML_RESUME=<folder>`` every training a chapter makes through ``ch.fit`` or ``ch.fit_seeds`` is saved,
once it ends, to ``<folder>/<chapter>/<n>.pt`` (the n-th training of the run): the trained weights, the histories,
what its callbacks and regularisers recorded, and the state of torch's random generators.  A later run of the same
chapter with the same folder restores every training whose description matches (:func:`training_key`) and trains
the rest, so a run stopped by a time limit (a GPU session's, a cluster's) goes on where it stopped, and every result
after a restored training is the one the uninterrupted run computes (``tests/test_resume.py`` runs a chapter both
ways).  The chapter's ``metrics.json`` says how many trainings were restored and how long they took when trained.

Note [what a restored training must match]
    The key of a training is a digest of: the chapter, its profile, device type and parameters; the training's
    place in the run (its index); the models' classes and initial weights; the training data (sizes, and its
    tensors' contents); the seeds and every setting of the training, objects by their class and simple attributes.
    A change to the code of a training that none of these shows (the loss inside a library function, say) is not
    seen: such a change needs an empty folder.  A training whose callbacks keep state without a ``state_dict``
    (a plain function that appends to a list) is trained every time, never saved.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from .. import _io, distributed
from ..train import History

__all__ = ["ENV", "TrainingCache", "training_key", "describe"]

ENV = "SPHEREML_RESUME"  # the folder of saved trainings; unset: nothing saved or restored
_SIMPLE = (bool, int, float, str, type(None))


def describe(value, depth: int = 0):
    """A JSON-able description of a training setting: simple values as they are, tensors by shape, dtype and a
    digest, modules and other objects by class (and, near the top, their simple attributes), functions by name."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype), "digest": _digest([value])}
    if isinstance(value, (list, tuple)):
        return [describe(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, nn.Module):
        return {"module": type(value).__qualname__}
    if isinstance(value, functools.partial):
        return {"partial": describe(value.func, depth + 1), "args": describe(value.args, depth + 1),
                "keywords": describe(value.keywords, depth + 1)}
    if callable(value) and hasattr(value, "__qualname__"):  # a function: its name and its closure's simple values
        cells = [_contents(c) for c in getattr(value, "__closure__", None) or ()]
        return {"function": f"{value.__module__}.{value.__qualname__}",
                "closure": [c for c in cells if isinstance(c, _SIMPLE)],
                "defaults": [d for d in getattr(value, "__defaults__", None) or () if isinstance(d, _SIMPLE)]}
    own = {"class": type(value).__qualname__}
    if depth < 2 and hasattr(value, "__dict__"):
        own.update({k: describe(v, depth + 1) for k, v in sorted(vars(value).items()) if _simple(v)})
    return own


def _simple(value) -> bool:
    """A simple value, or a list or tuple of them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return all(isinstance(x, _SIMPLE) for x in items)


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _data_digest(data) -> dict:
    tensors = getattr(data, "tensors", None)
    return {"class": type(data).__qualname__, "size": len(data),
            "tensors": _digest(tensors) if tensors is not None else None}


def training_key(identity: dict, index: int, models, train_data, seeds, settings: dict) -> str:
    """The digest that a saved training must match to be restored (Note [what a restored training must match])."""
    description = {
        "run": identity, "index": index, "seeds": list(seeds), "data": _data_digest(train_data),
        "models": [{"class": type(m).__qualname__, "start": _digest(m.state_dict().values())} for m in models],
        "settings": describe(settings),
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()


def _callback_states(callbacks) -> list | None:
    """Each callback's ``state_dict()``, or None when one keeps state without one (then nothing is saved)."""
    states = []
    for calls in callbacks:
        if not all(hasattr(cb, "state_dict") for cb in calls):
            return None
        states.append([cb.state_dict() for cb in calls])
    return states


class TrainingCache:
    """The saved trainings of one chapter's run (see the module's docstring); ``None`` from :meth:`from_env` when
    ``SPHEREML_RESUME`` is unset or the run is distributed (each rank would write)."""

    def __init__(self, folder: str | os.PathLike, identity: dict):
        self.folder = Path(folder)
        self.identity = identity
        self.index = 0  # trainings asked for so far in this run
        self.restored: list[dict] = []  # the fits records of the trainings restored

    @classmethod
    def from_env(cls, chapter: str, identity: dict) -> "TrainingCache | None":
        folder = os.environ.get(ENV, "")
        if not folder or distributed.is_distributed():
            return None
        return cls(Path(folder) / chapter, identity)

    def next_key(self, models, train_data, seeds, settings: dict) -> tuple[Path, str]:
        """The file and key of the run's next training."""
        self.index += 1
        key = training_key(self.identity, self.index, models, train_data, seeds, settings)
        return self.folder / f"{self.index:04d}.pt", key

    def restore(self, path: Path, key: str, models, callbacks, regularizers, device) -> tuple[list, list] | None:
        """Load a saved training into ``models`` (and its callbacks and regularisers) when ``path`` holds ``key``;
        returns (histories, fits records), or None when there is nothing to restore."""
        if not path.exists():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved["key"] != key or _callback_states(callbacks) is None:
            return None
        for model, state in zip(models, saved["models"]):
            model.to(device).load_state_dict(state)
        for model, fresh in zip(models, saved["stats_fresh"]):
            model._sphereml_stats_fresh = fresh  # whether training ended on recalibrated statistics
        for calls, states in zip(callbacks, saved["callbacks"]):
            for cb, state in zip(calls, states):
                cb.load_state_dict(state)
        for reg, state in zip(regularizers, saved["regularizers"]):
            if state is not None:
                reg.load_state_dict(state)
        torch.set_rng_state(saved["torch_rng"])
        if saved["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda_rng"])
        fits = [{**fit, "restored": True} for fit in saved["fits"]]
        self.restored.extend(fits)
        return [History(**h) for h in saved["histories"]], fits

    def save(self, path: Path, key: str, models, histories, fits, callbacks, regularizers) -> None:
        """Save a finished training (nothing when a callback keeps state it cannot save)."""
        states = _callback_states(callbacks)
        if states is None:
            return
        _io.save_torch({
            "key": key, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "models": [{k: v.detach().cpu() for k, v in m.state_dict().items()} for m in models],
            "stats_fresh": [bool(getattr(m, "_sphereml_stats_fresh", False)) for m in models],
            "histories": [h.to_dict() for h in histories], "fits": fits, "callbacks": states,
            "regularizers": [reg.state_dict() if hasattr(reg, "state_dict") else None for reg in regularizers],
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        }, path)

    def summary(self) -> dict:
        """What ``metrics.json`` records of the restored trainings."""
        return {"trainings": len(self.restored),
                "seconds": round(sum(fit["seconds"] for fit in self.restored), 1)}
