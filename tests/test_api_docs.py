"""Every public name is documented for the API reference, and every one is on the docs site.

The docs site (mkdocs.yml, docs/reference/) renders these docstrings; CI builds it with warnings as errors.
What a build cannot see is a name with no docstring (mkdocstrings skips it in silence) or one missing from
every reference page, so these tests check that: each name in ``trainstate.__all__``, and each public
method, property and attribute of its classes, has a docstring with an ``Example:`` section whose code
parses (attributes may instead be described in the class's ``Attributes:`` / ``Args:`` section), and
each name is rendered by a ``:::`` directive of a page under docs/reference/.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import types
from pathlib import Path

import pytest

import trainstate

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Examples?:[ \t]*$", re.MULTILINE)
SECTION = re.compile(r"^[ \t]*(Args|Arguments|Attributes|Raises|Returns|Yields|Note|Notes|Warning|See Also):[ \t]*$")
ENTRY = re.compile(r"^[ \t]+(?P<name>\w+)(?:[ \t]*\([^)]*\))?:(?:[ \t]|$)")


def public_modules() -> tuple[list[types.ModuleType], list[str]]:
    """``trainstate`` and its public submodules (no ``_`` in the path: ``errors``, ``integrations.*``), and
    the submodules whose optional framework is not installed here (CI installs every one)."""
    modules, unavailable = [trainstate], []
    for info in pkgutil.walk_packages(trainstate.__path__, "trainstate.", onerror=lambda name: None):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:  # trainstate's MissingDependencyError is one too
            unavailable.append(info.name)
    return modules, unavailable


def public_names(module: types.ModuleType) -> list[str]:
    """A module's ``__all__``; without one, the classes and functions it defines under public names."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    ]


def public_objects() -> list[tuple[str, object, types.ModuleType]]:
    """Every public name: ``(dotted name, object, the module it is public in)``."""
    out = []
    for module in public_modules()[0]:
        out += [(f"{module.__name__}.{name}", getattr(module, name), module) for name in public_names(module)]
    return out


def example_code(doc: str) -> str | None:
    """The Python of the docstring's ``Example:`` section (prompts stripped), or None when it has none."""
    match = EXAMPLE.search(doc)
    if match is None:
        return None
    indent = len(match.group("indent"))
    lines = []
    for line in doc[match.end() :].splitlines()[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the next section, at the header's indentation
        text = line.strip()
        if text.startswith(">>>") or text.startswith("..."):
            lines.append(text[4:] if len(text) > 3 else "")
    return "\n".join(lines)


def documented_entries(doc: str) -> set[str]:
    """Names described in the docstring's ``Args:`` and ``Attributes:`` sections."""
    names: set[str] = set()
    in_section = False
    for line in doc.splitlines():
        header = SECTION.match(line)
        if header:
            in_section = header.group(1) in ("Args", "Arguments", "Attributes")
            continue
        if in_section:
            if line.strip() and not line.startswith((" ", "\t")):
                in_section = False  # back at the docstring's own indentation: a new paragraph
                continue
            entry = ENTRY.match(line)
            if entry:
                names.add(entry.group("name"))
    return names


def check_docstring(where: str, doc: str | None, problems: list[str]) -> None:
    if not doc or not doc.strip():
        problems.append(f"{where}: no docstring")
        return
    code = example_code(doc)
    if code is None:
        problems.append(f"{where}: no 'Example:' section")
        return
    if not code.strip():
        problems.append(f"{where}: its 'Example:' section has no '>>>' line")
        return
    try:
        compile(code, where, "exec")
    except SyntaxError as e:
        problems.append(f"{where}: its example does not parse: {e.msg} (line {e.lineno}: {e.text!r})")


def own_doc(cls: type) -> str:
    """The class's own docstring: not the one dataclasses makes up from the signature."""
    doc = cls.__dict__.get("__doc__") or ""
    return inspect.cleandoc(doc)


def defining_class(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def class_members(cls: type) -> list[tuple[str, object, type]]:
    """Public members defined by trainstate itself (not those inherited from Exception, Protocol, ...)."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    members = []
    for name in sorted(names):
        if name.startswith("_"):
            continue
        owner = defining_class(cls, name) or cls  # a dataclass field without a default lives on no class
        if not owner.__module__.startswith("trainstate"):
            continue
        members.append((name, vars(owner).get(name, dataclasses.MISSING), owner))
    return members


def test_every_public_name_has_a_docstring_with_an_example() -> None:
    problems: list[str] = []
    for where, obj, module in public_objects():
        if inspect.isclass(obj):
            doc = own_doc(obj)
            check_docstring(where, doc, problems)
            attributes = documented_entries(doc)
            for member, value, owner in class_members(obj):
                mwhere = f"{where}.{member}"
                if isinstance(value, (property, classmethod, staticmethod)) or inspect.isfunction(value):
                    check_docstring(mwhere, inspect.getdoc(getattr(obj, member)), problems)
                elif member not in attributes and member not in documented_entries(own_doc(owner)):
                    problems.append(f"{mwhere}: an attribute not described in the class's 'Attributes:' section")
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismodule(obj):
            check_docstring(where, inspect.getdoc(obj), problems)
        else:  # a constant: its docstring is the string literal right after its assignment (what griffe reads)
            check_docstring(where, constant_docstring(module, where.rsplit(".", 1)[1]), problems)
    assert not problems, "public names the API reference cannot document:\n  " + "\n  ".join(problems)


def constant_docstring(public_in: types.ModuleType, name: str) -> str | None:
    """The attribute docstring of a module constant, found where it is assigned (maybe a module it imports)."""
    source_of = public_in.__name__
    for node in ast.parse(Path(public_in.__file__ or "").read_text()).body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            source_of = node.module or source_of
    source = Path(importlib.import_module(source_of).__file__ or "").read_text()
    body = ast.parse(source).body
    for node, after in zip(body, body[1:]):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                return inspect.cleandoc(after.value.value)
            return None
    return None


def reference_targets() -> list[str]:
    targets = []
    for page in sorted(REFERENCE.glob("*.md")):
        targets += re.findall(r"^:::[ \t]+([\w.]+)", page.read_text(), re.MULTILINE)
    return targets


def resolve(target: str) -> list[object]:
    """What a ``::: target`` directive renders: the object, or a module's public names."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        if inspect.ismodule(obj):
            return [getattr(obj, n) for n in getattr(obj, "__all__", [])]
        return [obj]
    raise AssertionError(f"docs/reference names {target!r}, which does not import")


def test_every_public_name_is_on_a_reference_page() -> None:
    rendered: list[object] = []
    targets = reference_targets()
    for target in targets:
        rendered += resolve(target)
    missing = [
        where
        for where, obj, _ in public_objects()
        if not any(obj is r for r in rendered)
        and where.rsplit(".", 1)[1] not in {t.rsplit(".", 1)[-1] for t in targets}
    ]
    assert not missing, f"public names on no page under docs/reference/ (add a '::: NAME' line): {missing}"
    unavailable = public_modules()[1]
    if unavailable:  # checked where their framework is installed (CI)
        pytest.skip(f"not importable here, so not checked: {unavailable}")


def test_the_checks_catch_what_they_are_for() -> None:
    """The helpers above find a missing example, an example that does not parse, and an undescribed field."""
    problems: list[str] = []
    check_docstring("f", "Does a thing.\n\nArgs:\n    x: a thing.", problems)
    check_docstring("g", "Does a thing.\n\nExample:\n    >>> g(1\n", problems)
    check_docstring("h", "Does a thing.\n\nExample:\n    >>> h(1)\n    2\n\nRaises:\n    E: never", problems)
    assert [p.split(":")[0] for p in problems] == ["f", "g"], problems

    @dataclasses.dataclass
    class Undocumented:
        """A record.

        Attributes:
            kept: described.

        Example:
            >>> Undocumented(1, 2)
        """

        kept: int
        forgotten: int

    Undocumented.__module__ = "trainstate.fake"
    members = {name for name, _, _ in class_members(Undocumented)}
    assert members == {"kept", "forgotten"}
    assert documented_entries(own_doc(Undocumented)) == {"kept"}


def test_the_cli_page_is_generated_from_the_parser() -> None:
    """docs/reference/cli.md is the parser itself, rendered at build time: every command has its section."""
    from tools.cli_reference import MARKER, on_page_markdown

    from trainstate._cli import build_parser

    assert MARKER in (REFERENCE / "cli.md").read_text()
    page = on_page_markdown(f"# Command line\n\n{MARKER}\n")
    commands = [name for action in build_parser()._actions for name in getattr(action, "choices", None) or {}]
    assert {"ls", "verify", "prune", "demo"} <= set(commands)
    for name in commands:
        assert f"## trainstate {name}\n" in page, name


def test_the_site_renders_example_sections_as_examples() -> None:
    """mkdocs.yml's griffe extension turns the project's ``Example:`` headers into examples sections (without
    it, griffe renders them as Markdown text: ``>>>`` lines as nested quotes), and Sphinx roles into code.
    Needs the docs extra (CI installs it)."""
    griffe = pytest.importorskip("griffe")
    from tools.griffe_examples import ExampleSections

    source = 'def f():\n    """Do :func:`it`::\n\n    Example:\n        >>> f()\n        [1, 2]\n    """\n'
    plain = griffe.visit("m", filepath=Path("m.py"), code=source)
    assert [s.kind.value for s in plain["f"].docstring.parse("google")] == ["text", "admonition"]
    fixed = griffe.visit("m", filepath=Path("m.py"), code=source, extensions=griffe.load_extensions(ExampleSections))
    sections = fixed["f"].docstring.parse("google")
    assert [s.kind.value for s in sections] == ["text", "examples"]
    assert sections[1].value == [(griffe.DocstringSectionKind.examples, ">>> f()\n[1, 2]")]
    assert sections[0].value == "Do `it`:"  # a Sphinx role and reST's '::', which Markdown would show as typed
