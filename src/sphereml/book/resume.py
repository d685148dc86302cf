"""Resumable chapter runs: each finished training saved, and restored instead of trained when the run is repeated.

With ``SPHEREML_RESUME=<folder>`` every training a chapter makes through ``ch.fit`` or ``ch.fit_seeds`` is saved, once
it ends, to ``<folder>/<chapter>/<profile>/<n>-<key>.pt`` (the n-th training of the run, the first digits of its
:func:`training_key`; a tiny run's profile is ``gpu-tiny``), never over another run's: the trained weights, the
histories, what its callbacks and regularisers recorded, the modules' train or eval modes and the state of torch's
random generators.  A later run of the same chapter with the same folder restores every training whose description
matches (:func:`training_key`) and trains the rest, so a run stopped by a time limit (a GPU session's, a cluster's)
goes on where it stopped.  On the CPU every result after a restored training is the one the uninterrupted run
computes, to the bit (``tests/test_resume.py`` runs chapters both ways). On a GPU, where cuDNN's benchmark mode lets
two runs differ at rounding, a training that starts from weights an earlier computation left (a copy of a recalibrated
network) may not match and is trained again.  Trainings saved on another machine are restored too, and
``metrics.json`` says which (``restored``: how many, how long they took when trained, and on what device and torch
version).

Note [what a restored training must match]
    The key of a training is a digest of: the chapter, its profile, device type and parameters; the training's place
    in the run (its index); the models' modules (classes and settings) and initial weights; the training data (its
    class and size, and the contents of its tensors); the seeds and every setting of the training, described by
    :func:`describe` (objects by class and attributes, functions by their compiled code, constants and closures). A
    change to library code that a training calls (a loss inside a module, say) is not seen: such a change needs an
    empty folder.  A training whose callbacks keep state without a ``state_dict`` (a plain function that appends to a
    list) is trained every time, never saved.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import numbers
import os
import pickle
import time
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import _io, distributed
from ..train import History

__all__ = ["ENV", "TrainingCache", "training_key", "describe"]

ENV = "SPHEREML_RESUME"  # the folder of saved trainings; unset: nothing saved or restored
FORMAT = 1  # of the saved files: a new format is a new key
_SIMPLE = (bool, int, float, str, type(None))
_DEPTH = 4  # how deep describe follows objects inside objects
_MAX_DEPTH = 12  # and anything at all


def describe(value, depth: int = 0):
    """A JSON-able description of a training setting that changes when the setting does: simple values and numbers
    as they are, tensors by shape, dtype and a digest of their values, functions by their code, constants and
    closures, modules by class, other objects by class and attributes (followed :data:`_DEPTH` levels deep)."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (enum.Enum, os.PathLike)):
        return str(value)
    if depth > _MAX_DEPTH:  # a structure this deep (or a cycle through functions or containers)
        return {"class": type(value).__qualname__}
    if isinstance(value, np.ndarray):
        return describe(torch.from_numpy(np.ascontiguousarray(value)), depth)
    if isinstance(value, numbers.Number):  # NumPy's scalars
        return repr(float(value) if isinstance(value, numbers.Real) else complex(value))
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype), "digest": _digest([value])}
    if isinstance(value, (list, tuple)):
        return [describe(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):  # in an order that does not depend on the process's hash seed
        return sorted(json.dumps(describe(v, depth + 1), sort_keys=True) for v in value)
    if isinstance(value, torch.utils.data.Dataset):
        return _data_digest(value)
    if hasattr(value, "resume_description"):  # an object that says what identifies it (a Chapter: its name)
        return value.resume_description()
    if isinstance(value, dict):
        return {str(k): describe(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, nn.Module):
        return {"module": type(value).__qualname__}
    if callable(value) and (isinstance(value, functools.partial) or hasattr(value, "__qualname__")):
        return _describe_callable(value, depth)
    own = {"class": type(value).__qualname__}
    if depth < _DEPTH and hasattr(value, "__dict__"):
        own.update({k: describe(v, depth + 1) for k, v in sorted(vars(value).items())
                    if not k.startswith("_") and not isinstance(v, (nn.Module, torch.Generator))})
    elif dataclasses.is_dataclass(value) and depth < _DEPTH:
        own.update({f.name: describe(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)})
    return own


def _describe_callable(value, depth: int):
    """:func:`describe` of a partial, a bound method, a function (its code and what it closes over), or a class."""
    if isinstance(value, functools.partial):
        return {"partial": describe(value.func, depth + 1), "args": describe(value.args, depth + 1),
                "keywords": describe(value.keywords, depth + 1)}
    if hasattr(value, "__func__") and hasattr(value, "__self__"):  # a bound method: the function and its object
        return {"method": describe(value.__func__, depth + 1), "of": describe(value.__self__, depth + 1)}
    if hasattr(value, "__code__"):
        cells = [_contents(c) for c in value.__closure__ or ()]
        return {"function": f"{value.__module__}.{value.__qualname__}", "code": _code(value.__code__),
                "closure": describe([c for c in cells if not isinstance(c, nn.Module)], depth + 1),
                "defaults": describe(list(value.__defaults__ or ()), depth + 1),
                "keyword_defaults": describe(value.__kwdefaults__ or {}, depth + 1)}
    return {"callable": f"{getattr(value, '__module__', '')}.{value.__qualname__}"}  # a class or a builtin


def _code(code) -> str:
    """A digest of a function's bytecode and constants, nested functions' code included (not its line numbers)."""
    h = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        h.update((_code(const) if hasattr(const, "co_code") else json.dumps(describe(const))).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:16]


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
        if t.numel():
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy
    return h.hexdigest()[:16]


_DATA_DIGESTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # data set -> its description, made once


def _data_digest(data) -> dict:
    """The training data's class, size and contents (its tensors and settings, :func:`describe`), computed once
    per data set and again when one of its tensors changes in place (Fashion-MNIST's 188 MB: 0.16 s here)."""
    versions = [t._version for t in getattr(data, "tensors", ())]  # a tensor changed in place: digested again
    try:
        known, description = _DATA_DIGESTS[data]
        if known == versions:
            return description
    except (KeyError, TypeError):
        pass
    description = {"class": type(data).__qualname__, "size": len(data),
                   "contents": describe({k: v for k, v in vars(data).items() if not k.startswith("_")}, 1)
                   if hasattr(data, "__dict__") else None}
    try:
        _DATA_DIGESTS[data] = (versions, description)
    except TypeError:  # not weakly referenceable: described every time
        pass
    return description


def training_key(identity: dict, index: int, models, train_data, seeds, settings: dict) -> str:
    """The digest that a saved training must match to be restored (Note [what a restored training must match])."""
    description = {
        "format": FORMAT, "run": identity, "index": index, "seeds": list(seeds), "data": _data_digest(train_data),
        "models": [{"modules": _modules(m), "start": _digest(m.state_dict().values())} for m in models],
        "settings": describe(settings),
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def _modules(model: nn.Module) -> list:
    """Each module of ``model``: its name, class and public settings (a margin head's m, an angular function)."""
    return [[name, type(module).__qualname__,
             describe({k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}, 2)]
            for name, module in model.named_modules()]


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

    def __init__(self, folder: str | os.PathLike, identity: dict, machine: dict):
        self.folder = Path(folder)
        self.identity = identity
        self.machine = machine  # what the trainings are trained on: device name, torch version
        self.index = 0  # trainings asked for so far in this run
        self.restored: list[dict] = []  # the fits records of the trainings restored
        self.trained_on: set[str] = set()  # the machines those were trained on

    @classmethod
    def from_env(cls, chapter: str, identity: dict, machine: dict) -> "TrainingCache | None":
        folder = os.environ.get(ENV, "")
        if not folder or distributed.is_distributed():
            return None
        profile = identity["profile"] + ("-tiny" if identity["tiny"] else "")
        return cls(Path(folder) / chapter / profile, identity, machine)

    def next_key(self, models, train_data, seeds, settings: dict) -> tuple[Path, str]:
        """The file and key of the run's next training."""
        self.index += 1
        key = training_key(self.identity, self.index, models, train_data, seeds, settings)
        return self.folder / f"{self.index:04d}-{key[:16]}.pt", key

    def restore(self, path: Path, key: str, models, callbacks, regularizers, device) -> tuple[list, list] | None:
        """Load a saved training into ``models`` (and its callbacks and regularisers) when ``path`` holds ``key``;
        returns (histories, fits records), or None when there is nothing to restore."""
        if not path.exists() or _callback_states(callbacks) is None:
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError):  # unreadable: trained again
            return None
        if saved.get("key") != key:
            return None
        for model, state, modes, fresh in zip(models, saved["models"], saved["modes"], saved["stats_fresh"]):
            model.to(device).load_state_dict(state)
            for module, mode in zip(model.modules(), modes):
                module.training = mode
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
        self.trained_on.add(f"{saved['machine']['device_name']}, torch {saved['machine']['torch']}")
        return [History(**h) for h in saved["histories"]], fits

    def save(self, path: Path, key: str, models, histories, fits, callbacks, regularizers) -> None:
        """Save a finished training (nothing when a callback keeps state it cannot save)."""
        states = _callback_states(callbacks)
        if states is None:
            return
        _io.save_torch({
            "key": key, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": self.machine,
            "models": [{k: v.detach().cpu() for k, v in m.state_dict().items()} for m in models],
            "modes": [[module.training for module in m.modules()] for m in models],
            "stats_fresh": [bool(getattr(m, "_sphereml_stats_fresh", False)) for m in models],
            "histories": [h.to_dict() for h in histories], "fits": fits, "callbacks": states,
            "regularizers": [reg.state_dict() if hasattr(reg, "state_dict") else None for reg in regularizers],
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        }, path)

    def summary(self) -> dict:
        """What ``metrics.json`` records of the restored trainings."""
        return {"trainings": len(self.restored), "seconds": round(sum(fit["seconds"] for fit in self.restored), 1),
                "trained_on": sorted(self.trained_on)}
