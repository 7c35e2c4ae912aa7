"""A griffe extension for the docs site: trainstate's docstrings render as the project writes them.

The project's docstrings head their examples ``Example:`` (Google style allows both spellings); griffe
reads only ``Examples:`` as an examples section and renders ``Example:`` as an admonition of Markdown text,
where ``>>>`` lines become nested quotes and ``[500, 1000]`` an unresolved link. They also name other
objects with Sphinx roles (``:class:`Checkpoint```) and end a line with reST's ``::`` before a literal
block, which Markdown shows as they are typed. This renames the header, turns each role into inline code
and ``::`` into ``:`` as each object is loaded, so the docstrings keep the spelling the project (and its
docstring test) uses.

Example:
    In mkdocs.yml, under the mkdocstrings python handler's options::

        extensions:
          - tools/griffe_examples.py:ExampleSections
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc):`~?([^`]+)`")
_LITERAL_BLOCK = re.compile(r"(\S)::[ \t]*$", re.MULTILINE)  # reST's "text::" before an indented block


class ExampleSections(griffe.Extension):
    """Rewrite each loaded object's ``Example:`` header to ``Examples:``, and its Sphinx roles to code.

    Example:
        >>> ExampleSections().on_instance(obj=some_griffe_object)
    """

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        """Rename the header in ``obj``'s docstring, if it has one, and unwrap its roles.

        Example:
            >>> ExampleSections().on_instance(obj=griffe.Function("f", docstring=griffe.Docstring("Example:")))
        """
        if obj.docstring is not None:
            text = _HEADER.sub(r"\1Examples:", obj.docstring.value)
            text = _LITERAL_BLOCK.sub(r"\1:", text)
            obj.docstring.value = _ROLE.sub(r"`\1`", text)
