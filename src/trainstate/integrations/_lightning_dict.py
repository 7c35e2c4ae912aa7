"""Lightning's checkpoint dict <-> what a trainstate checkpoint holds.

The dict Lightning builds is mostly tensors and plain values, which a checkpoint holds as they are. A few
values are not, and are converted on the way in and back on the way out, recorded in the checkpoint's
metadata (a list of ``[path, kind]``) so nothing is guessed when loading:

- ``argparse.Namespace`` (``save_hyperparameters(args)``): stored as a dict, comes back as a Namespace;
- ``pathlib`` paths: stored as a string, come back as ``pathlib.Path`` (a ``PurePath`` of the other
  system's flavour comes back as this system's ``Path``);
- dataclass instances: stored as a dict of their fields, come back as that dict (rebuilding the class
  would mean importing code named by the checkpoint, which is what pickle does and trainstate does not);
- OmegaConf ``DictConfig`` / ``ListConfig`` (Hydra configs): stored as their plain container with
  interpolations unresolved, come back as a DictConfig / ListConfig (``OmegaConf.create``); the class
  Lightning stores beside OmegaConf hyperparameters (``hparams_type``) comes back as that class. Without
  omegaconf installed where it is loaded, the plain container comes back, with a warning.

A torch module among the hyperparameters (a loss passed to ``__init__``: ``save_hyperparameters()`` only
warns) is refused, naming the key and ``save_hyperparameters(ignore=[...])``: its weights are in
``state_dict`` already, and the module itself cannot come back without pickle.

The module's ``state_dict()`` is an OrderedDict with a ``_metadata`` attribute (each submodule's version,
which ``load_state_dict`` hands to ``_load_from_state_dict`` for migrations): kept in the metadata too.
Anything else that cannot be stored without pickle raises :class:`UnsupportedValueError` naming the key,
with the fix for the part of Lightning that put it there.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import pathlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np

from trainstate._optional import optional
from trainstate.errors import InvalidArgumentError, UnsupportedValueError

with optional("torch", extra="lightning", needed_for="trainstate.integrations.lightning"):
    import torch

META_KEY = "lightning"  # the metadata key the plugin records its facts under
HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")  # what save_hyperparameters() fills
log = logging.getLogger("trainstate")
_PathKey = Any  # a dict key (kept exactly: the metadata holds int and tuple keys as they are) or a list position


def to_state(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """The dict to save (containers rebuilt only where a value was converted) and the conversions made."""
    if not isinstance(checkpoint, Mapping):
        raise InvalidArgumentError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__qualname__}")
    conversions: list[list[Any]] = []
    converted = _convert(checkpoint, [], conversions, depth=0)
    return dict(converted), conversions


def _convert(value: Any, path: list[_PathKey], out: list[list[Any]], depth: int) -> Any:
    if depth > 100 or value is None or isinstance(value, (bool, int, float, str, bytes, np.generic)):
        return value  # plain (a str Enum too) or a NumPy scalar, stored as it is; the depth limit is the save's
    if isinstance(value, argparse.Namespace):
        out.append([list(path), "namespace"])
        return _convert(dict(vars(value)), path, out, depth + 1)
    if isinstance(value, pathlib.PurePath):
        out.append([list(path), "path"])
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.append([list(path), "dataclass"])
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return _convert(fields, path, out, depth + 1)
    omegaconf = _omegaconf_class(value)
    if omegaconf == "Container":  # a DictConfig or ListConfig: its plain container, interpolations unresolved
        out.append([list(path), "omegaconf"])
        return _convert(sys.modules["omegaconf"].OmegaConf.to_container(value, resolve=False), path, out, depth + 1)
    if omegaconf == "type":  # the class Lightning stores beside OmegaConf hyperparameters (hparams_type)
        out.append([list(path), "omegaconf-type"])
        return f"omegaconf.{value.__name__}"
    if isinstance(value, torch.nn.Module) and path and path[0] in HPARAMS_KEYS:
        raise UnsupportedValueError(
            f"{'.'.join(map(str, path))}: a {type(value).__qualname__} (a torch module) is a hyperparameter from "
            f"save_hyperparameters(); a checkpoint keeps modules' weights in state_dict, not the modules: leave it "
            f"out with self.save_hyperparameters(ignore=[{path[1]!r}])"
            if len(path) > 1
            else f"{path[0]}: a torch module cannot be the hyperparameters"
        )
    if isinstance(value, Mapping):
        changed = False
        items = []
        for k, v in value.items():
            new = _convert(v, [*path, k], out, depth + 1)
            changed = changed or new is not v
            items.append((k, new))
        return dict(items) if changed else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):  # a namedtuple is left to the save
        new_items = [_convert(v, [*path, i], out, depth + 1) for i, v in enumerate(value)]
        if all(a is b for a, b in zip(new_items, value)):
            return value
        return tuple(new_items) if isinstance(value, tuple) else new_items
    return value


def from_state(state: dict[str, Any], conversions: list[Any], move: Callable[[Any], Any]) -> dict[str, Any]:
    """Undo :func:`to_state`'s conversions in a loaded dict and move its tensors with ``move``."""
    for path, kind in conversions:
        if path:  # the whole checkpoint is never converted
            state = _replaced(state, list(path), partial(_restore, kind=str(kind)))
    moved: dict[str, Any] = _move_tensors(state, move)
    return moved


def _omegaconf_class(value: Any) -> str | None:
    """ "Container" for an OmegaConf DictConfig / ListConfig, "type" for one of those classes, else None; without
    importing omegaconf (a value of its type means the user's code imported it)."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None:
        return None
    if isinstance(value, type):
        return "type" if value in (omegaconf.DictConfig, omegaconf.ListConfig) else None
    return "Container" if isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)) else None


def _omegaconf(value: Any, kind: str) -> Any:
    """Undo an OmegaConf conversion: the DictConfig / ListConfig (or its class) again; without omegaconf
    installed, the plain container (or the class's name), with a warning."""
    try:
        omegaconf = importlib.import_module("omegaconf")
    except ImportError:
        log.warning(
            "this Lightning checkpoint holds OmegaConf hyperparameters; without omegaconf installed they "
            "load as plain dicts and lists (pip install omegaconf)"
        )
        return value
    if kind == "omegaconf-type":
        name = value.rsplit(".", 1)[-1] if isinstance(value, str) else ""
        return getattr(omegaconf, name) if name in ("DictConfig", "ListConfig") else value
    return omegaconf.OmegaConf.create(value) if isinstance(value, (dict, list)) else value


def _restore(value: Any, kind: str) -> Any:
    if kind in ("omegaconf", "omegaconf-type"):
        return _omegaconf(value, kind)
    if kind == "namespace" and isinstance(value, dict):
        return argparse.Namespace(**value)
    if kind == "path" and isinstance(value, str):
        return pathlib.Path(value)
    if kind.startswith("numpy:") and isinstance(value, (bool, int, float)):  # written by trainstate <= 0.13
        return np.dtype(kind[len("numpy:") :]).type(value)
    return value  # a dataclass stays the dict it was stored as; an unknown kind (a newer writer) as stored


def _replaced(container: Any, path: list[_PathKey], fn: Callable[[Any], Any]) -> Any:
    """``container`` with the value at ``path`` (keys and positions) replaced by ``fn(value)``: lists, dicts
    and Namespaces changed in place, a tuple on the way rebuilt. A path that is not there changes nothing."""
    key, rest = path[0], path[1:]
    child = _child(container, key)
    if child is None and not _has(container, key):
        return container
    new = fn(child) if not rest else _replaced(child, rest, fn)
    if new is child:
        return container
    if isinstance(container, tuple):
        return tuple(new if i == key else v for i, v in enumerate(container))
    if isinstance(container, argparse.Namespace):
        setattr(container, key, new)
    else:
        container[key] = new
    return container


def _has(container: Any, key: _PathKey) -> bool:
    if isinstance(container, dict):
        return key in container
    if isinstance(container, (list, tuple)):
        return type(key) is int and 0 <= key < len(container)
    return isinstance(container, argparse.Namespace) and isinstance(key, str) and hasattr(container, key)


def _child(container: Any, key: _PathKey) -> Any:
    if isinstance(container, dict):
        return container.get(key)
    if isinstance(container, (list, tuple)) and type(key) is int and 0 <= key < len(container):
        return container[key]
    if isinstance(container, argparse.Namespace) and isinstance(key, str):
        return getattr(container, key, None)
    return None


def _move_tensors(value: Any, move: Callable[[Any], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _move_tensors(v, move)
        return value
    if isinstance(value, list):
        value[:] = [_move_tensors(v, move) for v in value]
        return value
    if isinstance(value, tuple):
        return tuple(_move_tensors(v, move) for v in value)
    if isinstance(value, argparse.Namespace):
        for k, v in vars(value).items():
            setattr(value, k, _move_tensors(v, move))
    return value


def module_metadata(state_dict: Any) -> dict[str, Any] | None:
    """The ``_metadata`` a module's ``state_dict()`` carries (submodule versions), if it is plain."""
    meta = getattr(state_dict, "_metadata", None)
    if not isinstance(meta, Mapping):
        return None
    plain = {}
    for prefix, info in meta.items():
        if not isinstance(prefix, str) or not isinstance(info, Mapping):
            return None
        plain[prefix] = {str(k): v for k, v in info.items() if isinstance(v, (bool, int, float, str, type(None)))}
    return plain


def with_module_metadata(state_dict: Any, meta: Any) -> Any:
    """``state_dict`` as the OrderedDict a module returns, with its ``_metadata`` back."""
    if not isinstance(state_dict, dict):
        return state_dict
    ordered: Any = OrderedDict(state_dict)
    if isinstance(meta, Mapping):
        ordered._metadata = OrderedDict((k, dict(v)) for k, v in meta.items())
    return ordered


def explain(error: UnsupportedValueError) -> UnsupportedValueError:
    """The save's error, with what to do about it in Lightning terms (which part of Lightning put it there
    follows from the key)."""
    message = str(error)
    if "save_hyperparameters(ignore=[" in message:  # says what to do in Lightning's terms already
        return error
    top = message.split(":", 1)[0].split(".", 1)[0]
    if top in ("hyper_parameters", "datamodule_hyper_parameters"):
        hint = (
            "it is a hyperparameter from save_hyperparameters(): leave it out with "
            "self.save_hyperparameters(ignore=[...]) (modules and losses usually are), or pass plain values "
            "(numbers, strings, lists, dicts; argparse.Namespace, pathlib.Path, dataclasses and NumPy scalars "
            "are converted, see docs/lightning.md)"
        )
    elif top in ("hparams_type", "datamodule_hparams_type"):
        hint = (
            "Lightning stores the class of the hyperparameters here (DictConfig and ListConfig are kept): pass "
            "a dict, or OmegaConf.to_container(cfg), to save_hyperparameters() instead"
        )
    elif top == "callbacks":
        hint = "a callback's state_dict() returned it: return tensors and plain values"
    else:
        hint = (
            f"{top!r} was put in the checkpoint by your LightningModule's (or a callback's) on_save_checkpoint: "
            "store tensors and plain values there"
        )
    return UnsupportedValueError(f"{message}. In this Lightning checkpoint, {hint}")
