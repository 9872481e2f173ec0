"""YAML read within bounds: a config file's text (at most MAX_CONFIG_BYTES of UTF-8) and one
document of it, with nesting, size after alias expansion and integer digits bounded, so that a
hostile file fails fast in one line instead of exhausting memory or recursion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from groupflow.config.base import ConfigError

# Bounds on what a config's YAML may expand to: a config is a few hundred keys, so these are
# far above any real one and far below what exhausts memory or Python's recursion.
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000  # after aliases are expanded, as validation expands them
MAX_INT_DIGITS = 100


class _YAMLBoundError(yaml.YAMLError):
    """A YAML document past one of the bounds above."""

    def __init__(self, problem: str, mark: yaml.Mark | None):
        where = f" (line {mark.line + 1})" if mark is not None else ""
        super().__init__(f"{problem}{where}")


class _BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader, with the depth of nesting, the size after alias expansion and the
    digits of an integer bounded, and a recursive alias refused: a hostile document fails
    while it is read, before it can exhaust memory or recursion."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._expanded: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded

    def fetch_flow_collection_start(self, token_class):
        # Refused while scanning: the scanner's work on each `[` or `{` grows with the depth.
        if self.flow_level >= MAX_YAML_DEPTH:
            raise _YAMLBoundError(f"nested deeper than {MAX_YAML_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = self.anchors.get(event.anchor)
            if node is not None and id(node) not in self._expanded:
                raise _YAMLBoundError(
                    f"alias *{event.anchor} refers to a node that contains it", event.start_mark
                )
            return super().compose_node(parent, index)  # counted when its anchor was
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise _YAMLBoundError(f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._count(node)
        return node

    def _count(self, node: yaml.Node) -> None:
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        size = 1 + sum(self._expanded[id(child)] for child in children)
        if size > MAX_YAML_NODES:
            raise _YAMLBoundError(
                f"expands to more than {MAX_YAML_NODES} values (aliases counted in full)",
                node.start_mark,
            )
        self._expanded[id(node)] = size

    def construct_yaml_int(self, node):
        digits = sum(c.isalnum() for c in node.value.removeprefix("0x").removeprefix("0o"))
        if digits > MAX_INT_DIGITS:
            raise _YAMLBoundError(
                f"an integer of {digits} digits (at most {MAX_INT_DIGITS})", node.start_mark
            )
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def parse_yaml(text: str) -> Any:
    """One YAML document, within the bounds above; yaml.YAMLError when it is not one."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_config_text(path: Path) -> str:
    """The file's text, at most MAX_CONFIG_BYTES of UTF-8."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config ({err.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, not a config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
