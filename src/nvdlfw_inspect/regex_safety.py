r"""Whether a layer regex can take time exponential in the length of a name: Python's ``re`` backtracks and has
no time limit, so one such regex in a config hangs the first routing call of a layer it does not match.

The time explodes when a repeated part can split one text between its iterations in more than one way, as
``(\w+\.?)+`` can ("ab" is one iteration or two): ``re`` tries every split of a name it does not match. This
module finds such parts on ``re``'s own parse tree, by which characters each part can start with and which
can follow it: a varying repeat inside a repeated part whose characters can also begin what follows it,
a repeated part that can match nothing, or repeated alternatives that can start alike. Delimited repeats,
as in ``(layers\.\d+\.)+``, split one way only and pass. Character classes are judged on a sample of
characters (ASCII and a few beyond), a superset where unsure: when in doubt a regex is refused, never hung.
"""

from __future__ import annotations

import re
from typing import Any

try:  # the parser of the re module: re._parser from Python 3.11, sre_parse before
    from re import _parser as regex_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as regex_parser  # type: ignore[no-redef]

SAFE_FORMS = (
    "a regex none of whose repeated parts can split a text between its iterations in more than one way: no "
    r"repeat inside a repeated group that can swallow what follows it ('(\w+\.?)+'; write '^[\w.]+fc1$'), no "
    r"repeated group that can match nothing ('(x*)*'), no repeated alternatives that can start alike ('(a|aa)+'); "
    r"a delimited repeat such as '(layers\.\d+\.)+' is fine, and so is a possessive repeat ('++', '*+') or an "
    "atomic group ('(?>...)'), which never backtrack"
)

_SAMPLE = frozenset(map(chr, range(128))) | frozenset("éßİ\u00a0\u0660\u4e00\udcff")
_CATEGORIES = {"DIGIT": r"\d", "NOT_DIGIT": r"\D", "SPACE": r"\s", "NOT_SPACE": r"\S", "WORD": r"\w", "NOT_WORD": r"\W"}
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT")  # re's opcodes are compared by name: Python 3.11 added possessive ones
_NOTHING: frozenset[str] = frozenset()

Items = list[tuple[Any, Any]]


def backtracks(pattern: str) -> bool:
    """Whether matching ``pattern`` can take time exponential in the length of the text (see the module)."""
    return _explodes(list(regex_parser.parse(pattern)))


def _explodes(items: Items) -> bool:
    for op, arg in items:
        name = op.name
        if name in _REPEATS:
            low, high, body = arg
            first, empty = _first(body)
            if high > 1 and (empty or _splits(body, first)):
                return True
            if _explodes(body):
                return True
        elif name == "POSSESSIVE_REPEAT" or name in ("SUBPATTERN", "ASSERT", "ASSERT_NOT"):
            if _explodes(arg[-1]):
                return True
        elif name == "ATOMIC_GROUP":
            if _explodes(arg):
                return True
        elif name == "BRANCH":
            if any(_explodes(branch) for branch in arg[1]):
                return True
        elif name == "GROUPREF_EXISTS":
            if any(_explodes(branch) for branch in arg[1:] if branch):
                return True
    return False


def _splits(items: Items, after: frozenset[str]) -> bool:
    """Whether ``items``, followed by a character of ``after``, can match one text in more than one way: a
    repeat of varying count that can also swallow what comes next, a repeat of a part that itself splits,
    alternatives that can start alike. Possessive repeats and atomic groups never give characters back."""
    follow = after
    for op, arg in reversed(items):
        name = op.name
        if name in _REPEATS:
            low, high, body = arg
            first, empty = _first(body)
            if high > low and (empty or _chars(body) & follow):
                return True
            if high > 0 and _splits(body, follow | first if high > 1 else follow):
                return True
        elif name == "SUBPATTERN":
            if _splits(arg[-1], follow):
                return True
        elif name == "BRANCH":
            firsts = [_first(branch) for branch in arg[1]]
            if any(empty for _, empty in firsts):
                return True
            seen: set[str] = set()
            for first, _ in firsts:
                if seen & first:
                    return True
                seen |= first
            if any(_splits(branch, follow) for branch in arg[1]):
                return True
        elif name == "GROUPREF_EXISTS":
            return True  # what it matches depends on an earlier group: assume the worst
        first, empty = _first_of(op, arg)
        follow = first | follow if empty else first
    return False


def _first(items: Items) -> tuple[frozenset[str], bool]:
    """The characters ``items`` can start with, and whether they can match nothing."""
    chars: frozenset[str] = _NOTHING
    for op, arg in items:
        first, empty = _first_of(op, arg)
        chars |= first
        if not empty:
            return chars, False
    return chars, True


def _first_of(op: Any, arg: Any) -> tuple[frozenset[str], bool]:
    name = op.name
    if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
        return _leaf(name, arg), False
    if name in ("SUBPATTERN", "ATOMIC_GROUP"):
        return _first(arg if name == "ATOMIC_GROUP" else arg[-1])
    if name in (*_REPEATS, "POSSESSIVE_REPEAT"):
        first, empty = _first(arg[2])
        return first, empty or arg[0] == 0
    if name == "BRANCH":
        firsts = [_first(branch) for branch in arg[1]]
        return frozenset().union(*(first for first, _ in firsts)), any(empty for _, empty in firsts)
    if name in ("AT", "ASSERT", "ASSERT_NOT"):
        return _NOTHING, True
    return _SAMPLE, True  # group references and anything newer: any character, or none


def _chars(items: Items) -> frozenset[str]:
    """Every character ``items`` can match anywhere."""
    chars: frozenset[str] = _NOTHING
    for op, arg in items:
        name = op.name
        if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            chars |= _leaf(name, arg)
        elif name in ("SUBPATTERN", *_REPEATS, "POSSESSIVE_REPEAT"):
            chars |= _chars(arg[-1])
        elif name == "ATOMIC_GROUP":
            chars |= _chars(arg)
        elif name == "BRANCH":
            chars = chars.union(*(_chars(branch) for branch in arg[1]))
        elif name not in ("AT", "ASSERT", "ASSERT_NOT"):
            return _SAMPLE
    return chars


def _leaf(name: str, arg: Any) -> frozenset[str]:
    """The sample characters one character-matching node accepts, in either case (a superset when the regex
    is case-sensitive, which only makes the check stricter)."""
    if name == "LITERAL":
        chars = {chr(arg)}
    elif name == "NOT_LITERAL":
        chars = set(_SAMPLE - {chr(arg)})
    elif name == "ANY":
        return _SAMPLE
    else:
        negate = any(op.name == "NEGATE" for op, _ in arg)
        chars = {c for c in _SAMPLE if _in_class(arg, c) != negate}
    return frozenset(c for c in _SAMPLE if c in chars or c.lower() in chars or c.upper() in chars)


def _in_class(items: Items, char: str) -> bool:
    for op, arg in items:
        name = op.name
        if name == "LITERAL" and chr(arg) == char:
            return True
        if name == "RANGE" and arg[0] <= ord(char) <= arg[1]:
            return True
        if name == "CATEGORY":
            category = _CATEGORIES.get(arg.name.removeprefix("CATEGORY_").removeprefix("UNI_"))
            if category is None or re.fullmatch(category, char):
                return True  # a category we do not know: assume it holds the character
        elif name not in ("LITERAL", "RANGE", "NEGATE"):
            return True
    return False
