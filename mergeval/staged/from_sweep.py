"""A plain ``-m`` sweep as a staged sweep: each job's method is one candidate (``hydra/sweeper=staged``).

``python -m mergeval -m hydra/sweeper=staged method=task_arithmetic,ties method.lambda_=0.5,1.0,1.5,2.0``
expands the sweep as Hydra's basic sweeper would and composes every job's
config; ``staged_config`` turns those configs into one staged sweep's config
(``mergeval/staged/pipeline.py``): the first job's config, with the jobs'
methods as ``staged.candidates``. Only the method may differ between jobs: a
staged sweep evaluates every candidate on the same models and benchmark, so a
sweep over anything else (the modelset, the benchmark, eval settings, seed)
is one clear error naming the field. The stage sizes are the ``staged.*``
fields, set as in ``python -m mergeval.staged``.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mergeval.core.errors import UserError
from mergeval.core.plain import plain_dict
from mergeval.methods import get_method
from mergeval.run.config import StagedConfig
from mergeval.staged.plan import build_candidate

SWEEPER = "hydra/sweeper=staged"


def _differing_key(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first dotted key at which two plain containers differ (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{prefix}{key}"
            found = _differing_key(a[key], b[key], f"{prefix}{key}.")
            if found:
                return found
        return None
    return None if a == b else prefix.rstrip(".") or "(config)"


def candidate_spec(method: dict, swept: Collection[str] = frozenset()) -> dict:
    """``{name, field: value}``: the method's fields that differ from its defaults or are ``swept`` (what labels
    a candidate: a swept lambda_=1.0 is named even where 1.0 is the default)."""
    defaults = plain_dict(OmegaConf.structured(get_method(method["name"]).config))
    return {
        "name": method["name"],
        **{k: v for k, v in method.items() if k != "name" and (k in swept or defaults.get(k) != v)},
    }


def swept_fields(methods: list[dict]) -> dict[str, set[str]]:
    """Per method name, the fields whose value differs between the jobs of that method."""
    by_name: dict[str, list[dict]] = {}
    for m in methods:
        by_name.setdefault(m["name"], []).append(m)
    return {name: {k for k in ms[0] if len({repr(m.get(k)) for m in ms}) > 1} for name, ms in by_name.items()}


def staged_config(jobs: list[DictConfig], labels: list[str]) -> DictConfig:
    """The staged sweep's config from the jobs' composed configs (without their ``hydra`` node), in job order.

    ``labels[i]`` names job i in errors (its swept overrides). Each job's method is checked as a candidate
    first, so a bad swept value is named as the user wrote it (``method.density``)."""
    if not jobs:
        raise UserError(SWEEPER, "the sweep has no jobs", "sweep the method, e.g. -m method.lambda_=0.5,1.0")
    plain = [plain_dict(job, resolve=True) for job in jobs]
    rest = [{k: v for k, v in job.items() if k != "method"} for job in plain]
    for label, other in zip(labels[1:], rest[1:]):
        key = _differing_key(rest[0], other)
        if key is not None:
            raise UserError(
                key,
                f"differs between the sweep's jobs ({labels[0]} / {label}); a staged sweep "
                "compares merges of the same models on the same benchmark, so only the method may vary",
                f"fix {key} to one value, or sweep it without {SWEEPER}",
            )
    staged = rest[0].get("staged") or {}
    if staged.get("grid") or staged.get("candidates"):
        raise UserError(
            "staged.grid",
            f"with {SWEEPER} the sweep's jobs are the candidates",
            "drop staged.grid and staged.candidates (or run python -m mergeval.staged without -m)",
        )
    experts = list(rest[0]["modelset"]["experts"])
    specs: list[dict] = []
    swept = swept_fields([job["method"] for job in plain])
    seen: dict[str, str] = {}  # each candidate's config as JSON -> its job's label
    for label, job in zip(labels, plain):
        spec = candidate_spec(job["method"], swept[job["method"]["name"]])
        try:
            candidate = build_candidate("method", spec, experts)
        except UserError as err:
            raise UserError(err.field, f"{err.problem} (sweep job {label})", err.fix) from None
        key = json.dumps(OmegaConf.to_container(OmegaConf.structured(candidate.config)), sort_keys=True)
        if key in seen:
            raise UserError(
                "method", f"sweep jobs {seen[key]} and {label} are the same merge", "list each swept value once"
            )
        seen[key] = label
        specs.append(spec)
    cfg = jobs[0].copy()
    with open_dict(cfg):
        if cfg.staged is None:  # the stage sizes' defaults
            cfg.staged = StagedConfig()
        cfg.staged.grid = {}
        cfg.staged.candidates = specs
    return cfg
