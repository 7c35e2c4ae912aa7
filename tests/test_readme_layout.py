"""The README's layout of src/trainstate/ names files that exist, and every module and folder there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "trainstate"


def _layout() -> list[tuple[str, str]]:
    """(entry, text) per entry of the layout block: ``_save/`` with the text beside it and under it."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```\nsrc/trainstate/\n") + len("```\nsrc/trainstate/\n")
    block = readme[start : readme.index("```", start)]
    entries: list[tuple[str, str]] = []
    for line in block.splitlines():
        head = re.match(r"  (\S+)\s", line)
        if head:
            entries.append((head.group(1), line[head.end() :]))
        elif entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    return entries


def test_every_file_the_layout_names_exists() -> None:
    missing = []
    for entry, text in _layout():
        if entry.startswith(("bench/", "tools/")):
            continue
        folder = PACKAGE / entry if entry.endswith("/") else PACKAGE
        for name in re.findall(r"\b[A-Za-z_]\w*\.py\b", entry + " " + text):
            if not (folder / name).exists() and not (PACKAGE / name).exists():
                missing.append(f"{entry} {name}")
    assert missing == []


def test_the_layout_lists_every_module_and_folder() -> None:
    listed = " ".join(entry + " " + text for entry, text in _layout())
    present = [
        p.name + ("/" if p.is_dir() else "")
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and not p.name.startswith("__"))
    ]
    assert [name for name in present if name.rstrip("/") not in listed] == []
