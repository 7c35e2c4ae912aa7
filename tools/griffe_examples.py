"""A griffe extension for the docs site: trainstate's ``Example:`` sections render as examples.

The project's docstrings head their examples ``Example:`` (Google style allows both spellings); griffe
reads only ``Examples:`` as an examples section and renders ``Example:`` as an admonition of Markdown text,
where ``>>>`` lines become nested quotes and ``[500, 1000]`` an unresolved link. This renames the header
as each object is loaded, so the docstrings keep the spelling the project (and its docstring test) uses.

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


class ExampleSections(griffe.Extension):
    """Rewrite each loaded object's ``Example:`` header to ``Examples:``.

    Example:
        >>> ExampleSections().on_instance(obj=some_griffe_object)
    """

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        """Rename the header in ``obj``'s docstring, if it has one.

        Example:
            >>> ExampleSections().on_instance(obj=griffe.Function("f", docstring=griffe.Docstring("Example:")))
        """
        if obj.docstring is not None:
            obj.docstring.value = _HEADER.sub(r"\1Examples:", obj.docstring.value)
