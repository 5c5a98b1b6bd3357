"""The merge plan: which tensors are merged together, and with which parameters.

A plan is a list of units. A unit is one tensor (per-tensor methods), every
tensor of one decoder layer (``model.layers.<i>.*``, for layer-at-a-time
methods), or a tensor that is copied from the base (integer buffers). Each unit
carries its method config with ``rules`` resolved (see ``RULES_DOC`` in
``mergeval.methods.registry``):

    depth t    layer i of L: t = i / (L - 1)  (t = 1 when L = 1)
               outside the layers: t = 0 for 'embed' / 'wte' / 'wpe' tensors, else t = 1
    gradient   [v_0, ..., v_k] at t:  x = t k,  j = min(floor(x), k),  value = v_j + (x - j)(v_{j+1} - v_j)
    rules      the last rule whose glob matches the unit's name sets each parameter;
               unmatched parameters keep the top-level value; a rule with ``expert: i``
               sets expert i's own value (``per_expert[i]``), which beats the shared one

mergekit 0.1.5 computes t the same way for layers (i / (L - 1) per layer of a
slice, 1 for a one-layer slice) but gives every tensor outside the layers t = 0,
the final norm and lm_head included: under ``compat=mergekit`` they get t = 0
here too. Its filters are
substrings and the first matching filter wins; mergeval's rules are globs over
the full name and the last match wins (later rules refine earlier ones, as
later overrides do). A layer unit is matched by its prefix ``model.layers.<i>``.

Everything here is pure: names and dtypes in, units out; no tensor is read.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from mergeval.core.errors import UserError
from mergeval.methods.registry import MergeMethod, blame_rule, rule_items, rule_params

LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<index>\d+))\.")
BEFORE_LAYERS = ("embed", "wte", "wpe")  # non-layer tensors that sit before the first layer


def layer_of(name: str) -> tuple[str, int] | None:
    """(``model.layers.<i>``, i) for a tensor inside decoder layer i, else None."""
    m = LAYER.match(name)
    return (m["prefix"], int(m["index"])) if m else None


def count_layers(names) -> int:
    return 1 + max((layer[1] for layer in map(layer_of, names) if layer), default=-1)


def depth(name: str, n_layers: int, after_layers: float = 1.0) -> float:
    """t in [0, 1]: where the tensor (or layer prefix) sits between the first and the last layer;
    ``after_layers`` for the tensors after them (final norm, lm_head: 1, or mergekit 0.1.5's 0)."""
    layer = layer_of(name + ".")
    if layer is not None:
        return layer[1] / (n_layers - 1) if n_layers > 1 else 1.0
    return 0.0 if any(key in name for key in BEFORE_LAYERS) else after_layers


def interpolate(value: float | list[float], t: float) -> float:
    """A scalar, or the piecewise-linear gradient through evenly spaced knots, at t in [0, 1]."""
    if not isinstance(value, (list, tuple)):
        return value
    x = t * (len(value) - 1)
    j = min(math.floor(x), len(value) - 1)
    if j == len(value) - 1:
        return float(value[j])
    return value[j] + (x - j) * (value[j + 1] - value[j])


def resolve(cfg: Any, name: str, t: float) -> tuple[Any, dict[str, int]]:
    """(the config with its rules applied at this name and depth, param -> index of the rule that set it).

    The returned config has ``rules=[]``; a config without rules is returned unchanged.
    """
    rules = getattr(cfg, "rules", None) or []
    if not rules:
        return cfg, {}
    kinds = rule_params(type(cfg))
    values: dict[str, Any] = {}
    source: dict[str, int] = {}
    own: dict[int, dict[str, float]] = {}
    for i, rule in enumerate(rules):
        match, params = rule_items(rule)
        expert = params.pop("expert", None)
        if fnmatchcase(name, match):
            for p, value in params.items():
                v = interpolate(value, t)
                v = round(v) if kinds.get(p) is int else float(v)
                if expert is None:
                    values[p], source[p] = v, i
                else:
                    own.setdefault(expert, {})[p] = v
                    source[f"per_expert[{expert}].{p}"] = i
    if own:
        per_expert = [dict(e or {}) for e in (getattr(cfg, "per_expert", None) or [])]
        per_expert += [{} for _ in range(max(own) + 1 - len(per_expert))]
        for expert, items in own.items():
            per_expert[expert].update(items)
        values["per_expert"] = per_expert
    return dataclasses.replace(cfg, rules=[], **values), source


def resolved_value(cfg: Any, key: str) -> Any:
    """A parameter of a resolved config by its source key: ``density`` or ``per_expert[1].density``."""
    if key.startswith("per_expert["):
        index, param = key.removeprefix("per_expert[").split("].")
        return cfg.per_expert[int(index)][param]
    return getattr(cfg, key)


@dataclass(frozen=True)
class Unit:
    key: str  # the tensor's name, or the layer prefix; also the name that keys the unit's draws (methods/draws.py)
    names: tuple[str, ...]  # output tensors, in the order they are produced
    kind: str  # "tensor": method.merge; "layer": method.merge_layer; "copy": the base's tensor as is
    cfg: Any
    t: float
    rule_of: tuple[tuple[str, int], ...] = ()  # (param, rule index) for values set by rules


def build_plan(
    method: MergeMethod, cfg: Any, dtypes: Mapping[str, torch.dtype], layer_t: Mapping[int, float] | None = None
) -> list[Unit]:
    """Units over all tensors (name-sorted; a layer unit sits where its first tensor would). ``layer_t``:
    each layer's depth where it is not i / (L - 1) (layer slices: per slice, merge/slices.py)."""
    names = sorted(dtypes)
    n_layers = count_layers(names)

    after = 0.0 if getattr(cfg, "compat", "paper") == "mergekit" or layer_t else 1.0

    def unit(key: str, members: tuple[str, ...], kind: str) -> Unit:
        layer = layer_of(key + ".") if layer_t else None
        t = layer_t[layer[1]] if layer_t and layer else depth(key, n_layers, after)
        resolved, source = resolve(cfg, key, t) if kind != "copy" else (cfg, {})
        return Unit(key, members, kind, resolved, t, tuple(sorted(source.items())))

    floats = [n for n in names if dtypes[n].is_floating_point]
    layers: dict[str, list[str]] = {}
    if method.merge_layer is not None:
        for n in floats:
            layer = layer_of(n)
            if layer:
                layers.setdefault(layer[0], []).append(n)
    plan, seen = [], set()
    for n in names:
        layer = layer_of(n) if method.merge_layer is not None else None
        if not dtypes[n].is_floating_point:
            plan.append(unit(n, (n,), "copy"))
        elif layer and layer[0] in layers:
            if layer[0] not in seen:
                seen.add(layer[0])
                plan.append(unit(layer[0], tuple(layers[layer[0]]), "layer"))
        else:
            plan.append(unit(n, (n,), "tensor" if method.merge is not None else "layer"))
    return plan


def check_plan(method: MergeMethod, plan: list[Unit], n_experts: int) -> None:
    """The method's checks on every unit's resolved config, before any tensor is read.

    A failure is reported against the rule that set the offending value (``method.rules[i].<param>``).
    """
    seen = set()
    for unit in plan:
        if unit.kind == "copy" or not unit.rule_of:
            continue
        key = (tuple(resolved_value(unit.cfg, p) for p, _ in unit.rule_of), unit.rule_of)
        if key in seen:
            continue
        seen.add(key)
        try:
            method.validate(unit.cfg, n_experts)
        except UserError as err:
            rules = dict(unit.rule_of)
            param = err.field.removeprefix("method.")
            param = param if param in rules else unit.rule_of[0][0]
            with blame_rule(
                rules[param],
                param,
                f"{param}={resolved_value(unit.cfg, param):.6g} at {unit.key}, depth t={unit.t:.3g}",
            ):
                raise
