"""Which config sections could both configure one feature for a layer, judged from their selectors alone.

Routing a layer that two sections select for one feature raises (as in the reference framework), but two selectors
that merely could overlap are no error: ``.*self_attention.*`` and ``.*mlp.*`` both match ``self_attentionmlp``,
a name no model has. So what is found here is advice, printed by ``validate`` as warnings with a witness name: a
layer name built from the selectors (``candidate_names``) that both select.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from nvdlfw_inspect.config_manager import ConfigSpec, LayerSpec, named_overlaps
from nvdlfw_inspect.regex_safety import regex_parser


def possible_overlaps(specs: Sequence[ConfigSpec]) -> list[str]:
    """Each two sections that configure one feature for layers their selectors show to overlap, in words: those
    ``named_overlaps`` finds (the same selector, a shared exact name), then those a witness name shows. Only pairs
    that share a feature are compared, and pairs of exact-name selectors never (hashing found theirs)."""
    found = named_overlaps(specs)
    by_feature: dict[tuple[str, str], list[ConfigSpec]] = defaultdict(list)
    for spec in specs:
        for feature in spec.features():
            by_feature[feature].append(spec)
    pairs: dict[tuple[str, str], tuple[ConfigSpec, ConfigSpec, list[str]]] = {}
    for (namespace, feature), group in by_feature.items():
        for i, first in enumerate(group):
            for second in group[i + 1 :]:
                if first.layer_spec.exact_layer_names is not None and second.layer_spec.exact_layer_names is not None:
                    continue
                if first.layer_spec.signature() == second.layer_spec.signature():
                    continue
                pairs.setdefault((first.name, second.name), (first, second, []))[2].append(f"{namespace}.{feature}")
    candidates: dict[int, list[str]] = {}
    for first, second, features in pairs.values():
        which = selection_overlap(first.layer_spec, second.layer_spec, candidates)
        if which is not None:
            found.append(
                f"sections '{first.name}' and '{second.name}' both configure {sorted(features)} for {which}: "
                "routing a layer both select raises an error; if your model has such a layer, merge the two sections "
                "or narrow one's selector"
            )
    return found


def selection_overlap(a: LayerSpec, b: LayerSpec, cache: dict[int, list[str]] | None = None) -> str | None:
    """Which layers both selectors select, in words (None: not shown by the selectors alone): the same selector;
    the exact names one gives that the other selects; else a witness name, generated from the selectors
    (``candidate_names``), that both select by its name. Two ``layer_numbers``/``layer_types`` selectors are not
    compared: whether they overlap depends on the layers' names and declared types, checked at routing. ``cache``:
    the candidate names of specs by ``id``, for a caller comparing many pairs."""
    if a.signature() == b.signature():
        return "the same layers"
    if a.exact_layer_names is not None or b.exact_layer_names is not None:
        exact, other = (a, b) if a.exact_layer_names is not None else (b, a)
        common = sorted(name for name in exact.exact_layer_names if other.matches(name))
        return f"layers {common}" if common else None
    if a.name_regex is None and b.name_regex is None:
        return None
    cache = {} if cache is None else cache
    for spec in (a, b):
        if id(spec) not in cache:
            cache[id(spec)] = candidate_names(spec)
    witness = next((name for name in _pairs(cache[id(a)], cache[id(b)]) if a.matches(name) and b.matches(name)), None)
    return None if witness is None else f"layers such as {witness!r}"


def _pairs(first: list[str], second: list[str]) -> Iterator[str]:
    """Each candidate, then the first few joined with one of the other selector's (``model.`` + ``fc1``)."""
    yield from first
    yield from second
    for x in first[:_JOINED]:
        for y in second[:_JOINED]:
            yield from (x + y, y + x, f"{x}.{y}", f"{y}.{x}")


def candidate_names(spec: LayerSpec) -> list[str]:
    """A few layer names the selector may select (each is checked with ``matches`` before it is used): its exact
    names, strings its name regex matches, or its layer types each followed by its first layer numbers."""
    if spec.exact_layer_names is not None:
        return sorted(spec.exact_layer_names)
    if spec.name_regex is not None:
        return regex_samples(spec.name_regex)
    types = [""]
    if spec.type_names is not None and not spec.all_types:
        types = sorted(spec.type_names)
    elif spec.type_regex is not None and not spec.all_types:
        types = regex_samples(spec.type_regex)
    numbers = [str(r.start) for r in spec.numbers or []] if not spec.all_numbers else []
    return [f"{t}.{n}" if t else n for t in types for n in numbers] if numbers else types


_SAMPLES = 12  # strings generated per regex (and per part of one)
_JOINED = 4  # candidates of each selector joined with the other's
_SAMPLE_CHARS = "a0._-xA/ :"  # tried, in order, as the member of a character class
_CATEGORY_REGEX = {
    "CATEGORY_DIGIT": r"\d",
    "CATEGORY_NOT_DIGIT": r"\D",
    "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S",
    "CATEGORY_WORD": r"\w",
    "CATEGORY_NOT_WORD": r"\W",
}


def regex_samples(pattern: re.Pattern) -> list[str]:
    """Up to ``_SAMPLES`` strings built from the parse tree of ``pattern``: a literal as itself, ``.`` or a class as
    one member, a repeat ``min`` and ``min + 1`` times, each alternative of a branch. Anchors, lookarounds and group
    references add nothing, so a sample need not match: callers check each with the pattern itself."""
    try:
        tree = regex_parser.parse(pattern.pattern, pattern.flags)
    except (re.error, RecursionError, OverflowError):
        return []
    return _sequence_samples(list(tree))


def _sequence_samples(items: list) -> list[str]:
    samples = [""]
    for op, arg in items:
        options = _node_samples(op, arg)
        if not options:
            return []
        samples = list(dict.fromkeys(a + b for a in samples for b in options))[:_SAMPLES]
    return samples


def _node_samples(op: Any, arg: Any) -> list[str]:
    c = regex_parser
    if op is c.LITERAL:
        return [chr(arg)]
    if op is c.NOT_LITERAL:
        return [next(ch for ch in _SAMPLE_CHARS if ord(ch) != arg)]
    if op is c.ANY:
        return [_SAMPLE_CHARS[0]]
    if op is c.IN:
        member = next((ch for ch in _class_candidates(arg) if _in_class(ch, arg)), None)
        return [] if member is None else [member]
    if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)):
        low, high, sub = arg
        counts = [low, low + 1] if high > low else [low]
        return list(dict.fromkeys(s * n for s in _sequence_samples(list(sub)) for n in counts))[:_SAMPLES]
    if op is c.SUBPATTERN:
        return _sequence_samples(list(arg[-1]))
    if op is getattr(c, "ATOMIC_GROUP", None):
        return _sequence_samples(list(arg))
    if op is c.BRANCH:
        return [s for alternative in arg[1] for s in _sequence_samples(list(alternative))][:_SAMPLES]
    if op is c.GROUPREF_EXISTS:
        _, yes, no = arg
        return (_sequence_samples(list(yes)) + (_sequence_samples(list(no)) if no else [""]))[:_SAMPLES]
    return [""]


def _class_candidates(items: list) -> list[str]:
    """The characters a class names first (its literals, the starts of its ranges), then ``_SAMPLE_CHARS``."""
    c = regex_parser
    named = [chr(arg if op is c.LITERAL else arg[0]) for op, arg in items if op in (c.LITERAL, c.RANGE)]
    return named + list(_SAMPLE_CHARS)


def _in_class(ch: str, items: list) -> bool:
    c = regex_parser
    negate = bool(items) and items[0][0] is c.NEGATE
    found = False
    for op, arg in items:
        if op is c.LITERAL:
            found = found or ord(ch) == arg
        elif op is c.RANGE:
            found = found or arg[0] <= ord(ch) <= arg[1]
        elif op is c.CATEGORY:
            category = _CATEGORY_REGEX.get(str(arg))
            found = found or (category is not None and re.fullmatch(category, ch) is not None)
    return found != negate
