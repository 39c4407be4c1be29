"""YAML from files and the command line, read within bounds that no real config comes near.

``yaml.safe_load`` builds no objects but is not bounded: a 400-byte alias bomb ("billion
laughs") expands to billions of nodes for whatever walks the result, a file of 100,000 ``[``
overflows the composer's recursion, duplicate keys silently keep the last value, and a bad date
or a 5,000-digit integer escapes as ValueError. ``load_yaml`` refuses all of these with a
``ConfigError`` of one line that names the source, the line and the limit, before anything
expensive runs: depth and alias expansion are checked while the document is composed.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node

from trainforge.errors import ConfigError

MAX_FILE_BYTES = 128 * 1024  # a config or space file: real ones are a few KiB; PyYAML reads ~300 KiB a second
MAX_TEXT_CHARS = 64 * 1024  # one --set value or TRAINFORGE_* variable
MAX_DEPTH = 64  # nested sequences and mappings; real configs nest about 5 deep
MAX_NODES = 10_000  # scalars and collections, aliases expanded; PyYAML composes ~20,000 a second
MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlLimitError(ComposerError):
    """The document is well-formed but exceeds a limit (depth, alias expansion) or repeats a key."""


class YamlRefused(ConfigError):
    """Well-formed YAML refused by a limit: callers that fall back to plain text must not."""


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that caps nesting and alias expansion while composing and refuses duplicate keys.

    PyYAML's composer recurses once per nesting level (three Python frames), so depth is checked
    in ``compose_node`` before the recursion, far below Python's limit. An alias counts as many
    nodes as the subtree it names, so a bomb is refused after a few hundred bytes of input.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._expanded: dict[int, int] = {}  # id(anchored node) -> its size with aliases expanded

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # The scanner looks up to 1024 characters ahead for every open bracket: refuse deep flow
        # nesting here, before that look-ahead makes 100,000 brackets cost seconds.
        if self.flow_level >= MAX_DEPTH:
            raise YamlLimitError(None, None, _too_deep(), self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if self.check_event(AliasEvent):
            node = super().compose_node(parent, index)  # raises for an undefined alias
            size = self._expanded.get(id(node))
            if size is None:
                problem = f"alias *{_clip(event.anchor)} refers to a node that holds it"
                raise YamlLimitError(None, None, problem, event.start_mark)
            self._count(size, event)
            return node
        if self._depth >= MAX_DEPTH:
            raise YamlLimitError(None, None, _too_deep(), event.start_mark)
        before = self._nodes
        self._count(1, event)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if getattr(event, "anchor", None) is not None:
            self._expanded[id(node)] = self._nodes - before
        return node

    def _count(self, nodes: int, event: Any) -> None:
        self._nodes += nodes
        if self._nodes > MAX_NODES:
            problem = f"more than {MAX_NODES} values, the most allowed, once aliases are expanded"
            raise YamlLimitError(None, None, problem, event.start_mark)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue  # merged keys may be overridden: that is what `<<` is for
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base class refuses it with its own message
            line = key_node.start_mark.line + 1
            if key in seen:
                problem = f"duplicate key {_clip(key)!r} (first at line {seen[key]})"
                raise YamlLimitError(None, None, problem, key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document within the limits; any problem is a ConfigError naming ``source``."""
    loader = None
    try:
        loader = BoundedLoader(text)  # the reader refuses control characters here already
        return loader.get_single_data()
    except YamlLimitError as err:
        raise YamlRefused(f"{source}: YAML refused{describe_yaml_error(err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source} is not valid YAML{describe_yaml_error(err)}") from None
    except (ValueError, OverflowError) as err:
        # SafeConstructor's own bugs: a date such as 2001-13-01, an integer of more than 4300 digits.
        raise ConfigError(f"{source} is not valid YAML: {_one_line(err)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml_file(path: Path, what: str = "config file") -> Any:
    """A bounded read of a regular UTF-8 file, then ``load_yaml``."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; give a YAML file")
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"{what} {path} is not a regular file")
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_FILE_BYTES // 1024} KiB; a config is a few KiB of YAML")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); save it as UTF-8"
        ) from None
    return load_yaml(text, f"{what} {path}")


def describe_yaml_error(err: yaml.YAMLError) -> str:
    """`` at line N: problem`` in one line, whichever of PyYAML's error classes it is."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = err.problem or err.context or "syntax error"
        return f"{where}: {_one_line(problem)}"
    if isinstance(err, yaml.reader.ReaderError):
        char = f"#x{err.character:04x}" if isinstance(err.character, int) else repr(err.character)
        return f": {_one_line(err.reason)} (character {char}) at offset {err.position}"
    return f": {_one_line(err)}"


def _one_line(value: object) -> str:
    return _clip(" ".join(str(value).split()))


def _too_deep() -> str:
    return f"nested deeper than {MAX_DEPTH} levels, the most allowed"


def _clip(value: object, limit: int = 120) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
