"""A config node as plain Python data, typed as what it becomes: ``OmegaConf.to_container`` is declared to return
any of a dict, a list, a string or None, while a mapping node (a DictConfig, a structured config) always becomes a
dict and a sequence node (a ListConfig) a list."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from omegaconf import OmegaConf


def plain_dict(node: Any, *, resolve: bool = False, throw_on_missing: bool = False) -> dict[str, Any]:
    """``OmegaConf.to_container(node, ...)`` of a mapping node; a config already typed (a schema dataclass instance,
    ``run.config.typed``: every interpolation resolved when it was made) as ``dataclasses.asdict``."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=resolve, throw_on_missing=throw_on_missing))


def plain_list(node: Any, *, resolve: bool = False) -> list[Any]:
    """``OmegaConf.to_container(node, ...)`` of a sequence node."""
    return cast(list[Any], OmegaConf.to_container(node, resolve=resolve))
