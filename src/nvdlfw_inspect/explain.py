"""Feature documentation for people: which loaded features a name means, and docstrings as plain text.

Shared by ``debug_api.explain_features`` and ``nvdlfw-inspect explain``, so both take the same names:
``namespace.Feature``, a bare ``Feature`` (every namespace's feature of that name), or ``all``.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Iterable

from nvdlfw_inspect.errors import closest

ALL = "all"
_BANNER = re.compile(r"^\s*([-=*~^#_+])\1{2,}\s*$")  # a reST heading underline or a line of stars
_ROLE = re.compile(r":[\w:.-]+:`([^`]+)`")  # :class:`Name` -> Name
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`")  # ``code`` and `text` -> their text
_STRONG = re.compile(r"\*\*([^*]+)\*\*")


def feature_matches(name: str, known: Iterable[str]) -> list[str]:
    """The ``namespace.Feature`` names that ``name`` means: itself, every feature for ``all``, or, for a bare
    feature name, each namespace's feature of that name (two namespaces may both have it)."""
    known = list(known)
    if name == ALL:
        return known
    if name in known:
        return [name]
    return [qualified for qualified in known if qualified.rpartition(".")[2] == name]


def suggestion(name: str, known: Iterable[str]) -> str | None:
    """The qualified or bare feature name closest to ``name``, for a "did you mean"."""
    known = list(known)
    return closest(name, [*known, *{qualified.rpartition(".")[2] for qualified in known}])


def plain_text(doc: str | None) -> str:
    """A docstring as text for a terminal: indentation removed paragraph by paragraph (a feature's docstring
    may have its parent's appended), reST markup and heading underlines dropped."""
    if not doc or not doc.strip():
        return "(no documentation)"
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(doc))
    text = "\n\n".join(textwrap.dedent(paragraph) for paragraph in paragraphs)
    lines = [line.rstrip() for line in text.splitlines() if not _BANNER.match(line)]
    text = "\n".join(lines)
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(lambda match: match.group(1) or match.group(2), text)
    return _STRONG.sub(r"\1", text).strip()


def explanation(name: str, doc: str | None) -> str:
    """``name`` on a line of its own, then the documentation as plain text, indented under it."""
    return f"{name}\n{textwrap.indent(plain_text(doc), '  ', lambda line: bool(line.strip()))}"
