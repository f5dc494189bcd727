"""Reading YAML configs safely: no repeated key, no alias bomb, errors at their line and column.

Separate from ``config_manager`` so that PyYAML is imported only when a config file is read (a config
given as a dict, and every ``import``, need none of it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from nvdlfw_inspect.errors import ConfigError

# Nodes a document may reach once its aliases are expanded: configs reuse small blocks with
# anchors; a billion-laughs document of a few hundred bytes expands to billions.
MAX_EXPANDED_NODES = 100_000


class _ExpansionError(yaml.YAMLError):
    """The document's aliases expand it beyond ``MAX_EXPANDED_NODES`` nodes, or refer to themselves."""


def _expanded_size(root: yaml.Node) -> int | None:
    """Nodes in the document with every alias replaced by a copy of its anchor, counted without
    expanding (a shared node is counted once per use); None when an alias refers to its own anchor."""
    sizes: dict[int, int] = {}
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            ancestors.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
        elif id(node) in ancestors:
            return None
        elif id(node) not in sizes:
            ancestors.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class _ConfigLoader(yaml.SafeLoader):
    """Safe YAML loading that rejects a key repeated in one mapping (YAML would keep only the last)
    and a document whose aliases expand it beyond ``MAX_EXPANDED_NODES`` nodes."""

    uses_aliases = False

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            self.uses_aliases = True
        return super().compose_node(parent, index)

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        if self.uses_aliases:
            size = _expanded_size(node)
            if size is None:
                raise _ExpansionError("an alias (*name) refers to its own anchor (&name): the config would be infinite")
            if size > MAX_EXPANDED_NODES:
                raise _ExpansionError(
                    f"its aliases (*name) expand it to {size} values; at most {MAX_EXPANDED_NODES} are allowed "
                    "(anchors are meant for reusing small blocks)"
                )
        return node


def _construct_unique_mapping(loader: _ConfigLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # keys from '<<: *anchor' may be overridden on purpose
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # the regular constructor reports unhashable keys
        if key in first_line:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r} (first given on line {first_line[key] + 1})",
                key_node.start_mark,
            )
        first_line[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_ConfigLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_yaml(path: Path, source: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.load(handle, Loader=_ConfigLoader)
    except _ExpansionError as err:
        raise ConfigError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        raise _syntax_error(f"{source}: not valid YAML: {err}", err) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source}: not UTF-8 text: {err}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def _syntax_error(message: str, err: yaml.YAMLError) -> ConfigError:
    """A ConfigError at the line and column where the parser found the problem (or, lacking that, its context)."""
    error = ConfigError(message)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if mark is not None:
        error.line, error.column = mark.line + 1, mark.column + 1
    return error


def config_line(path: str | os.PathLike, key_path: tuple[str, ...]) -> int | None:
    """The 1-based line in the YAML file ``path`` of the key (or list item) at ``key_path``, or of its deepest
    existing parent; None if the file cannot be parsed. The key's line, not its value's: a block value starts
    on the next line, and an unknown key is on the key's."""
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for key in key_path:
        if isinstance(node, yaml.MappingNode):
            found = next(((k.start_mark, value) for k, value in node.value if str(k.value) == key), None)
        elif isinstance(node, yaml.SequenceNode) and key.isdigit() and int(key) < len(node.value):
            found = (node.value[int(key)].start_mark, node.value[int(key)])
        else:
            found = None
        if found is None:
            break
        line, node = found[0].line + 1, found[1]
    return line
