"""Multi-stage merges: a chain of merge methods in one config (the CPT-finance paper's staged merges).

Each stage names a method with its parameters, the model it treats as its
base, and its inputs. A name is ``base`` (the modelset's base), an expert of
the modelset, or an earlier stage's output, so the output of one stage can be
the base or an input of the next, e.g. first recover instruction following
(base + finance expert), then merge that with another expert::

    name: pipeline
    stages:
      - {name: recovered, base: base, inputs: [finance], method: {name: task_arithmetic, lambda_: 0.5}}
      - {name: final, base: base, inputs: [recovered, math], method: {name: ties, density: 0.5}}

Per tensor, stage s computes ``out_s = method_s(value(base_s), [value(x) for x in inputs_s])``
and the last stage's output is the merge. Every stage is a per-tensor method,
so a pipeline streams like any other merge. Stage s draws its random numbers
from its own stream of the tensor's draws (``Draws.stream(s)``), so a pipeline
is deterministic and its stages' draws are independent of each other. Stages whose method needs a whole layer at a time
or anything measured from the models before merging (its registered ``needs``: CMM's ranking without given scores,
localize_stitch's whole-model cuts) are rejected up front.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

# omegaconf (slow to import) is imported only where a stage's method is typed: the engine and the methods
# load without it (a merge called from Python, merge_throughput.py's child); Hydra's commands import it anyway.
from mergeval.core.errors import UserError
from mergeval.methods.draws import Draws
from mergeval.methods.registry import METHODS, Needs, get_method, register


@dataclass
class StageConfig:
    name: str = "???"  # omegaconf.MISSING
    method: dict[str, Any] = field(default_factory=dict)  # {name: <method>, <its parameters>}
    base: str = "base"
    inputs: list[str] = field(default_factory=list)


@dataclass
class PipelineConfig:
    name: str = "pipeline"
    stages: list[StageConfig] = field(default_factory=list)
    expert_names: list[str] | None = None  # the modelset's expert names, in order (filled by the run)


@lru_cache(maxsize=256)
def _typed(method_json: str, where: str):
    """A stage's method dict -> (MergeMethod, its typed config); cached because it is needed per tensor."""
    spec = json.loads(method_json)
    name = spec.get("name")
    if name not in METHODS or name == "pipeline":
        choices = ", ".join(sorted(m for m in METHODS if m != "pipeline"))
        raise UserError(f"{where}.name", f"unknown or unusable stage method '{name}'", f"choose one of: {choices}")
    method = get_method(name)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(method.config), spec))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or ""
        raise UserError(
            f"{where}.{key}".rstrip("."), str(err).splitlines()[0], "fix the stage's method parameters"
        ) from None
    return method, cfg


def stage_method(stage: StageConfig, index: int):
    from omegaconf import OmegaConf

    method_dict = OmegaConf.to_container(stage.method) if OmegaConf.is_config(stage.method) else dict(stage.method)
    return _typed(json.dumps(method_dict, sort_keys=True), f"method.stages[{index}].method")


def _check_stage_needs(method, method_cfg, where: str) -> None:
    """A stage merges values computed per tensor, never whole checkpoints: a stage whose method still needs
    something measured from the models before merging (its declared ``needs``) is refused."""
    needs = method.needs
    if needs.ranking is not None and needs.ranking.pending(method_cfg):
        raise UserError(
            f"{where}.method.validation_scores",
            f"{method.name} in a pipeline cannot rank by evaluation",
            needs.ranking.fix(f"{where}.method."),
        )
    if needs.cuts_pending(method_cfg):
        scoped = hasattr(method_cfg, "scope")
        raise UserError(
            f"{where}.method.{'scope' if scoped else 'thresholds'}",
            "a stage's inputs are not checkpoints whose whole-model magnitude cut can be measured before merging",
            f"set {where}.method.scope=tensor" if scoped else f"give {where}.method.thresholds",
        )
    if needs.statistics_pending(method_cfg):
        raise UserError(
            f"{where}.method.statistics",
            f"a stage's inputs have no calibration statistics ('{needs.statistics}') measured before merging",
            f"give {where}.method.statistics, or use a method that needs no calibration data in the stage",
        )
    if needs.head_counts or needs.expert_names:
        raise UserError(
            f"{where}.method.name",
            f"{method.name} needs run-time preparation that pipeline stages do not get",
            "use another method in the stage",
        )


def _validate(cfg: PipelineConfig, n_experts: int) -> None:
    if not cfg.stages:
        raise UserError("method.stages", "a pipeline needs at least one stage", "list stages under method.stages")
    experts = cfg.expert_names if cfg.expert_names is not None else [f"expert{i}" for i in range(n_experts)]
    known = {"base", *experts}
    used: set[str] = set()
    for i, stage in enumerate(cfg.stages):
        where = f"method.stages[{i}]"
        if stage.name in known:
            raise UserError(f"{where}.name", f"'{stage.name}' is already a model or stage name", "rename the stage")
        for ref in (stage.base, *stage.inputs):
            if ref not in known:
                raise UserError(
                    where,
                    f"unknown model or stage '{ref}'",
                    f"use base, an expert ({', '.join(experts)}) or an earlier stage",
                )
        if not stage.inputs:
            raise UserError(f"{where}.inputs", "no inputs", "list the experts or stages this stage merges")
        method, method_cfg = stage_method(stage, i)
        if getattr(method_cfg, "rules", None):  # the engine resolves rules for the top-level method only
            raise UserError(
                f"{where}.method.rules",
                "per-tensor rules are not applied inside pipeline stages",
                "remove them from the stage (stage parameters are the same for every tensor)",
            )
        if getattr(method, "merge_layer", None) is not None:
            raise UserError(
                f"{where}.method.name",
                f"{method.name} merges whole layers and cannot be a stage",
                "use a per-tensor method in pipeline stages",
            )
        _check_stage_needs(method, method_cfg, where)
        method.validate(method_cfg, len(stage.inputs))
        used.update((stage.base, *stage.inputs))
        known.add(stage.name)
    for stage in cfg.stages[:-1]:
        if stage.name not in used:
            raise UserError(
                "method.stages",
                f"stage '{stage.name}' is never used by a later stage",
                "feed it to a later stage or remove it",
            )


# version 3: a stage's draws are the tensor's counter-based stream s (draws.py); 2: its steps' TIES sums in order
@register("pipeline", PipelineConfig, _validate, version=3, needs=Needs(expert_names=True))
def pipeline(base: torch.Tensor, experts: list[torch.Tensor], cfg: PipelineConfig, gen: Draws) -> torch.Tensor:
    """out_s = method_s(value(base_s), [value(x) for x in inputs_s]) for each stage s; returns the last out_s."""
    names = cfg.expert_names if cfg.expert_names is not None else [f"expert{i}" for i in range(len(experts))]
    values = {"base": base, **dict(zip(names, experts))}
    out = base
    for i, stage in enumerate(cfg.stages):
        method, method_cfg = stage_method(stage, i)
        out = method.merge(values[stage.base], [values[x] for x in stage.inputs], method_cfg, gen.stream(i))
        values[stage.name] = out
    return out
