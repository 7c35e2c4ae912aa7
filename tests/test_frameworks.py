"""Framework adapters: a typed Protocol mypy checks, and the only place that knows torch's classes."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trainstate import _frameworks as frameworks
from trainstate._frameworks import Adapter
from trainstate._frameworks import numpy as numpy_adapter
from trainstate._frameworks import torch as torch_adapter

SRC = Path(__file__).parent.parent / "src"
CORE = [SRC / "trainstate" / "_restore", SRC / "trainstate" / "_save", SRC / "trainstate" / "_format"]
MEMBERS = [name for name in vars(Adapter) if not name.startswith("_")]


def mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    """mypy --strict on ``code``; trainstate's own errors and the frameworks' internals are not its business."""
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nstrict = True\n"
        "[mypy-torch.*,numpy.*,ml_dtypes.*]\nfollow_imports = skip\n"
        "[mypy-trainstate.*]\nignore_errors = True\n"
    )
    (tmp_path / "check.py").write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", ".cache", "check.py"],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": f"{SRC}:{tmp_path}"},
        capture_output=True,
        text=True,
    )


@pytest.mark.slow  # ~10 s of mypy; CI's own mypy run checks both adapters (NUMPY: Adapter, _torch() -> Adapter)
def test_mypy_checks_every_adapter_against_the_protocol(tmp_path):
    (tmp_path / "incomplete.py").write_text("def is_array(value: object) -> bool:\n    return False\n")
    result = mypy(
        tmp_path,
        """
        import incomplete
        from trainstate._frameworks import Adapter
        from trainstate._frameworks import numpy as numpy_adapter
        from trainstate._frameworks import torch as torch_adapter

        good: list[Adapter] = [numpy_adapter, torch_adapter]
        bad: Adapter = incomplete
        """,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "check.py:8:" in errors[0], result.stdout + result.stderr  # only the incomplete one


@pytest.mark.parametrize("module", [numpy_adapter, torch_adapter], ids=["numpy", "torch"])
def test_every_adapter_has_every_protocol_member_with_its_parameters(module):
    for name in MEMBERS:
        wanted = list(inspect.signature(getattr(Adapter, name)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(module, name)).parameters) == wanted, name


def test_the_restore_and_save_core_name_no_torch_class():
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for folder in CORE
        for path in sorted(folder.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "torch." in line or "__module__" in line
    ]
    assert not found, "framework knowledge outside trainstate._frameworks:\n" + "\n".join(found)


def test_the_save_restore_and_manager_core_import_no_framework():
    """torch and JAX reach the core only through the adapter table (the async staging copy included)."""
    core = [*CORE, SRC / "trainstate" / "_manager", SRC / "trainstate" / "_incremental"]
    paths = [p for folder in core for p in sorted(folder.rglob("*.py"))] + [SRC / "trainstate" / "_state.py"]
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in paths
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*(import|from)\s+(torch|jax|jaxlib)\b", line)
    ]
    assert found == []


def test_the_object_hooks_know_torch_modules_and_data_loaders():
    class Net(torch.nn.Module):  # a user's subclass, defined outside torch
        pass

    loader = torch.utils.data.DataLoader(list(range(4)))
    assert frameworks.load_takes_strict(Net()) and not frameworks.rebuilt_from_checkpoint(Net())
    assert frameworks.rebuilt_from_checkpoint(loader) and not frameworks.load_takes_strict(loader)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for other in (optimizer, {"a": 1}, np.zeros(2)):
        assert not frameworks.load_takes_strict(other) and not frameworks.rebuilt_from_checkpoint(other)


def test_asking_the_adapters_never_imports_a_framework():
    code = """
        import sys
        import numpy as np
        import trainstate
        from trainstate import _frameworks as f
        class Module:  # named like torch's, but not torch's
            def state_dict(self): return {}
        assert not f.load_takes_strict(Module()) and not f.rebuilt_from_checkpoint(Module())
        assert f.adapter_for(np.zeros(2)) is f.NUMPY and f.adapter_for([1]) is None
        f.after_restore({"w": np.zeros(2)})
        assert "torch" not in sys.modules, "torch was imported"
    """
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=True, env={**os.environ, "PYTHONPATH": str(SRC)}
    )
