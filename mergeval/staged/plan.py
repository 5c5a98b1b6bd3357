"""The validated plan of a staged sweep: its candidates (one merge config each) and the stage sizes.

Every candidate's method config is built and validated here, before any model
is touched, so a bad candidate costs one line and no work. Errors name the
candidate's own config path (``staged.grid.ties.density``,
``staged.candidates[2].lambda_``), not ``method.*``.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from mergeval.core.errors import UserError
from mergeval.core.plain import plain_dict, plain_list
from mergeval.methods import MergeMethod, get_method


@dataclass(frozen=True)
class Candidate:
    label: str  # e.g. "ties(lambda_=0.5, density=0.3)": unique within the sweep
    method: MergeMethod
    config: Any  # the method's typed config (its dataclass)
    params: dict  # the values the sweep sets (the rest are the method's defaults)
    path: str  # where it was declared, for error messages


@dataclass(frozen=True)
class Plan:
    candidates: list[Candidate]
    heldout_items: int
    stage1_keep: int
    stage2_fraction: float
    stage3_keep: int
    degrade_threshold: float
    full: bool
    keep_memory: float = 0.25


def stage2_limit(fraction: float, n: int) -> int:
    """Items per task in stage 2: ``ceil(fraction · n)``, at least 1 and at most n.

    The 1e-9 absorbs binary rounding (0.15 · 200 is 30.000000000000004 in floats,
    which must give 30, not 31).
    """
    return min(n, max(1, math.ceil(fraction * n - 1e-9)))


def _specs(staged) -> list[tuple[str, dict]]:
    """(declaration path, {name, field: value}) per candidate: the grid's products, then the explicit list."""
    specs = []
    grid = plain_dict(staged.grid)
    for name, fields in grid.items():
        for key, values in fields.items():
            if not values:
                raise UserError(f"staged.grid.{name}.{key}", "empty list of values", "give at least one value")
        keys = list(fields)
        for values in itertools.product(*(fields[k] for k in keys)):
            specs.append((f"staged.grid.{name}", {"name": name, **dict(zip(keys, values))}))
    for i, spec in enumerate(plain_list(staged.candidates)):
        if "name" not in spec:
            raise UserError(f"staged.candidates[{i}].name", "missing", "name the merge method, e.g. name: ties")
        specs.append((f"staged.candidates[{i}]", spec))
    return specs


def build_candidate(path: str, spec: dict, experts: list[str]) -> Candidate:
    """The method's structured config with ``spec`` merged in, validated against the modelset's ``experts`` (their
    names, in order); errors name ``path``. What the method needs from the models is prepared later, when they are
    resolved (``run.ranking.prepare_method``, as for a run)."""
    name_path = path if path.startswith("staged.grid.") else f"{path}.name"  # a grid's key is the method name
    try:
        method = get_method(spec["name"])
    except UserError as err:
        raise UserError(name_path, err.problem, err.fix) from None
    params = {k: v for k, v in spec.items() if k != "name"}
    names = {"expert_names": list(experts)} if method.needs.expert_names else {}  # a pipeline's stages name experts
    config = typed_config(path, method, {**params, **names}, len(experts))
    label = method.name + "(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"
    return Candidate(label, method, config, params, path)


def typed_config(path: str, method: MergeMethod, params: dict, n_experts: int, base=None):
    """``base`` (default: the method's defaults) with ``params`` merged in, as the method's dataclass, validated;
    errors name ``<path>.<field>``. Shared with ``python -m mergeval.search`` (its trials' recipes)."""
    node = OmegaConf.structured(method.config) if base is None else OmegaConf.merge(method.config, base)
    for key, value in params.items():
        try:
            node = OmegaConf.merge(node, {key: value})
        except ConfigKeyError:
            fields = [str(f) for f in node if f != "name"]
            raise UserError(
                f"{path}.{key}", f"no such field of method {method.name}", f"use one of: {', '.join(fields)}"
            ) from None
        except ValidationError as err:
            raise UserError(f"{path}.{key}", str(err).splitlines()[0], "fix the value's type") from None
    config = OmegaConf.to_object(node)
    try:
        method.validate(config, n_experts)
    except UserError as err:
        field = err.field.removeprefix("method")
        raise UserError(f"{path}{field}", err.problem, err.fix.replace("method.", f"{path}.")) from None
    return config


def make_plan(staged, experts: list[str]) -> Plan:
    if staged is None:
        raise UserError(
            "staged",
            "no staged section in the config",
            "use an experiment that defines one, e.g. +experiment=quickstart_staged",
        )
    candidates: list[Candidate] = []
    seen: dict[str, str] = {}  # each candidate's config as JSON -> its label
    for path, spec in _specs(staged):
        cand = build_candidate(path, spec, experts)
        key = json.dumps(OmegaConf.to_container(OmegaConf.structured(cand.config)), sort_keys=True)
        if key in seen:
            raise UserError(
                path, f"candidate {cand.label} is the same merge as {seen[key]}", "list each configuration once"
            )
        seen[key] = cand.label
        candidates.append(cand)
    if not candidates:
        raise UserError(
            "staged",
            "no candidates",
            "set staged.grid (method: {field: [values]}) or staged.candidates "
            "(e.g. +experiment=quickstart_staged), or sweep with python -m mergeval -m hydra/sweeper=staged",
        )
    checks = [
        ("staged.heldout_items", staged.heldout_items >= 1, "set e.g. staged.heldout_items=64"),
        ("staged.stage1_keep", staged.stage1_keep >= 1, "set e.g. staged.stage1_keep=4"),
        ("staged.stage2_fraction", 0 < staged.stage2_fraction <= 1, "set e.g. staged.stage2_fraction=0.15"),
        (
            "staged.stage3_keep",
            1 <= staged.stage3_keep <= staged.stage1_keep,
            "set it between 1 and staged.stage1_keep",
        ),
        ("staged.degrade_threshold", staged.degrade_threshold > 0, "set e.g. staged.degrade_threshold=1.0"),
        ("staged.keep_memory", 0 <= staged.keep_memory <= 1, "set a share between 0 (merge again) and 1, e.g. 0.25"),
    ]
    for field, ok, fix in checks:
        if not ok:
            raise UserError(field, f"invalid value {OmegaConf.select(staged, field.split('.', 1)[1])}", fix)
    return Plan(
        candidates,
        staged.heldout_items,
        staged.stage1_keep,
        staged.stage2_fraction,
        staged.stage3_keep,
        staged.degrade_threshold,
        staged.full,
        staged.keep_memory,
    )
