"""torch optimizers keyed by parameter name, through torch.distributed.checkpoint's state_dict helpers.

``optimizer.state_dict()`` keys each parameter's state by its position in the param groups, and a fresh
optimizer has no state until its first step. Under many ranks both go wrong: a position says nothing about
which parameter it was, and a fresh FSDP2 optimizer restored through ``load_state_dict`` gets plain tensors
where DTensors belong. So when a state holds an optimizer together with the module(s) that own every one
of its parameters (found by identity anywhere in the state's containers), the optimizer is *bound*:

* **Save** asks ``get_optimizer_state_dict`` for its state keyed by each parameter's name, prefixed by the
  owning module's place in the state (``"model.0.weight"``). Under FSDP2 the state's tensors are DTensors,
  so each rank writes only its shards. An optimizer that has not stepped has no state to key: its param
  groups are named the same way but without DCP's zero-learning-rate step (a save must change nothing,
  and optimizer step hooks would see that step).
* **Restore** initializes a fresh optimizer's state the way DCP does (``_init_optim_state``: one step with
  zero gradients and a zero learning rate), takes the name-keyed state as the target (its DTensors tell
  each rank which boxes to read), and sets the restored state with ``set_optimizer_state_dict``. An
  optimizer whose step refuses that (LBFGS needs a closure) is restored by name without DCP, through the
  positions ``load_state_dict`` takes; its state is then built from the checkpoint's plain tensors.

Names are checked before anything is read: a parameter the checkpoint lacks is *missing*, a saved one the
optimizer lacks *unexpected*, both under ``<optim>.state.<name>`` in the StateMismatchError. With
``strict=False`` what matches is restored by name, the saved state of unexpected names is not read, and a
missing parameter keeps no state (as if it had never stepped). A position-keyed checkpoint (written before
names, or by an optimizer without its modules in the state) is recognised by its integer keys and restored
by position, into the initialized state, so DTensors still land as DTensors.

DCP takes one model: the owners are handed to it as the children ``"0"``, ``"1"``, ... of a ModuleDict,
and names are translated between that wrapper's (``"0.0.weight"``) and the state's (``"model.0.weight"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainstate import _tree
from trainstate._frameworks.protocol import Bound
from trainstate.errors import CheckpointError

_OptimState = dict[str, Any]


def bind(objects: Sequence[tuple[tuple[str, ...], Any]]) -> dict[int, Bound]:
    """``id(optimizer) -> OptimizerBinding`` for each optimizer whose parameters all belong to modules
    among ``objects``; a parameter held by two of them (a module and its submodule) belongs to the first."""
    modules = [(path, obj) for path, obj in objects if isinstance(obj, torch.nn.Module)]
    optimizers = [obj for _, obj in objects if isinstance(obj, torch.optim.Optimizer)]
    if not modules or not optimizers:
        return {}
    owner: dict[int, int] = {}
    for i, (_, module) in enumerate(modules):
        for p in module.parameters():
            owner.setdefault(id(p), i)
    bound: dict[int, Bound] = {}
    for optim in optimizers:
        found = {owner.get(id(p), -1) for g in optim.param_groups for p in g["params"]}
        if found and -1 not in found:
            bound[id(optim)] = OptimizerBinding(optim, [modules[i] for i in sorted(found)])
    return bound


class OptimizerBinding:
    """An optimizer and the modules that own its parameters: a :class:`trainstate._frameworks.Bound`."""

    def __init__(self, optim: torch.optim.Optimizer, owners: list[tuple[tuple[str, ...], torch.nn.Module]]) -> None:
        self.optim = optim
        self.prefixes = [_tree.join(path) for path, _ in owners]
        self.wrapper = torch.nn.ModuleDict({str(i): module for i, (_, module) in enumerate(owners)})
        self.wrapped: dict[str, str] = {}  # a state name -> the wrapper's name for it
        self.named = True  # what the last restore_target met: a name-keyed checkpoint
        self.dcp = True  # ... and whether DCP could initialize the optimizer to restore through it
        self.initialized = False  # restore_target initialized the optimizer's state

    # -- save -----------------------------------------------------------------------------------------

    def state_dict(self) -> _OptimState:
        if self.optim.state:  # DCP initializes only an optimizer without state: nothing changes here
            return self._keyed(self._dcp_state())
        by_position = self._by_position()
        if by_position is None:  # FSDP1 flat parameters stand for several names each: by position, as before
            osd: _OptimState = self.optim.state_dict()
            return osd
        return {"state": {}, "param_groups": _named_groups(self.optim, by_position)}

    def _dcp_state(self) -> _OptimState:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        osd: _OptimState = get_optimizer_state_dict(self.wrapper, self.optim)
        return osd

    def _by_position(self) -> list[str] | None:
        """Each parameter's name as DCP gives it (wrappers such as DDP's ``module.`` left out), in the
        optimizer's order; None where a parameter stands for several names (FSDP1's flat parameters)."""
        from torch.distributed.checkpoint.state_dict import _get_fqns

        names: dict[int, str] = {}
        for key, p in self.wrapper.named_parameters():
            fqns = _get_fqns(self.wrapper, key)
            if len(fqns) != 1:
                return None
            names[id(p)] = self._name(next(iter(fqns)))
        return [names[id(p)] for g in self.optim.param_groups for p in g["params"]]

    def _name(self, wrapped: str) -> str:
        """The state's name for the wrapper's name ``"1.layer.weight"``: the owner's path in its place."""
        i, _, rest = wrapped.partition(".")
        prefix = self.prefixes[int(i)]
        name = f"{prefix}.{rest}" if prefix else rest
        self.wrapped[name] = wrapped
        return name

    def _keyed(self, osd: _OptimState) -> _OptimState:
        return {
            "state": {self._name(k): v for k, v in osd["state"].items()},
            "param_groups": [_params(g, self._name) for g in osd["param_groups"]],
        }

    # -- restore --------------------------------------------------------------------------------------

    def restore_target(self, saved: Any, skip: object) -> tuple[Any, list[str], list[str]]:
        names = _saved_names(saved)
        self.dcp = self._init()
        self.named = names is not None
        if names is None:  # keyed by position: restored by position, into the initialized state
            return self.optim.state_dict(), [], []
        saved_state, saved_params = names
        if self.dcp:
            current = self._keyed(self._dcp_state())
        else:  # no DCP without its initialized state: names only, the state is rebuilt from the checkpoint
            by_position = self._by_position()
            if by_position is None:
                raise CheckpointError(
                    f"{type(self.optim).__name__}: its state could not be initialized for the restore (a step with "
                    "zero gradients and a zero learning rate, as torch.distributed.checkpoint does), and its "
                    "parameters have no single names. Take one optimizer step before loading"
                )
            current = {"state": {}, "param_groups": _named_groups(self.optim, by_position)}
        mine = [n for g in current["param_groups"] for n in g["params"]]
        have, had = set(mine), set(saved_params) | set(saved_state)
        missing = [n for n in mine if n not in had]
        unexpected = [n for n in dict.fromkeys(saved_params + saved_state) if n not in have]
        for n in saved_state:
            if n not in have:
                current["state"][n] = skip
        return current, missing, unexpected

    def _init(self) -> bool:
        """Give a fresh optimizer its state as DCP does; gradients a caller already has are kept aside.

        False where that step fails (LBFGS needs a closure, SparseAdam sparse gradients): the optimizer is
        left as it was, and the restore goes by name without DCP.
        """
        if self.optim.state:
            return True
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        groups = self.optim.param_groups
        params = [p for g in groups for p in g["params"]]
        grads = [p.grad for p in params]
        lrs = [g.get("lr") for g in groups]  # DCP zeroes them for its step, and restores them only if it returns
        for p in params:
            p.grad = None  # DCP initializes only an optimizer whose parameters have no gradient
        try:
            _init_optim_state(self.optim)
        except Exception:  # noqa: BLE001 - any optimizer's step may refuse; the restore goes on without DCP
            self.optim.state.clear()
            for g, lr in zip(groups, lrs):
                if "lr" in g:
                    g["lr"] = lr
            return False
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad
        self.initialized = True
        return True

    def undo(self) -> None:
        if self.initialized:
            self.optim.state.clear()
            self.initialized = False

    def load_state_dict(self, state: Any, strict: bool) -> None:
        self.initialized = False
        if not self.named:
            self.optim.load_state_dict(state)
            return
        if not self.dcp:  # by name, through the positions torch's own load_state_dict takes
            by_position = self._by_position()
            assert by_position is not None  # restore_target refused it otherwise
            position = {n: i for i, n in enumerate(by_position)}
            self.optim.load_state_dict(
                {
                    "state": {position[k]: v for k, v in state["state"].items() if k in position},
                    "param_groups": [
                        {**g, "params": [position[n] for n in g["params"] if n in position]}
                        for g in state["param_groups"]
                    ],
                }
            )
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        known = self.wrapped
        wrapped: Any = {  # names the optimizer lacks are left out (strict=False; strict stopped before reading)
            "state": {known[k]: v for k, v in state["state"].items() if k in known},
            "param_groups": [
                {**g, "params": [known[n] for n in g["params"] if n in known]} for g in state["param_groups"]
            ],
        }
        # strict=False for DCP: trainstate checked the names; DCP's strict would also refuse a parameter
        # that has no state because it never had a gradient (an unused layer).
        set_optimizer_state_dict(self.wrapper, self.optim, wrapped, options=StateDictOptions(strict=False))


def _params(group: dict[str, Any], name: Callable[[Any], str]) -> dict[str, Any]:
    return {**group, "params": [name(p) for p in group["params"]]}


def _named_groups(optim: torch.optim.Optimizer, by_position: list[str]) -> list[dict[str, Any]]:
    """The optimizer's own param groups (as its state_dict() has them), parameters named."""
    return [_params(g, lambda i: by_position[i]) for g in optim.state_dict()["param_groups"]]


def _saved_names(saved: Any) -> tuple[list[str], list[str]] | None:
    """(the names the saved state has state for, the names in its param groups) of a name-keyed optimizer
    state node; None for one keyed by position (its keys are integers)."""
    if not isinstance(saved, _tree.DictNode):
        return None
    parts = dict(saved.items())
    state, groups = parts.get("state"), parts.get("param_groups")
    keys = list(state.keys) if isinstance(state, _tree.DictNode) else []
    params: list[Any] = []
    for g in groups.items if isinstance(groups, _tree.SeqNode) else ():
        listed = dict(g.items()).get("params") if isinstance(g, _tree.DictNode) else None
        if isinstance(listed, _tree.SeqNode):
            params.extend(v.value if isinstance(v, _tree.ValueNode) else None for v in listed.items)
    if not keys + params or not all(isinstance(n, str) for n in keys + params):
        return None
    return [str(k) for k in keys], [str(p) for p in params]


def step_guarded(objects: Sequence[tuple[tuple[str, ...], Any]]) -> tuple[set[int], list[torch.optim.Optimizer]]:
    """The storage addresses of the CPU tensors that the torch optimizers among ``objects`` change only in their
    ``step()`` (their parameters, a DTensor's local shard, and each parameter's state), and those optimizers."""
    optimizers = [obj for _, obj in objects if isinstance(obj, torch.optim.Optimizer)]
    addresses: set[int] = set()
    for optim in optimizers:
        for group in optim.param_groups:
            for p in group["params"]:
                state = optim.state.get(p, {})
                for t in (p, *(v for v in state.values() if isinstance(v, torch.Tensor))):
                    local = t.to_local() if hasattr(t, "to_local") else t
                    if local.device.type == "cpu" and local.numel():
                        addresses.add(local.untyped_storage().data_ptr())
    return addresses, optimizers


def storage_address(value: Any) -> int | None:
    """A CPU tensor's storage address (what :func:`step_guarded` lists); None for anything else."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel():
        return int(value.untyped_storage().data_ptr())
    return None
