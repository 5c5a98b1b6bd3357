"""Reading spec YAML strictly: duplicate keys are an error, names keep the text they were written with.

Plain YAML (``yaml.safe_load``) keeps the last of two equal keys, so a row
copied twice into a table silently replaces the first; and it turns a row
named ``0.50`` into the float 0.5 and refuses an unquoted ``[0.4,0.7]:`` key.
``StrictLoader`` differs from ``yaml.SafeLoader`` in three ways only:

- a mapping with the same key twice raises ``DuplicateKey`` naming both lines;
- a mapping key that is not a string (``0.50:``, ``[0.4,0.7]:``, ``true:``) is
  the text it was written with (``"0.50"``, ``"[0.4,0.7]"``, ``"true"``);
- a number or a flow list keeps that text too, in ``source_text(value)``, so a
  reference written ``[0.50, Avg]`` or ``[[0.4,0.7], Avg]`` can name row
  ``0.50`` or ``[0.4,0.7]`` without quotes (``tables.match_name``).
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(ValueError):
    def __init__(self, key: str, first: int, second: int):
        self.key, self.first, self.second = key, first, second
        super().__init__(f"key '{key}' appears twice, at lines {first} and {second}")


class _Float(float):
    source: str


class _Int(int):
    source: str


class _List(list):
    source: str


def source_text(value: Any) -> str | None:
    """The text a loaded number or flow list was written with, or None."""
    return getattr(value, "source", None)


def _node_text(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        return node.value
    start, end = node.start_mark, node.end_mark
    if start.buffer is None:  # not loaded from a string: fall back to the value's own text
        return str(node.value)
    return start.buffer[start.index : end.index].strip()


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the three differences of the module docstring."""

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self._key(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKey(str(key), seen[key], line)
            seen[key] = line
        self.flatten_mapping(node)
        return {self._key(k): self.construct_object(v, deep=deep) for k, v in node.value}

    def _key(self, key_node: yaml.Node) -> Any:
        key = self.construct_object(key_node, deep=True)
        return key if isinstance(key, str) else _node_text(key_node)

    def construct_yaml_float(self, node):
        value = _Float(super().construct_yaml_float(node))
        value.source = node.value
        return value

    def construct_yaml_int(self, node):
        value = _Int(super().construct_yaml_int(node))
        value.source = node.value
        return value

    def construct_yaml_seq(self, node):
        data = _List()
        data.source = _node_text(node)
        yield data
        data.extend(self.construct_sequence(node))


StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:seq", StrictLoader.construct_yaml_seq)
StrictLoader.add_constructor("tag:yaml.org,2002:map", yaml.SafeLoader.construct_yaml_map)


def load_strict(text: str) -> Any:
    """``yaml.load(text, StrictLoader)``; raises DuplicateKey or yaml.YAMLError."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
