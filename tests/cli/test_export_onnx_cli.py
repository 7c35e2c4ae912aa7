"""``trainstate export-onnx``: the user's model and example inputs named as ``module:function`` of their own
code, found from the current directory the way ``python -m`` finds it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import trainstate  # noqa: E402
from helpers import cli  # noqa: E402

USER_MODULE = textwrap.dedent(
    """
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def example():
        return torch.ones(2, 6)
    """
)


def run(cwd: Path, *args: str, code: int) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "trainstate", "export-onnx", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def test_export_onnx_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mynet.py").write_text(USER_MODULE)
    user: dict[str, object] = {}
    exec(USER_MODULE, user)  # the same code the command imports as mynet
    torch.manual_seed(0)
    model = user["build"]()  # type: ignore[operator]
    trainstate.save(tmp_path / "ckpt", {"model": model, "optim": torch.optim.SGD(model.parameters()), "step": 5})

    proc = run(tmp_path, "ckpt", "net.onnx", "--factory", "mynet:build", "--inputs", "mynet:example", "--json", code=0)

    report = json.loads(proc.stdout)  # stdout holds the JSON document and nothing else
    assert report["path"] == "net.onnx" and report["nbytes"] == (tmp_path / "net.onnx").stat().st_size
    session = ort.InferenceSession(str(tmp_path / "net.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 6)
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0], want, rtol=1e-5)

    # The refusals, through the same main() in this process (the subprocess above tested the entry point and
    # the import from the current directory; each subprocess costs seconds of importing torch).
    monkeypatch.chdir(tmp_path)
    again = cli("export-onnx", "ckpt", "net.onnx", "--factory", "mynet:build", "--inputs", "mynet:example", code=8)
    assert "pass --overwrite" in again.stderr
    bad = cli("export-onnx", "ckpt", "x.onnx", "--factory", "mynet", "--inputs", "mynet:example", code=2)
    assert "--factory must be MODULE:FUNCTION" in bad.stderr
    missing = cli("export-onnx", "ckpt", "x.onnx", "--factory", "json:build", "--inputs", "mynet:example", code=2)
    assert "json has no 'build'" in missing.stderr
    assert not (tmp_path / "x.onnx").exists()
