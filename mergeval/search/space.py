"""The search space: method field -> range, log scale, step or choices; validated before any model loads.

A ``search.space`` entry is one of::

    lambda_: {low: 0.2, high: 2.0}                   # a float (an int field gives an int; step: grid)
    density: {low: 0.05, high: 1.0, log: true}       # sampled on a log scale
    schedule: {choices: [linear, geometric]}         # categorical
    weights: {low: 0.2, high: 1.5, per_expert: true} # one value per expert: weights[0], weights[1], ...
    lambda_: {low: 0.2, high: 2.0, depth: 3}         # a per-depth rule: 3 knots interpolated over the layers

``per_expert`` sets the list field ``weights``, or an expert's own ``density``
/ ``gamma`` / ``epsilon`` (the method's ``per_expert`` entries). ``depth: K``
becomes the method rule ``{match: <match, default '*'>, <field>: [v_0 .. v_K-1]}``
(``method.rules``: knot j sits at depth t = j / (K - 1), layers in between are
interpolated linearly). Each entry is checked against the method's own
validation at both ends of its range (every choice), so a range the method
rejects fails up front as one line naming ``search.space.<field>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass
from typing import Any

from mergeval.core.errors import UserError
from mergeval.methods import MergeMethod
from mergeval.methods.registry import expert_params, rule_params
from mergeval.staged.plan import typed_config

SETTINGS = ("low", "high", "log", "step", "choices", "per_expert", "depth", "match")
HINT = "write e.g. {low: 0.2, high: 2.0}, {low: 0.01, high: 1, log: true} or {choices: [a, b]}"


@dataclass(frozen=True)
class Entry:
    """One searched field: its Optuna parameters (``names``) share one distribution."""

    key: str  # the method field
    kind: str  # scalar | per_expert | depth
    names: tuple[str, ...]  # Optuna parameter names: key, key[i] (per expert) or key@j (depth knot j)
    distribution: Any  # optuna.distributions.*
    match: str = "*"  # depth rules only: the tensors the rule applies to


@dataclass(frozen=True)
class Space:
    method: MergeMethod
    entries: tuple[Entry, ...]
    n_experts: int

    def distributions(self) -> dict[str, Any]:
        return {name: e.distribution for e in self.entries for name in e.names}

    def overrides(self, params: dict[str, Any]) -> dict[str, Any]:
        """The method-config fields a trial's parameters set (merged over the run's ``method``)."""
        out: dict[str, Any] = {}
        for e in self.entries:
            values = [params[n] for n in e.names]
            if e.kind == "scalar":
                out[e.key] = values[0]
            elif e.kind == "depth":
                out.setdefault("rules", []).append({"match": e.match, e.key: values})
            elif e.key == "weights":
                out["weights"] = values
            else:  # an expert's own density / gamma / epsilon
                own = out.setdefault("per_expert", [{} for _ in range(self.n_experts)])
                for entry, value in zip(own, values):
                    entry[e.key] = value
        return out

    def default_params(self, config: dict) -> dict[str, Any] | None:
        """The parameters that reproduce the method config ``config`` (the run's default recipe), or None when
        some searched value of it lies outside the space (or varies over depth where the space has knots)."""
        out: dict[str, Any] = {}
        for e in self.entries:
            if e.kind == "depth" and any(e.key in rule for rule in config.get("rules") or []):
                return None
            for i, name in enumerate(e.names):
                value = _default_value(config, e, i)
                try:
                    inside = value is not None and e.distribution._contains(e.distribution.to_internal_repr(value))
                except (ValueError, TypeError):
                    inside = False
                if not inside:
                    return None
                out[name] = value
        return out

    def digest(self) -> str:
        """Identifies the space (part of a study's identity: a resumed study must search the same space)."""
        rows = [[e.key, e.kind, list(e.names), repr(e.distribution), e.match] for e in self.entries]
        return hashlib.sha256(json.dumps([self.method.name, rows]).encode()).hexdigest()[:12]


def _default_value(config: dict, e: Entry, i: int) -> Any:
    """Expert ``i``'s (or knot ``i``'s) value of ``e.key`` in ``config``, as the merge reads it
    (``methods.compat.expert_value``: an expert's own value, else the shared one; a null weight is 1)."""
    if e.kind != "per_expert":
        return config.get(e.key)
    own = config.get("per_expert") or []
    name = "weight" if e.key == "weights" else e.key
    if i < len(own) and own[i] and own[i].get(name) is not None:
        return own[i][name]
    if e.key == "weights":
        weights = config.get("weights")
        return weights[i] if weights is not None else 1.0
    return config.get(e.key)


def describe(params: dict[str, Any]) -> str:
    """``lambda_=1.23, weights[0]=0.8`` with floats to 3 significant digits."""
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def parse_space(space: dict, method: MergeMethod, base, n_experts: int) -> Space:
    """The validated space of ``search.space`` for ``method`` (``base``: the run's method config)."""
    if not space:
        raise UserError(
            "search.space",
            "is empty",
            "name at least one method field, e.g. "
            "search.space={lambda_: {low: 0.2, high: 2.0}}, or pick a preset: search=task_arithmetic",
        )
    hints = typing.get_type_hints(method.config)
    fields = [f.name for f in dataclasses.fields(method.config) if f.name not in ("name", "rules", "per_expert")]
    entries = []
    for key, spec in space.items():
        where = f"search.space.{key}"
        if not isinstance(spec, dict):
            raise UserError(where, f"must be a mapping, got {spec!r}", HINT)
        unknown = [s for s in spec if s not in SETTINGS]
        if unknown:
            raise UserError(f"{where}.{unknown[0]}", "is not a search setting", f"use: {', '.join(SETTINGS)}")
        if key not in fields:
            raise UserError(where, f"no such field of method {method.name}", f"use one of: {', '.join(fields)}")
        entry = _entry(key, spec, hints[key], method, n_experts, where)
        _check_values(entry, spec, method, base, n_experts, where)
        entries.append(entry)
    return Space(method, tuple(entries), n_experts)


def _entry(key: str, spec: dict, hint, method: MergeMethod, n_experts: int, where: str) -> Entry:
    from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

    per_expert, depth = bool(spec.get("per_expert", False)), spec.get("depth")
    if "choices" in spec:
        extra = [s for s in ("low", "high", "log", "step", "depth") if s in spec]
        if extra:
            raise UserError(f"{where}.{extra[0]}", "does not go with choices", "give either choices or a range")
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise UserError(f"{where}.choices", f"must be a non-empty list, got {choices!r}", HINT)
        distribution: BaseDistribution = CategoricalDistribution(choices)
    else:
        for s in ("low", "high"):
            if not _is_number(spec.get(s)):
                raise UserError(f"{where}.{s}", f"must be a finite number, got {spec.get(s)!r}", HINT)
        low, high, log, step = spec["low"], spec["high"], bool(spec.get("log", False)), spec.get("step")
        if not low < high:
            raise UserError(where, f"low {low} is not below high {high}", "give low < high")
        if log and low <= 0:
            raise UserError(f"{where}.low", f"a log scale needs low > 0, got {low}", "raise low or drop log")
        if step is not None and not (_is_number(step) and step > 0) or step is not None and log:
            raise UserError(
                f"{where}.step",
                f"must be a positive number without log, got {step!r}",
                "drop step, or give e.g. step: 0.1",
            )
        if hint is int or hint == int | None:
            distribution = IntDistribution(int(low), int(high), log=log, step=int(step or 1))
        else:
            distribution = FloatDistribution(float(low), float(high), log=log, step=step)
    if depth is not None:
        if per_expert:
            raise UserError(f"{where}.depth", "does not go with per_expert", "search one of the two")
        if key not in rule_params(method.config):
            raise UserError(
                f"{where}.depth",
                f"{key} is not a numeric parameter a rule can set",
                f"use one of: {', '.join(rule_params(method.config)) or '(none)'}",
            )
        if not (isinstance(depth, int) and not isinstance(depth, bool) and depth >= 2):
            raise UserError(
                f"{where}.depth", f"must be an integer >= 2 (knots over depth), got {depth!r}", "set e.g. depth: 3"
            )
        match = spec.get("match", "*")
        if not isinstance(match, str) or not match:
            raise UserError(f"{where}.match", f"must be a non-empty glob, got {match!r}", "set e.g. match: '*mlp*'")
        return Entry(key, "depth", tuple(f"{key}@{j}" for j in range(depth)), distribution, match)
    if "match" in spec:
        raise UserError(f"{where}.match", "applies only with depth", "add depth: K or drop match")
    if per_expert:
        if key != "weights" and key not in expert_params(method.config):
            own = [p for p in expert_params(method.config) if p != "weight"]
            raise UserError(
                f"{where}.per_expert",
                f"{method.name} has no per-expert {key}",
                f"per_expert applies to: {', '.join(['weights', *own]) if own else '(none)'}",
            )
        return Entry(key, "per_expert", tuple(f"{key}[{i}]" for i in range(n_experts)), distribution)
    if key == "weights":
        raise UserError(f"{where}.per_expert", "weights is a list, one value per expert", "add per_expert: true")
    return Entry(key, "scalar", (key,), distribution)


def _check_values(entry: Entry, spec: dict, method: MergeMethod, base, n_experts: int, where: str) -> None:
    """Every choice, or both ends of the range, through the method's validation (in place of the run's value)."""
    values = spec["choices"] if "choices" in spec else [entry.distribution.low, entry.distribution.high]
    for value in values:
        if entry.key == "weights":
            params = {"weights": [value] * n_experts}
        else:  # a per-expert or per-depth value is valid where the same top-level value is (methods/registry.py)
            params = {entry.key: value}
        try:
            typed_config("search.space", method, params, n_experts, base)
        except UserError as err:
            raise UserError(
                where, f"{value!r} is refused by {method.name}: {err.problem}", f"narrow the range of {where}"
            ) from None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
