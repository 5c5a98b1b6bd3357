"""Finding and reading spec files.

A spec is found by path, or by name on the spec search path, first match wins:

1. the directories in ``$MERGEVAL_SPECS_PATH`` (separated by ``:``; ``;`` on Windows);
2. ``specs.path`` in the nearest ``pyproject.toml`` at or above the current
   directory (relative entries are relative to that file)::

       [tool.mergeval.specs]
       path = ["specs", "../shared/specs"]

3. the shipped specs: the repository's ``specs/`` directory, shipped inside the
   package as ``mergeval/verify/library`` (a symlink, like ``mergeval/run/conf``).

Top-level keys of a spec (``tables`` or ``claims`` is required; a table-only
spec needs nothing else)::

    name: cmm_chem                 # default: the file name
    title: ...                     # default: the name
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
    verdicts: {..}                 # recorded verdicts of the claims on named runs (recorded.py)
    notes: [..]

The file is read with ``yamlload.StrictLoader``: a key given twice is an error
naming both lines.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import yaml

from mergeval.core.errors import UserError
from mergeval.verify.claims import Claim, parse_claims
from mergeval.verify.recorded import Record, parse_records
from mergeval.verify.runs import RunMetric, parse_metrics
from mergeval.verify.tables import CellCheck, Table, check_tables, parse_tables
from mergeval.verify.yamlload import DuplicateKey, load_strict

_TOP_KEYS = {"name", "title", "citation", "sources", "setups", "metrics", "tables", "claims", "verdicts", "notes"}
ENV = "MERGEVAL_SPECS_PATH"


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
    shown: str = ""  # the file as errors name it (``shown_as``)
    verdicts: dict[str, Record] = field(default_factory=dict)  # recorded verdicts by record name

    def check_tables(self) -> list[CellCheck]:
        """Every derived cell's verdict (tables.check_tables), errors naming this file."""
        return check_tables(self.tables, f"{self.shown or Path(self.path).name}:tables")


def library() -> Path:
    """The directory of the shipped specs."""
    return Path(str(files("mergeval.verify") / "library"))


def _configured(start: Path) -> list[Path]:
    """``[tool.mergeval.specs] path`` of the nearest pyproject.toml at or above ``start``."""
    for folder in [start, *start.parents]:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            try:
                config = tomllib.loads(pyproject.read_text())
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                raise UserError(
                    str(pyproject), "is not readable TOML", "fix it, or run from another directory"
                ) from None
            path = config.get("tool", {}).get("mergeval", {}).get("specs", {}).get("path", [])
            if isinstance(path, str):
                path = [path]
            if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
                raise UserError(
                    f"{pyproject}:tool.mergeval.specs.path", "must be a list of directories", 'write path = ["specs"]'
                )
            return [(folder / p).expanduser() for p in path]
    return []


def search_path() -> list[Path]:
    """Where specs are looked up by name, in order (module docstring)."""
    env = [Path(p).expanduser() for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    return [*env, *_configured(Path.cwd()), library()]


def found() -> dict[str, Path]:
    """Every spec on the search path by name (the first of equal names wins)."""
    out: dict[str, Path] = {}
    for folder in search_path():
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            out.setdefault(path.stem, path)
    return dict(sorted(out.items()))


def available() -> list[str]:
    """The names of the specs on the search path."""
    return list(found())


def find_spec(name_or_path: str) -> Path:
    """A spec file by path, or by name on the search path; UserError naming the choices otherwise."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    stem = name_or_path[:-5] if name_or_path.endswith(".yaml") else name_or_path
    if "/" not in stem and os.sep not in stem:
        for folder in search_path():
            if (folder / f"{stem}.yaml").is_file():
                return folder / f"{stem}.yaml"
    raise UserError(
        "spec",
        f"no spec file or spec named '{name_or_path}'",
        f"give a path to a spec YAML or one of: {', '.join(available()) or '(none found)'} "
        f"(search path: ${ENV}, [tool.mergeval.specs] path, the shipped specs)",
    )


def shown_as(name_or_path: str, path: Path) -> str:
    """How errors name a spec file: the path as the user gave it, or the file's name when found by name."""
    return name_or_path if Path(name_or_path).expanduser().is_file() else path.name


def read_yaml(path: Path, where: str | None = None) -> object:
    """The file's YAML via the strict loader; UserError (one line, naming the lines) otherwise.

    ``where`` names the file in errors (default: its name).
    """
    where = where or path.name
    try:
        return load_strict(path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise UserError("spec", f"cannot read {path} ({err.__class__.__name__})", "check the file") from None
    except DuplicateKey as err:
        raise UserError(
            f"{where}:{err.second}",
            f"key '{err.key}' is given twice (lines {err.first} and {err.second})",
            "keep one of them (YAML would silently keep only the last)",
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UserError(where, f"is not valid YAML{at}", "fix the YAML syntax") from None


def load_spec(name_or_path: str) -> Spec:
    path = find_spec(name_or_path)
    where = shown_as(name_or_path, path)
    raw = read_yaml(path, where)
    if not isinstance(raw, Mapping):
        raise UserError(where, "is not a spec (not a mapping)", "give at least tables: or claims:")
    unknown = set(raw) - _TOP_KEYS
    if unknown or not {"tables", "claims"} & set(raw):
        raise UserError(
            where,
            f"unknown keys {sorted(unknown)}" if unknown else "has neither tables nor claims",
            f"a spec has {sorted(_TOP_KEYS)}, with tables or claims",
        )
    setups = raw.get("setups") or {}
    if not isinstance(setups, Mapping):
        raise UserError(f"{where}:setups", "must map setup names to setups", "write setups: {name: {experiment: ..}}")
    experiments = files("mergeval.run.conf") / "experiment"
    for name, setup in setups.items():
        exp = setup.get("experiment") if isinstance(setup, Mapping) else None
        if not isinstance(exp, str) or not (experiments / f"{exp}.yaml").is_file():
            raise UserError(
                f"{where}:setups.{name}.experiment",
                f"no conf/experiment/{exp}.yaml",
                "name the experiment config that composes this setup",
            )
    metrics = parse_metrics(raw.get("metrics"), f"{where}:metrics")
    tables = parse_tables(raw.get("tables"), f"{where}:tables")
    claims = parse_claims(raw.get("claims"), f"{where}:claims", tables, metrics)
    name = str(raw.get("name") or path.stem)
    verdicts = parse_records(raw.get("verdicts"), f"{where}:verdicts")
    return Spec(
        name,
        str(path),
        str(raw.get("title") or name),
        dict(raw.get("citation") or {}),
        dict(setups),
        metrics,
        tables,
        claims,
        [str(n) for n in raw.get("notes") or []],
        where,
        verdicts,
    )
