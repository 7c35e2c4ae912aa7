"""load(path, target): restore a checkpoint into live state, in place.

Two passes. The plan pass walks the checkpoint's tree beside the target, checks every key, shape and
dtype, and collects all problems into one :class:`StateMismatchError` before a single byte is read. The
read pass then fills the target's own tensor memory straight from the files (no intermediate copy) and
runs the finishers: containers get their new values, stateful objects get ``load_state_dict``.

Matching rules:

* Plain containers (the user's dicts, lists, tuples) and ``nn.Module`` state dicts keep the target's
  structure; a key on one side only is *missing* or *unexpected*.
* Under any other stateful object (optimizer, scheduler, data loader, RNG) the checkpoint's structure is
  the truth, as it is for ``load_state_dict``: a fresh optimizer has no moments yet and gets them. Target
  tensors at matching paths are still filled in place.
* An object bound to others of the state (``_frameworks.bind``: a torch optimizer and the modules that own
  its parameters) gives its own target and names; its missing and unexpected names are reported as keys.
* Names map by path: a saved object's state restores into a plain container of the same paths and a saved
  dict into an object's state (a torch model's into a JAX program's dicts, a JAX pytree into a torch model),
  and a saved dict's dotted keys match the target's nested dicts and back (by_path.py).
* Shapes must always match. Dtypes must match when ``strict``; otherwise values are cast.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from trainstate import _state
from trainstate import _tree as tree
from trainstate._distributed import per_rank
from trainstate._format.added_keys import declared_keys, saved_step
from trainstate._frameworks import (
    WRAPPER_PREFIXES,
    Bound,
    adapter_for,
    ignored_on_load,
    jax_tree,
    load_takes_strict,
    pytree,
    rebuilt_from_checkpoint,
    unwrapped,
)
from trainstate._restore import scalar_leaf
from trainstate._restore.by_path import keyed_like
from trainstate._restore.files import Opened
from trainstate._restore.read import Job as _Job
from trainstate._restore.read import fill
from trainstate._restore.shared import Share
from trainstate.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    StateMismatchError,
    UnsupportedValueError,
)

Finisher = Callable[[], Any]
# what the plan walk visits (a node, its part of the target, its path, free) and what a visit answers
_Item: TypeAlias = "tuple[tree.Node, Any, tuple[str, ...], bool]"
Planned: TypeAlias = "Finisher | tree.Branch[_Item, Finisher]"
_ABSENT = object()
_UNEXPECTED = object()  # the target part for a saved key the target has no place for
_SKIP = object()  # the target part for a saved key a bound object leaves unread (strict=False)

log = logging.getLogger("trainstate")


def selector(include: str | list[str] | None, exclude: str | list[str] | None) -> Callable[[str], bool] | None:
    """A predicate over dotted keys from glob patterns (``"model.*"``), or None when everything is selected."""
    inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
    if not inc and not exc:
        return None

    def selected(key: str) -> bool:
        if inc and not any(matches(key, p) for p in inc):
            return False
        return not any(matches(key, p) for p in exc)

    return selected


def matches(key: str, pattern: str) -> bool:
    """Whether a glob pattern takes a dotted key: the key itself, or anything under what it names
    (``"rng"`` takes ``"rng.torch"``, as ``"rng.*"`` does)."""
    return fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key, pattern + ".*")


def unmatched(patterns: list[str], keys: list[str]) -> list[str]:
    """The patterns that take no key: a typo in one would silently restore (or skip) a part."""
    return [p for p in patterns if not any(matches(k, p) for k in keys)]


def _patterns(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return list(value)
    raise InvalidArgumentError(f'{what} takes a glob pattern or a list of them ("model.*"), got {value!r:.60}')


def _is_container(value: Any) -> bool:
    """A plain container of the user's (not a stateful object), which a saved object's state can restore into."""
    return isinstance(value, (Mapping, list, tuple)) and not _state.is_stateful(value)


def _is_structure(value: Any) -> bool:
    return _state.is_stateful(value) or isinstance(value, (Mapping, list, tuple))


def _describe(value: Any) -> str:
    adapter = adapter_for(value)
    if adapter is not None:
        code, shape, _ = adapter.describe(value)
        return f"tensor {code}{list(shape)}"
    return type(value).__name__


class Restorer:
    def __init__(
        self,
        ck: Opened,
        *,
        strict: bool,
        selected: Callable[[str], bool] | None,
        framework: str | None = None,
        optional: tuple[str, ...] = (),
        rank: tuple[int, int] = (0, 1),
        bound: dict[int, Bound] | None = None,
        local_view: dict[str, Any] | None = None,
    ) -> None:
        self.ck = ck
        self.local_view = local_view  # a process's own view: each sharded part's saved [offset, whole shape]
        self.bound = bound or {}  # id(object) -> its binding (_frameworks.bind over the target)
        self.touched: list[Bound] = []  # bindings whose object restore_target changed: undone on failure
        self.rank, self.world = rank  # this process's rank and world size (per-rank values, shards)
        self.strict = strict
        self.framework = framework  # array type for tensors the target lacks; None: what the saver held
        self.optional = optional  # top-level target keys the checkpoint may lack without a complaint
        self.declared = declared_keys(ck.metadata)  # top-level checkpoint keys the target may lack (§6a)
        self.partial = selected is not None
        self.selected: Callable[[str], bool] = selected or (lambda key: True)
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, str, str]] = []
        self.ignored: list[tuple[str, re.Pattern[str] | None, re.Pattern[str] | None]] = []  # see _drop_ignored
        self.world_size_changed = False  # a per-rank value met a different world size: say so in the error
        self.jobs: dict[str, _Job] = {}
        self.extra_jobs: list[tuple[str, _Job]] = []

    # -- plan -----------------------------------------------------------------------------------

    def plan(self, target: Any, node: tree.Node, path: tuple[str, ...], free: bool) -> Finisher:
        """A finisher that yields the restored value for ``target`` once the reads are done.

        One :func:`tree.walk` over the checkpoint's nodes, each visited beside its part of the target: a
        container's children are planned (in tree order) before its own finisher is made.
        """
        return tree.walk((node, target, path, free), self._plan_node, _too_deep)

    def _plan_node(self, item: _Item) -> Planned:
        node, target, path, free = item
        if target is _UNEXPECTED:  # a saved part the target has no place for
            self.unexpected.extend(p for p in self._leaves(node, path) if self.selected(p))
            return lambda: _ABSENT
        if target is _SKIP:
            return lambda: _ABSENT
        if self.partial and not self._any_selected(node, path):
            return lambda: target  # excluded (or not included): nothing to plan, not even a per-rank check
        if target is not _ABSENT and (
            per_rank.is_per_rank_node(node)
            or isinstance(target, _state.PerRank)
            or (self.world > 1 and _state.is_per_rank(target))
        ):
            return self._plan_per_rank(target, node, path, free)
        return self._plan_plain(node, target, path, free)

    def _plan_plain(self, node: tree.Node, target: Any, path: tuple[str, ...], free: bool) -> Planned:
        key = tree.join(path)
        found = None
        if (
            target is not _ABSENT
            and not isinstance(target, (dict, list, tuple))
            and adapter_for(target) is None
            and not _state.is_stateful(target)
        ):
            found = pytree(target)
        # An object's state and a plain container of the same paths stand for each other, whichever side holds
        # the object: a torch model's state restores into a JAX program's dicts, a JAX pytree into a torch model.
        if isinstance(node, tree.StatefulNode) and (found is not None or _is_container(target)):
            node = node.state
        elif isinstance(node, tree.DictNode) and target is not _ABSENT and _state.is_stateful(target):
            return self._plan_stateful(target, tree.StatefulNode("dict", node), path)
        if found is not None:
            return self._plan_pytree(node, target, found, path, free)
        if isinstance(node, tree.ValueNode):
            if not self.selected(key):
                return lambda: target
            value = node.value
            if target is not _ABSENT and (adapter_for(target) is not None or (not free and _is_structure(target))):
                # never replace a live tensor, object or container with a saved plain value
                self.mismatched.append((key or "<root>", _describe(target), f"a plain value ({value!r:.40})"))
                return lambda: target
            return lambda: value
        if self.partial and not self._any_selected(node, path):
            return lambda: target  # _ABSENT for a part the target lacks: its container drops it
        if isinstance(node, tree.TensorNode):
            return self._plan_tensor(target, node.name, key)
        if isinstance(node, tree.StatefulNode):
            return self._plan_stateful(target, node, path)
        tag = node.tag if isinstance(node, tree.SeqNode) else "dict"
        if target is not _ABSENT and not free and not isinstance(target, Mapping if tag == "dict" else (list, tuple)):
            self.mismatched.append((key or "<root>", _describe(target), tag))
            return lambda: target
        if isinstance(node, tree.DictNode):
            return self._plan_dict(target, node, path, free)
        return self._plan_sequence(target, node, path, free)

    def _plan_tensor(self, target: Any, name: str, key: str) -> Finisher:
        entry = self.ck.manifest.tensors.get(name)
        if entry is None:
            raise CorruptCheckpointError(f"tree refers to tensor {name!r}, which the manifest does not list")
        tied = self.jobs.get(name)
        if tied is not None and (target is _ABSENT or target is tied.target):
            return lambda: tied.value  # a tied tensor met again: one read, shared as in the checkpoint
        adapter = adapter_for(target) if target is not _ABSENT else None
        if target is not _ABSENT and adapter is None:
            self.mismatched.append((key, _describe(target), f"tensor {entry.dtype}{list(entry.shape)}"))
            return lambda: target
        if adapter is not None:
            try:
                code, shape, _ = adapter.describe(target)
            except UnsupportedValueError as e:  # a target that cannot be filled (a DTensor shard of many boxes)
                raise UnsupportedValueError(f"{key}: {e}") from None
            part = adapter.local_part(target) if self.local_view is not None else None
            if part is not None:  # a local view holds this process's part of it whole
                assert self.local_view is not None
                box = [list(part[1]), list(shape)]
                saved = self.local_view.get(name)
                if not isinstance(saved, (list, tuple)) or [list(x) for x in saved] != box:
                    self.mismatched.append((key, f"a part at {box[0]} of {box[1]}", f"a part at {saved!r:.80}"))
                    return lambda: target
                shape = tuple(part[0].shape)
            if shape != entry.shape or (code != entry.dtype and self.strict):
                self.mismatched.append((key, f"tensor {code}{list(shape)}", f"tensor {entry.dtype}{list(entry.shape)}"))
                return lambda: target
        job = _Job(target, whole_part=self.local_view is not None)
        if tied is None:
            self.jobs[name] = job
        else:  # tied in the checkpoint, two separate arrays in the target: fill both
            self.extra_jobs.append((name, job))
        return lambda: job.value

    def _writer_added(self, path: tuple[str, ...]) -> bool:
        """Whether ``path`` lies under a top-level key the writer added beside the user's state (the manager's
        captured RNG, ``optional``): the user never asked for it, so a change of process count is no error."""
        return bool(path) and path[0] in self.optional

    def _keep_own(self, key: str, target: Any, saved: str) -> Planned:
        """Leave a writer-added per-rank value as this run has it, and say so: at another process count no
        process's saved RNG is its own, so the resumed run draws other random numbers than the saved run."""
        log.warning(
            "%s: restoring on %d process(es) a checkpoint whose per-process values were %s: this run keeps its own "
            "(its random numbers will differ from an uninterrupted run's)",
            key,
            self.world,
            saved,
        )
        return lambda: target

    def _rederive(self, key: str, inner: Any, target: Any, saved: int) -> Planned:
        """A per-rank value (an RNGState) saved by another number of ranks: none of them is this rank, so its
        value is re-derived from (its seed, the checkpoint's step, this rank) by the documented rule."""
        step = saved_step(self.ck.metadata)
        log.info(
            "%s: restoring on %d process(es) a checkpoint %d process(es) saved: rank %d's generators are re-derived "
            "from (seed, step %d, rank)",
            key,
            self.world,
            saved,
            self.rank,
            step,
        )

        def finish() -> Any:
            inner.rederive(self.rank, step)
            return target

        return finish

    def _plan_per_rank(self, target: Any, node: tree.Node, path: tuple[str, ...], free: bool) -> Planned:
        """A per-rank part: this rank's own value, saved by as many ranks as there are now (docs/distributed.md)."""
        key = tree.join(path) or "<root>"
        inner = target.value if isinstance(target, _state.PerRank) else target
        if isinstance(node, tree.StatefulNode) and per_rank.is_per_rank_node(node):
            if not _state.is_per_rank(target):
                self.mismatched.append(
                    (
                        key,
                        f"{_describe(target)} (one value for every rank)",
                        "values saved per rank (trainstate.PerRank)",
                    )
                )
                return lambda: target
            chosen = per_rank.entry(node, self.rank, self.world)
            if chosen is None and callable(getattr(inner, "rederive", None)):
                return self._rederive(key, inner, target, per_rank.saved_ranks(node))
            if chosen is None and self._writer_added(path):
                return self._keep_own(key, target, f"saved by {per_rank.saved_ranks(node)} processes")
            if chosen is None:
                saved = per_rank.saved_ranks(node)
                self.mismatched.append(
                    (key, f"a per-rank value of rank {self.rank} of {self.world}", f"values saved by {saved} ranks")
                )
                self.world_size_changed = True
                return lambda: target
            node, path = chosen, path + (str(self.rank),)
        elif self.world > 1 and callable(getattr(inner, "rederive", None)):
            return self._rederive(key, inner, target, 1)
        elif self.world > 1 and self._writer_added(path):
            return self._keep_own(key, target, "saved by one process")
        elif self.world > 1 and self.ck.manifest.world_size > 1:  # saved as one value by several ranks: another kind
            self.mismatched.append(
                (
                    key,
                    f"a per-rank value on {self.world} ranks",
                    f"one value for every rank (saved so by {self.ck.manifest.world_size} ranks, as a ResumableSampler with "
                    "global_batch_size saves)",
                )
            )
            return lambda: target
        elif self.world > 1:  # a per-rank target, a value saved by one process: every rank would get the same
            self.mismatched.append((key, f"a per-rank value on {self.world} ranks", "one value saved by one process"))
            self.world_size_changed = True
            return lambda: target
        planned = self._plan_plain(node, inner, path, free)
        if not isinstance(target, _state.PerRank):
            return planned

        def put(finisher: Finisher) -> Finisher:
            def finish() -> Any:
                value = finisher()
                if value is not _ABSENT:
                    target.value = value
                return target

            return finish

        if isinstance(planned, tree.Branch):
            combine = planned.combine
            return tree.Branch(planned.children, lambda finishers: put(combine(finishers)))
        return put(planned)

    def _plan_stateful(self, target: Any, node: tree.StatefulNode, path: tuple[str, ...]) -> Planned:
        key = tree.join(path) or "<root>"
        if target is _ABSENT:
            return tree.Branch([(node.state, _ABSENT, path, True)], _first)
        if not _state.is_stateful(target):
            self.mismatched.append((key, _describe(target), f"state of {node.type}"))
            return lambda: target
        held, target = target, unwrapped(target)  # the container keeps the wrapper; the model is filled
        module = load_takes_strict(target)  # an nn.Module: its own keys are the truth
        lacking, extra = ignored_on_load(target)
        if lacking or extra:
            self.ignored.append((f"{key}." if path else "", _any_of(lacking), _any_of(extra)))
        bound = self.bound.get(id(target))
        if bound is not None:
            self.touched.append(bound)
            current, missing, unexpected = bound.restore_target(node.state, _SKIP)
            self.missing.extend(k for k in (f"{key}.state.{n}" for n in missing) if self.selected(k))
            self.unexpected.extend(k for k in (f"{key}.state.{n}" for n in unexpected) if self.selected(k))
        else:
            # A data loader's state_dict() starts an iterator (worker processes, a draw from the global RNG):
            # its state is rebuilt from the checkpoint alone.
            current = _ABSENT if rebuilt_from_checkpoint(target) else target.state_dict()
            if module and isinstance(current, Mapping):
                node = _without_wrapper_prefix(node, [str(k) for k in current])

        def finish(inner: list[Finisher]) -> Any:
            state = inner[0]()
            try:
                if bound is not None:
                    bound.load_state_dict(state, self.strict)
                elif module:
                    target.load_state_dict(state, strict=self.strict)
                else:
                    target.load_state_dict(state)
            except StateMismatchError as e:  # stays one (what the docs promise), its keys under this one's
                raise StateMismatchError(
                    [f"{key}.{k}" for k in e.missing],
                    [f"{key}.{k}" for k in e.unexpected],
                    [(f"{key}.{k}", want, got) for k, want, got in e.mismatched],
                    hint=e.hint,
                ) from e
            except Exception as e:
                raise CheckpointError(f"{key}: {type(target).__name__}.load_state_dict failed: {e}") from e
            return held

        return tree.Branch([(node.state, current, path, not module)], _then(finish))

    def _plan_dict(
        self, target: Any, node: tree.DictNode, path: tuple[str, ...], free: bool
    ) -> tree.Branch[_Item, Finisher]:
        present = target if target is not _ABSENT and isinstance(target, Mapping) else {}
        if present and not free:  # the target's keys are the truth: match the saved ones to them by path
            node = keyed_like(node, present)
        keys: list[Any] = []
        children: list[_Item] = []
        converted: set[Any] = set()  # keys whose number / 0-d array is restored as the other (_scalar_leaf)
        for k, child in node.items():
            sub = path + (str(k),)
            if k in present:
                keys.append(k)
                leaf = present[k] if free else self._scalar_leaf(present[k], child)
                if leaf is not present[k]:
                    converted.add(k)
                children.append((child, leaf, sub, free))
            elif free or target is _ABSENT:
                keys.append(k)
                children.append((child, _ABSENT, sub, free))
            elif not path and k in self.declared:
                continue  # a key its writer added on its own (format.md §6a): restored only if asked for
            else:
                keys.append(_UNEXPECTED)
                children.append((child, _UNEXPECTED, sub, free))

        def planned(finishers: list[Finisher]) -> Finisher:  # once every child is planned
            if not free and target is not _ABSENT:
                saved = set(node.keys)
                for k in present:
                    if k not in saved and not (not path and k in self.optional):
                        key = tree.join(path + (str(k),))
                        if self.selected(key) or any(self.selected(p) for p in _target_leaves(present[k], key)):
                            self.missing.append(key)
            done = [(k, f) for k, f in zip(keys, finishers) if k is not _UNEXPECTED]

            def finish() -> Any:
                if free or target is _ABSENT or not isinstance(target, dict):
                    base = dict(target) if (not free and isinstance(target, Mapping)) else {}
                    for k, f in done:
                        value = f()
                        if value is not _ABSENT:
                            base[k] = _as_own(present[k], value) if k in converted else value
                    return base
                for k, f in done:
                    value = f()
                    if value is not _ABSENT:
                        target[k] = _as_own(present[k], value) if k in converted else value
                return target

            return finish

        return tree.Branch(children, planned)

    def _plan_pytree(
        self,
        node: tree.Node,
        target: Any,
        found: tuple[jax_tree.Children, Callable[[list[Any]], Any]],
        path: tuple[str, ...],
        free: bool,
    ) -> Planned:
        """A JAX pytree node of the target (``_frameworks/jax_tree.py``): its children planned as a dict's (or
        its one child as itself), then the node rebuilt from the target's own structure."""
        kids, rebuild = found

        def rebuilt(values: list[Any]) -> Any:  # the target itself when every child changed in place
            return target if all(v is own for v, (_, own) in zip(values, kids)) else rebuild(values)

        if jax_tree.is_single(target, kids):
            own = kids[0][1]
            leaf = self._scalar_leaf(own, node)
            return tree.Branch([(node, leaf, path, free)], _then(lambda fs: rebuilt([_as_own(own, fs[0]())])))
        if not isinstance(node, tree.DictNode):
            saved = node.tag if isinstance(node, tree.SeqNode) else _describe_node(node)
            self.mismatched.append((tree.join(path) or "<root>", type(target).__name__, saved))
            return lambda: target
        node = keyed_like(node, dict(kids))
        planned = self._plan_dict(dict(kids), node, path, free)

        def combine(finishers: list[Finisher]) -> Finisher:
            done = planned.combine(finishers)
            return lambda: rebuilt([done().get(k, v) for k, v in kids])

        return tree.Branch(planned.children, combine)

    def _scalar_leaf(self, own: Any, saved: tree.Node | None) -> Any:
        """What a leaf of the target's dicts and JAX pytrees is planned against (``scalar_leaf.py``: a number
        and a 0-d array are one leaf); :func:`_as_own` gives the result the target's type."""
        entry = self.ck.manifest.tensors.get(saved.name) if isinstance(saved, tree.TensorNode) else None
        return scalar_leaf.planned_against(own, entry, saved.value if isinstance(saved, tree.ValueNode) else None)

    def _plan_sequence(self, target: Any, node: tree.SeqNode, path: tuple[str, ...], free: bool) -> Planned:
        children = node.items
        have = target if target is not _ABSENT and isinstance(target, (list, tuple)) else None
        if have is not None and len(have) != len(children) and not free:
            self.mismatched.append(
                (
                    tree.join(path) or "<root>",
                    f"{type(have).__name__} of {len(have)}",
                    f"{node.tag} of {len(children)}",
                )
            )
            return lambda: target

        def finish(finishers: list[Finisher]) -> Any:
            values = [v for v in (f() for f in finishers) if v is not _ABSENT]
            if isinstance(have, tuple) and len(values) == len(have) and all(v is h for v, h in zip(values, have)):
                return have  # every element changed in place: the tuple is the restored one
            if node.is_tuple:
                if isinstance(have, tuple) and hasattr(have, "_fields"):
                    return type(have)(*values)
                return tuple(values)
            if isinstance(have, list) and not free:
                have[:] = values
                return have
            return values

        return tree.Branch(
            [
                (c, have[i] if have is not None and i < len(have) else _ABSENT, path + (str(i),), free)
                for i, c in enumerate(children)
            ],
            _then(finish),
        )

    def _any_selected(self, node: tree.Node, path: tuple[str, ...]) -> bool:
        return any(self.selected(p) for p in self._leaves(node, path))

    def _leaves(self, node: tree.Node, path: tuple[str, ...]) -> list[str]:
        """Dotted keys of every leaf under a checkpoint node; an empty container is a leaf itself."""
        return [tree.join(p) for p, _ in tree.leaves(node, path)]

    # -- read -----------------------------------------------------------------------------------

    def undo(self) -> None:
        """Take back what planning changed in bound objects (a fresh optimizer's initialized state)."""
        for bound in self.touched:
            bound.undo()

    def _drop_ignored(self) -> None:
        """Forget the missing and unexpected names a model's class lets its checkpoints lack or hold, as
        ``from_pretrained`` does (``ignored_on_load``: a transformers model's own rules, searched in the name
        below the model's key). The model's ``load_state_dict`` then gets its own value for an ignored missing
        name, and no ignored unexpected one."""

        def kept(keys: list[str], which: int) -> list[str]:
            out = []
            for k in keys:
                rules = [(p, rule[which]) for p, *rule in self.ignored if k.startswith(p)]
                if not any(r is not None and r.search(k[len(p) :]) for p, r in rules):
                    out.append(k)
            return out

        if self.ignored:
            self.missing, self.unexpected = kept(self.missing, 0), kept(self.unexpected, 1)

    def check(self) -> None:
        self._drop_ignored()
        if self.mismatched or (self.strict and (self.missing or self.unexpected)):
            hint = (
                "Per-rank values (data loader positions, trainstate.PerRank) restore only at the world size that "
                "saved them. A ResumableSampler built with global_batch_size=... saves one position for the whole "
                "job, which continues at any world size (docs/distributed.md, 'Changing the world size'); excluding "
                "a per-rank data position (exclude=[...]) starts its epoch over, so samples are seen twice or never"
                if self.world_size_changed
                else ""
            )
            raise StateMismatchError(self.missing, self.unexpected, self.mismatched, hint)

    def read(self, *, verify: bool, threads: int, share: Share | None = None) -> None:
        """Read every planned tensor (read.py): straight into the target's memory where its layout allows;
        with ``share``, the parts other ranks hold too are read once between them (shared.py)."""
        jobs = [*self.jobs.items(), *self.extra_jobs]
        fill(self.ck, jobs, framework=self.framework, absent=_ABSENT, verify=verify, threads=threads, share=share)


def _without_wrapper_prefix(node: tree.StatefulNode, own: list[str]) -> tree.StatefulNode:
    """A module's saved state with the prefix a wrapper added taken off every name, where the module's own
    names (``own``) do not all carry it: checkpoints written before wrapped models were saved as the model
    they wrap (``model.module.0.weight``) still load."""
    state = node.state
    if not isinstance(state, tree.DictNode) or not state.keys:
        return node
    for prefix in WRAPPER_PREFIXES:
        saved = all(isinstance(k, str) and k.startswith(prefix) for k in state.keys)
        if saved and not (own and all(k.startswith(prefix) for k in own)):
            keys = tuple(str(k)[len(prefix) :] for k in state.keys)
            return _without_wrapper_prefix(tree.StatefulNode(node.type, tree.DictNode(keys, state.values)), own)
    return node


def _target_leaves(value: Any, path: str) -> list[str]:
    if _state.is_stateful(value):
        value = unwrapped(value).state_dict()
    found = None if isinstance(value, (Mapping, list, tuple)) else pytree(value)
    if found is not None:
        value = found[0][0][1] if jax_tree.is_single(value, found[0]) else dict(found[0])
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _target_leaves(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _target_leaves(v, f"{path}.{i}")]
    return [path]


def _as_own(own: Any, value: Any) -> Any:
    """A restored leaf as the target's own type (see :meth:`Restorer._scalar_leaf`); the target's own where the
    restore left it (excluded, or not saved)."""
    return own if value is _ABSENT else scalar_leaf.as_own(own, value)


def _describe_node(node: tree.Node) -> str:
    return (
        "tensor"
        if isinstance(node, tree.TensorNode)
        else "a plain value"
        if isinstance(node, tree.ValueNode)
        else "state"
    )


def _any_of(patterns: list[str]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def _first(finishers: list[Finisher]) -> Finisher:
    return finishers[0]


def _then(finish: Callable[[list[Finisher]], Any]) -> Callable[[list[Finisher]], Finisher]:
    """A Branch's combine: once the children are planned, a finisher that runs ``finish`` on theirs."""
    return lambda finishers: lambda: finish(finishers)


def _too_deep(item: _Item) -> Exception:  # the nodes passed this rule when they were parsed
    return CorruptCheckpointError(f"{tree.join(item[2][:5])}...: tree nests deeper than {tree.MAX_DEPTH} levels")


ABSENT = _ABSENT  # restore() with this target returns the checkpoint's own structure
