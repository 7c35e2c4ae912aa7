"""The package's layers, and the test that every import runs down them (README: "Layers").

A module may import from its own layer and from the layers listed before it, never from one listed after;
and no modules import each other in a circle, even within one layer. Every import counts: at the top of a
module, inside a function (a deferred import), and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "trainstate"

# The layers, from the ground up: each name is a top-level module or subpackage of trainstate.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_arguments", "_optional", "_gc", "_hashes", "_checksum", "_version", "_cores"),  # leaves
    ("_keys", "_rng", "_seeding", "_sample_stream", "_data", "_replay"),  # keys, RNG, seeding, the data position
    ("_transforms",),  # chunk codecs: zstd, AES-GCM
    ("_tree",),  # the state tree: nodes, the walker, the JSON grammar, decode
    ("_format",),  # manifest, data files, dtypes, archive, the run directory's names
    ("_storage",),  # the Storage contract and its backends
    ("_frameworks",),  # adapters: the only modules that import torch / jax
    ("_state",),  # a live state as tree nodes (asks the adapters)
    ("_save",),  # encode -> plan -> write -> commit; staging; the background queue
    ("_incremental",),  # the shared pool
    ("_distributed",),  # coordinators, the collective plan and save
    ("_restore",),  # manifest -> plan -> read -> finish
    ("_saving",),  # the save() verb: one process or a collective
    ("_history",),  # the run's save records
    ("_manager",),  # policies, committer, async writer, lock, preemption, the manager
    ("_convert",),  # export, import, average, consolidate, pack, ONNX
    ("integrations",),  # Lightning, the HF Trainer
    ("__init__",),  # the flat public API
    ("_demo",),
    ("_cli",),  # the command line
    ("__main__",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module(path: Path) -> str:
    parts = ["trainstate", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> set[tuple[str, int, bool]]:
    """The trainstate modules ``name`` imports: each with a line that imports it, and whether that import is
    for type checking only (under ``if TYPE_CHECKING:``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found: set[tuple[str, int, bool]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*above, *([node.module] if node.module else [])])
            # ``from trainstate import _tree`` imports the module _tree; ``from trainstate import save`` the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update((t, node.lineno, id(node) in typing_only) for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_is_in_a_layer():
    assert sorted({_layer(m) for m in MODULES} - LAYER.keys()) == []


def test_every_import_runs_down_the_layers():
    upward = [
        f"{MODULES[a].relative_to(PACKAGE.parent)}:{line} imports {b} ({_layer(a)} is below {_layer(b)})"
        for a, targets in GRAPH.items()
        for b, line, _ in targets
        if LAYER[_layer(b)] > LAYER[_layer(a)]
    ]
    assert sorted(upward) == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_modules_import_each_other_in_a_circle():
    """Imports for type checking only are left out: an annotation naming a class of a module that imports
    this one runs nothing. They still count for the layers (test above)."""
    assert _circles({a: {b for b, _, typing in targets if not typing} for a, targets in GRAPH.items()}) == []


@pytest.mark.parametrize(
    ("graph", "circles"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_the_circle_finder_finds_circles(graph, circles):
    assert _circles(graph) == circles


def test_an_upward_import_would_be_caught(tmp_path):
    """The reader sees an import deferred inside a function and one under TYPE_CHECKING, as the tests above
    need it to (an upward import added to a real module was seen failing them, then removed)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from trainstate._restore.checkpoint import Checkpoint\n"
        "def f():\n    from trainstate._manager import manager\n"
    )
    (tmp_path / "probe.py").write_text(source)
    found = _imports("trainstate._format.probe", tmp_path / "probe.py")
    assert found == {("trainstate._restore.checkpoint", 3, True), ("trainstate._manager.manager", 5, False)}
    assert all(LAYER[_layer(b)] > LAYER["_format"] for b, _, _ in found)
