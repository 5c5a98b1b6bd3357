"""Finding and reading spec files.

A spec is found by path, or by name in the spec library: the repository's
``specs/`` directory, shipped inside the package as ``mergeval/specs/library``
(a symlink, like ``mergeval/conf``), so ``python -m mergeval.verify cmm_chem``
works from a checkout and from an installed wheel alike.

Top-level keys of a spec (``name``, ``title``, ``citation`` and ``setups`` are required)::

    name: cmm_chem                 # = the file name
    title: ...
    citation: {authors: .., title: .., venue: .., year: .., url: ..}
    sources: [where the numbers were copied from]
    setups:                        # one per experimental setup of the paper
      chem:
        experiment: cmm_chem       # conf/experiment/<name>.yaml composes it
        ...                        # models, tasks, methods, hyperparameters: free-form, with
                                   # null + a note wherever the paper does not say
    metrics: {..}                  # run metrics (runs.py)
    tables: {..}                   # published tables (tables.py)
    claims: [..]                   # claims (claims.py)
    notes: [..]
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import yaml

from mergeval.errors import UserError
from mergeval.specs.claims import Claim, parse_claims
from mergeval.specs.runs import RunMetric, parse_metrics
from mergeval.specs.tables import Table, parse_tables

_TOP_KEYS = {"name", "title", "citation", "sources", "setups", "metrics", "tables", "claims", "notes"}
_REQUIRED = {"name", "title", "citation", "setups"}


@dataclass
class Spec:
    name: str
    path: str
    title: str
    citation: dict
    setups: dict
    metrics: dict[str, RunMetric]
    tables: dict[str, Table]
    claims: list[Claim]
    notes: list[str] = field(default_factory=list)


def library() -> Path:
    """The directory of the shipped specs."""
    return Path(str(files("mergeval.specs") / "library"))


def available() -> list[str]:
    return sorted(p.stem for p in library().glob("*.yaml"))


def find_spec(name_or_path: str) -> Path:
    """A spec file by path, or by name from the library; UserError naming the choices otherwise."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if re.fullmatch(r"[A-Za-z0-9_]+", name_or_path) and (library() / f"{name_or_path}.yaml").is_file():
        return library() / f"{name_or_path}.yaml"
    raise UserError("spec", f"no spec file or spec named '{name_or_path}'",
                    f"give a path to a spec YAML or one of: {', '.join(available()) or '(none shipped)'}")


def load_spec(name_or_path: str) -> Spec:
    path = find_spec(name_or_path)
    where = path.name
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise UserError("spec", f"cannot read {path} ({err.__class__.__name__})", "check the file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UserError(where, f"is not valid YAML{at}", "fix the YAML syntax") from None
    if not isinstance(raw, Mapping):
        raise UserError(where, "is not a spec (not a mapping)", f"give the keys {sorted(_REQUIRED)}")
    missing, unknown = _REQUIRED - set(raw), set(raw) - _TOP_KEYS
    if missing or unknown:
        raise UserError(where, f"missing keys {sorted(missing)}, unknown keys {sorted(unknown)}",
                        f"a spec has {sorted(_TOP_KEYS)}")
    setups = raw["setups"]
    if not isinstance(setups, Mapping) or not setups:
        raise UserError(f"{where}:setups", "needs at least one setup", "add setups: {name: {experiment: ..}}")
    experiments = files("mergeval.conf") / "experiment"
    for name, setup in setups.items():
        exp = setup.get("experiment") if isinstance(setup, Mapping) else None
        if not isinstance(exp, str) or not (experiments / f"{exp}.yaml").is_file():
            raise UserError(f"{where}:setups.{name}.experiment", f"no conf/experiment/{exp}.yaml",
                            "name the experiment config that composes this setup")
    metrics = parse_metrics(raw.get("metrics"), f"{where}:metrics")
    tables = parse_tables(raw.get("tables"), f"{where}:tables")
    claims = parse_claims(raw.get("claims"), f"{where}:claims", tables, metrics)
    return Spec(str(raw["name"]), str(path), str(raw["title"]), dict(raw["citation"] or {}), dict(setups),
                metrics, tables, claims, [str(n) for n in raw.get("notes") or []])
