"""The getting-started pages' code runs as written (docs/getting-started/*.md).

Each page is run top to bottom in a fresh directory: its ```python blocks in one namespace, in order, as a
reader pastes them; its ```console lines (``$ trainstate ...``) through the CLI's ``main`` in the same
process, each expected to exit 0. A python block right after ``<!-- file: NAME -->`` is written to NAME
instead of run, for a console line to launch (``$ torchrun ... NAME``): other console commands run as
processes, with ``torchrun`` as ``python -m torch.distributed.run``; lines a page shows under a command
must be in what it printed. ```bash blocks (installs) are not run.
The pages' own ``assert`` lines are what is checked: a resumed run equal to an uninterrupted one, an
exported file equal to the model.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "getting-started"
BLOCK = re.compile(r"(?:<!--\s*file:\s*(?P<file>[\w.-]+)\s*-->\s*\n)?```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)
SLOW = {"many-ranks.md"}  # two torchrun launches of two ranks each: about a minute on this machine


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    return [(m["lang"], m["body"], m["file"]) for m in BLOCK.finditer(page.read_text())]


def commands(body: str) -> list[tuple[str, list[str]]]:
    """A console block's ``$ `` commands, each with the output lines the page shows under it."""
    out: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif line.strip() and out:
            out[-1][1].append(line.strip())
    return out


def run_page(page: Path, where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainstate._cli import main

    monkeypatch.chdir(where)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for number, (lang, body, file) in enumerate(blocks(page), 1):
        if lang == "python" and file:
            (where / file).write_text(body + "\n")
        elif lang == "python":
            exec(compile(body, f"{page.name} block {number}", "exec"), namespace)
        elif lang == "console":
            for command, shown in commands(body):
                argv = shlex.split(command)
                if argv[0] == "trainstate":
                    out = io.StringIO()
                    with contextlib.redirect_stdout(out):
                        code = main(argv[1:])
                    output = out.getvalue()
                    assert code == 0, f"{page.name}: $ {command}\n{output}"
                else:
                    if argv[0] == "torchrun":
                        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
                    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
                    output = done.stdout
                    assert done.returncode == 0, f"{page.name}: $ {command}\n{done.stdout}\n{done.stderr}"
                for line in shown:
                    assert line in output, f"{page.name}: $ {command} did not print {line!r}:\n{output}"
        else:
            assert lang in ("bash", "text"), f"{page.name} block {number}: a ```{lang} block this test cannot run"


@pytest.mark.parametrize(
    "name",
    [pytest.param(p.name, marks=[pytest.mark.slow] if p.name in SLOW else []) for p in sorted(PAGES.glob("*.md"))],
)
def test_getting_started_page_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = PAGES / name
    assert any(lang == "python" for lang, _, _ in blocks(page)), f"{name} has no python block to run"
    run_page(page, tmp_path, monkeypatch)


def test_the_runner_runs_what_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing assert in a page fails the test; so do a console command that fails, or one that does not
    print what the page shows."""
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'the page is wrong'\n```\n")
    with pytest.raises(AssertionError, match="the page is wrong"):
        run_page(page, tmp_path, monkeypatch)
    page.write_text("```console\n$ trainstate verify no/such/checkpoint\n```\n")
    with pytest.raises(AssertionError, match="trainstate verify"):
        run_page(page, tmp_path, monkeypatch)
    page.write_text('```console\n$ trainstate keygen --json\n"key": 42\n```\n')
    with pytest.raises(AssertionError, match="did not print"):
        run_page(page, tmp_path, monkeypatch)


def test_the_readme_training_loop_keeps_its_last_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's loop, run as written (its ``...`` as the optimizer step): the newest checkpoint is the
    last step done, so ``mgr.latest()`` is the model the loop ended with, not the last periodic save's."""
    import numpy as np

    import trainstate

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## In the training loop") :]
    recipe = BLOCK.search(section)
    assert recipe is not None and recipe["lang"] == "python"
    monkeypatch.chdir(tmp_path)
    total_steps = 1_234  # periodic saves at 0, 500 and 1000
    state = {"w": np.zeros(4)}
    namespace: dict[str, object] = {"trainstate": trainstate, "state": state, "total_steps": total_steps, "v": 0.5}
    exec(compile(recipe["body"], "README.md, In the training loop", "exec"), namespace)
    latest = trainstate.CheckpointManager("runs/exp1", read_only=True).latest()
    assert latest is not None and latest.step == total_steps - 1
