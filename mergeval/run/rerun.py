"""A recipe a search or a staged sweep picked, as the plain ``python -m mergeval`` run that merges the same model.

Run, it lands in the results store with a result.json that ``report`` and ``verify`` read, and reuses the
sweep's stored evaluations (the same merge, hence the same fingerprint): nothing is evaluated again.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def kept(overrides: list[str], own: tuple[str, ...], method: str | None = None) -> list[str]:
    """The sweep's command-line ``overrides`` a plain run keeps: not those of its ``own`` sections (``search``,
    ``staged``) or Hydra's, nor the method's when the recipe names its method; a mapping's override as the
    user wrote it (without the ``++`` config.open_mappings gave it, which the plain run gives it again)."""
    from mergeval.run.config import mapping_fields

    def dropped(override: str) -> bool:
        head = override.lstrip("+~").split("=", 1)[0].split(".")[0].split("/")[0]
        return head in (*own, "hydra") or (method is not None and head == "method")

    mappings = mapping_fields()

    def as_written(override: str) -> str:
        key = override[2:].split("=", 1)[0]
        opened = override.startswith("++") and any(key == f or key.startswith(f + ".") for f in mappings)
        return override[2:] if opened else override

    return [as_written(o) for o in overrides if not dropped(o)]


def config_dir(argv: list[str] | None = None) -> list[str]:
    """``--config-dir DIR`` (absolute) when the sweep's command line had one: its experiments live there."""
    from mergeval.run.sweep_check import config_dir_flags

    found = [(flag, given) for flag, given in config_dir_flags(sys.argv[1:] if argv is None else argv)[1] if given]
    return [found[0][0], str(Path(found[0][1]).expanduser().resolve())] if found else []


def run_command(overrides: list[str], own: tuple[str, ...], fields: dict, method: str | None = None) -> str:
    """``python -m mergeval`` with the ``kept`` overrides, then ``method=<method>`` when given (the method's
    other fields come back to what that composes: pass every field that differs, ``changed_fields``) and
    ``method.<field>=<value>`` per field, floats in full."""
    recipe = ([f"method={method}"] if method else []) + [f"method.{k}={hydra_value(v)}" for k, v in fields.items()]
    words = [*config_dir(), *kept(overrides, own, method), *recipe]
    return " ".join(["python -m mergeval", *(shlex.quote(o) for o in words)])


def hydra_value(value) -> str:
    """A value in Hydra's override grammar: floats in full (repr), strings double-quoted, lists and dicts inline."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    return "[" + ",".join(hydra_value(v) for v in value) + "]"


def changed_fields(config: dict, composed: dict) -> dict:
    """The fields of a candidate's method ``config`` whose values differ from the plain run's ``composed`` ones."""
    return {k: v for k, v in config.items() if k != "name" and composed.get(k) != v}
