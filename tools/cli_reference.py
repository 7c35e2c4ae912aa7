"""The ``trainstate`` command's reference page, rendered from its argparse parser: it cannot go stale.

An mkdocs hook (``hooks:`` in mkdocs.yml): a page holding the marker ``<!-- trainstate-cli -->`` gets it
replaced by one section per command (usage, what it does, every argument with its help and default), in
the order ``trainstate --help`` lists them, plus the exit-code table. A command added to the parser
appears on the page at the next build, with nothing to edit here.

Example:
    >>> from tools.cli_reference import render
    >>> print(render()[:60])
    Every command below is `trainstate COMMAND ...` (or `python
"""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- trainstate-cli -->"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Each command's name, parser and one-line help, in the order ``--help`` lists them."""
    for action in parser._actions:  # argparse keeps its actions here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            seen: set[int] = set()
            out = []
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias maps to a parser already listed
                    seen.add(id(sub))
                    out.append((name, sub, helps.get(name, "")))
            return out
    raise AssertionError("the trainstate parser has no subcommands")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            flags = ", ".join(action.option_strings)
            takes_value = action.nargs != 0
            metavar = action.metavar or action.dest.upper()
            name = f"`{flags} {metavar}`" if takes_value else f"`{flags}`"
        else:
            name = f"`{action.metavar or action.dest}`"
            if action.nargs in ("+", "*"):
                name += " (one or more)" if action.nargs == "+" else " (any number)"
        help_text = action.help or ""
        if action.choices and not isinstance(action.choices, dict):
            help_text += f" (one of: {', '.join(str(c) for c in action.choices)})"
        if action.required and action.option_strings:
            help_text += " (required)"
        default: Any = action.default
        shown = "" if default in (None, False, [], argparse.SUPPRESS) or not action.option_strings else f"`{default}`"
        rows.append(f"| {name} | {_cell(help_text)} | {shown} |")
    return rows


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The reference as Markdown: an overview, one section per command, and the exit codes.

    Example:
        >>> "## trainstate verify" in render()
        True
    """
    if parser is None:
        from trainstate._cli import build_parser

        parser = build_parser()
    from trainstate._cli import EXIT_CODES

    commands = _subcommands(parser)
    parts = [
        "Every command below is `trainstate COMMAND ...` (or `python -m trainstate COMMAND ...`); "
        "`trainstate COMMAND --help` prints the same text. This page is generated from the command's own "
        "argument parser when the site is built.",
        "",
        "| command | what it does |",
        "|---|---|",
        *(f"| [`{name}`](#trainstate-{name}) | {_cell(text)} |" for name, _, text in commands),
        "",
    ]
    for name, sub, text in commands:
        usage = " ".join(sub.format_usage().split())
        if usage.startswith("usage: "):
            usage = usage[len("usage: ") :]
        rows = _argument_rows(sub)
        parts += [f"## trainstate {name}", "", (sub.description or text).rstrip(".") + ".", ""]
        parts += ["```text", usage, "```", ""]
        if rows:
            parts += ["| argument | meaning | default |", "|---|---|---|", *rows, ""]
    parts += ["## Exit codes", "", "```text", EXIT_CODES.strip("\n"), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """The mkdocs hook: replace the marker with the rendered reference.

    Example:
        >>> on_page_markdown("# CLI\\n\\n<!-- trainstate-cli -->\\n").count("## trainstate ls")
        1
    """
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown
