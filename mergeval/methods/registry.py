"""Name -> merge method. The package (``mergeval.methods``) registers the built-in methods on import.

Two kinds of method:

* **per tensor** (``@register(name, Config, validate)`` on ``merge``):
  ``merge(base, experts, cfg, gen) -> tensor`` sees one tensor of the base
  and the same tensor of each expert. The engine calls it once per tensor.
* **layer at a time** (``@register_layer(name, Config, validate)`` on ``merge_layer``):
  ``merge_layer(base, experts, cfg, gen) -> dict`` where ``base`` is
  ``{tensor name: tensor}`` for every tensor of one decoder layer (the names
  under ``model.layers.<i>.``, full names), ``experts`` is the same dict for
  each expert, and the result must hold exactly the same names and shapes.
  The engine groups the tensors by layer for such methods and loads one layer
  of every input at a time. Tensors outside the layers (embeddings, the final
  norm, lm_head) go through the method's per-tensor ``merge`` when one is given
  (``register_layer(..., merge=fn)``); otherwise, the documented fallback,
  ``merge_layer`` is called with a one-tensor group ``{name: tensor}``.

``gen`` is the unit's ``draws.Draws``: a random method draws expert i's uniform of an entry with
``gen.uniform(i, shape, start, device)`` (or its mask ``gen.keep(i, shape, density, start, device)``), a pure
function of (run seed, unit key, i, the entry's flat index), so its output does not depend on the device, the
row blocks or the order of the draws. Methods that draw nothing ignore it.

Every method config also gets ``rules`` (per-tensor parameters; see
``RULES_DOC`` below), and every config with ``weights`` gets ``per_expert``
(each expert's own weight, density, gamma, epsilon: mergekit's per-model
parameters), added here when the method is registered, so method modules and
``conf/method/*.yaml`` never declare them. Methods read per-expert values with
``mergeval.methods.compat.expert_value``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mergeval.core.errors import UserError
from mergeval.methods.draws import Draws

MergeFn = Callable[[torch.Tensor, list[torch.Tensor], Any, Draws], torch.Tensor]
LayerMergeFn = Callable[[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], Any, Draws], dict[str, torch.Tensor]]
ValidateFn = Callable[[Any, int], None]

RULES_DOC = """\
method.rules: a list of {match: GLOB, <param>: VALUE, ...}. GLOB is an fnmatch
pattern over the full tensor name ('*' also crosses dots), e.g. '*self_attn*',
'*.mlp.*', 'model.layers.1?.*'; a missing match is '*'. VALUE is a number or a
list of numbers interpolated linearly over depth t in [0, 1]: layer i of L has
t = i / (L - 1) (t = 1 when L = 1); tensors outside the layers get t = 0 when
their name holds 'embed', 'wte' or 'wpe' (before the first layer) and t = 1
otherwise (final norm, lm_head: after the last layer; mergekit 0.1.5 and
compat=mergekit give them t = 0). When
several rules set a parameter for a tensor, the last matching rule wins;
unmatched tensors keep the method's top-level value. Settable: the method's
numeric (float or int, not bool) parameters; int parameters are rounded.
A rule with 'expert: I' (0-based index into the modelset's experts) sets expert
I's own 'weight' / 'density' / 'gamma' / 'epsilon' instead; an expert's own
value beats the shared one whatever the rule order (as mergekit's per-model
parameters beat its global ones)."""


@dataclass(frozen=True)
class Ranking:
    """A method that merges by the experts' ranking on a validation split (CMM's curriculum). Its config has
    ``validation_scores`` (one per expert in the modelset's order; null: measured by the run, which evaluates each
    expert on ``validation_items`` items per task and scores it by ``rank_by``: ``ranking.rank_experts``).

    pending: given the method's config, whether the scores must still be measured (False: the config gives them
        or does not use them);
    skip: how a config does without the evaluation, one clause naming its fields with ``{at}`` where their
        prefix goes (``method.``, a pipeline stage's ``method.stages[0].method.``)."""

    pending: Callable[[Any], bool]
    skip: str = "give {at}validation_scores"

    def fix(self, at: str = "method.") -> str:
        """``skip`` for fields under ``at``."""
        return self.skip.format(at=at)


@dataclass(frozen=True)
class Needs:
    """What a method needs prepared from the models before it merges, beyond its config; the run, merge-only,
    staged and search paths read it here (``ranking.prepare_method`` does the preparing), never a method's name.

    statistics: the calibration statistic (``calibration.KINDS``) each expert must supply, from its
        ``modelset.experts.<name>.calibration`` data, filled into ``method.statistics``;
    magnitude_cuts: each expert's k-th largest ``|tau|`` over the whole model, filled into ``method.thresholds``
        (where the config has a ``scope``, only for ``scope=model``);
    head_counts: the base's attention head counts, from its config.json;
    ranking: the experts ranked by evaluations on a validation split (``Ranking``; a caller that cannot evaluate
        refuses a config whose ranking is pending);
    expert_names: the modelset's expert names (a pipeline's stages name experts)."""

    statistics: str | None = None
    magnitude_cuts: bool = False
    head_counts: bool = False
    ranking: Ranking | None = None
    expert_names: bool = False

    def ranking_pending(self, cfg: Any) -> bool:
        """Whether ``cfg`` (the method's config) still needs the experts ranked by evaluation."""
        return self.ranking is not None and bool(self.ranking.pending(cfg))

    def cuts_pending(self, cfg: Any) -> bool:
        """Whether ``cfg`` still needs each expert's whole-model magnitude cut measured (``magnitude_cuts``)."""
        return (
            self.magnitude_cuts
            and getattr(cfg, "scope", "model") == "model"
            and getattr(cfg, "thresholds", None) is None
        )

    def statistics_pending(self, cfg: Any) -> bool:
        """Whether ``cfg`` still needs each expert's calibration statistic computed (``statistics``)."""
        return self.statistics is not None and getattr(cfg, "statistics", None) is None


# Mergekit.base: where mergekit's configuration holds the base -> how the methods reference says it
MERGEKIT_BASES = {
    "base_model": "the base is base_model",
    "listed": "the base is base_model and the first model",
    "optional": "the base is base_model, or without it the first model, merged as a model",
    "model": "the base is merged as one of the models",
    "averaged": "the base is averaged with the models, after them",
}


@dataclass(frozen=True)
class Mergekit:
    """How a method relates to mergekit 0.1.5's (``run/mergekit_config.py`` reads and writes configurations by it).

    name: mergekit's ``merge_method``;
    own: a method mergekit introduced, implemented only as mergekit computes it (one mode: ``compat`` changes
        nothing);
    same_in_both_modes: ``compat=paper`` gives mergekit's tensors too, so either mode's config is written out
        (implied by ``own``);
    base: where mergekit's configuration holds the base: ``base_model`` (base_model, not among the models: the
        task vectors are taken against it), ``listed`` (base_model, and listed first among the models, which the
        method interpolates from it: slerp), ``optional`` (as base_model, which may be left out: the first
        model is then the base, merged as a model), ``model`` (mergekit's method has no base: the base is one
        of the models where listed, and without base_model the first model is) or ``averaged`` (every model is
        averaged, base_model too, which mergekit adds after the models; without it the last model is the base);
    slices_only: the method runs only over layer slices (``slices:``), never over whole models."""

    name: str
    own: bool = False
    same_in_both_modes: bool = False
    base: str = "base_model"
    slices_only: bool = False

    def __post_init__(self) -> None:
        if self.base not in MERGEKIT_BASES:
            raise ValueError(f"Mergekit.base must be one of {', '.join(MERGEKIT_BASES)}, got {self.base!r}")

    def written_in_both_modes(self) -> bool:
        """Whether a config of either ``compat`` mode gives mergekit's tensors (own or the same in both)."""
        return self.own or self.same_in_both_modes


# what a method decided beyond its config, for result.json: (its config with the needs prepared, the modelset's
# expert names in order) -> a JSON-able dict (CMM: the merge order and step coefficients)
DetailsFn = Callable[[Any, list[str]], dict]


@dataclass(frozen=True)
class MergeMethod:
    name: str
    config: type  # the schema, with ``rules`` added by registration
    merge: MergeFn | None  # per-tensor function; None for layer methods without one
    validate: ValidateFn  # the method's own checks, then every rule's values
    doc: str
    merge_layer: LayerMergeFn | None = None  # set for methods that need a whole layer at a time
    # (cfg, n_experts, numel, gen: Draws) -> a row-chunked merge of one tensor (methods/rows.py), or None where the
    # config needs the whole tensor at once; the engine then streams large tensors in row blocks
    rows: Callable[..., Any] | None = None
    # implementation version: raised whenever the method's output for the same inputs, config and seed
    # changes, so a merge stored under an earlier version is not taken for this one's (store.merge_key)
    version: int = 1
    needs: Needs = Needs()
    mergekit: Mergekit | None = None  # mergekit's counterpart; None where mergekit has none
    details: DetailsFn | None = None  # what it decided beyond its config, for result.json (None: nothing)

    def requirements(self) -> list[str]:
        """What the method declared at registration, one line each (the methods reference shows them): what a run
        prepares before merging (``needs``), then its mergekit counterpart."""
        needs, out = self.needs, []
        if needs.statistics:
            out.append(
                f"calibration statistic '{needs.statistics}' of every expert (modelset.experts.<name>.calibration), "
                "filled into method.statistics"
            )
        if needs.magnitude_cuts:
            out.append("each expert's whole-model magnitude cut, filled into method.thresholds (scope=model)")
        if needs.head_counts:
            out.append("the base's attention head counts, read from its config.json")
        if needs.ranking is not None:
            out.append(
                "the experts ranked on a validation split (mergeval's generated tasks), filled into "
                f"method.validation_scores; to do without: {needs.ranking.fix()}"
            )
        if needs.expert_names:
            out.append("the modelset's expert names, filled into method.expert_names")
        if not out:
            out.append("nothing prepared before merging: its config is all it needs")
        if self.mergekit is None:
            out.append("no mergekit counterpart")
        else:
            mk = self.mergekit
            mode = (
                "mergekit's own method"
                if mk.own
                else "the same tensors in both modes"
                if mk.same_in_both_modes
                else "mergekit's tensors with method.compat=mergekit"
            )
            where = "over layer slices only" if mk.slices_only else MERGEKIT_BASES[mk.base]
            out.append(f"mergekit: merge_method {mk.name} ({mode}; {where})")
        return out


PER_EXPERT = ("density", "gamma", "epsilon")  # besides weight: the per-model parameters mergekit also has
METHODS: dict[str, MergeMethod] = {}
_DERIVED: dict[type, type] = {}  # method config -> its schema with rules (shared configs derive once)


def register(
    name: str,
    config: type,
    validate: ValidateFn,
    version: int = 1,
    needs: Needs = Needs(),
    mergekit: Mergekit | None = None,
    details: DetailsFn | None = None,
):
    """Register a per-tensor method: ``@register(name, Config, validate)`` on ``merge(base, experts, cfg, gen)``;
    ``version``: the implementation version (``MergeMethod.version``); ``needs``: what it needs prepared;
    ``mergekit``: its mergekit counterpart; ``details``: what it decided beyond its config, for result.json."""

    def wrap(fn: MergeFn) -> MergeFn:
        _fields_declared(name, config, needs, mergekit)
        METHODS[name] = MergeMethod(
            name,
            with_rules(config),
            fn,
            _validating_rules(validate),
            (fn.__doc__ or "").strip(),
            version=version,
            needs=needs,
            mergekit=mergekit,
            details=details,
        )
        return fn

    return wrap


def register_layer(
    name: str,
    config: type,
    validate: ValidateFn,
    merge: MergeFn | None = None,
    needs: Needs = Needs(),
    mergekit: Mergekit | None = None,
    details: DetailsFn | None = None,
):
    """Register a layer-at-a-time method: ``@register_layer(name, Config, validate)`` on
    ``merge_layer(base: dict[str, Tensor], experts: list[dict[str, Tensor]], cfg, gen) -> dict[str, Tensor]``.

    ``merge`` optionally handles the tensors outside the decoder layers one at a time
    (else ``merge_layer`` gets them as one-tensor groups); ``needs``, ``mergekit``, ``details``: as ``register``."""

    def wrap(fn: LayerMergeFn) -> LayerMergeFn:
        _fields_declared(name, config, needs, mergekit)
        METHODS[name] = MergeMethod(
            name,
            with_rules(config),
            merge,
            _validating_rules(validate),
            (fn.__doc__ or "").strip(),
            merge_layer=fn,
            needs=needs,
            mergekit=mergekit,
            details=details,
        )
        return fn

    return wrap


def _fields_declared(name: str, config: type, needs: Needs, mergekit: Mergekit | None) -> None:
    """What a method declares needs fields of its config that the run fills or reads; a config without them is
    refused when the method is registered (at import), naming the fields to add. A programming error, not a
    user's: TypeError."""
    wanted: list[tuple[str, tuple[str, ...]]] = []
    if needs.statistics:
        wanted.append(("needs.statistics", ("statistics",)))
    if needs.magnitude_cuts:
        wanted.append(("needs.magnitude_cuts", ("thresholds",)))
    if needs.head_counts:
        wanted.append(("needs.head_counts", ("num_attention_heads", "num_key_value_heads")))
    if needs.ranking is not None:
        wanted.append(("needs.ranking", ("validation_scores", "validation_items", "rank_by")))
    if needs.expert_names:
        wanted.append(("needs.expert_names", ("expert_names",)))
    if mergekit is not None and not mergekit.slices_only:  # a mergekit file's method is read with compat=mergekit
        wanted.append(("mergekit", ("compat",)))
    have = {f.name for f in dataclasses.fields(config)}
    for declared, fields in wanted:
        missing = [f for f in fields if f not in have]
        if missing:
            raise TypeError(
                f"merge method {name} declares {declared}: add the field(s) {', '.join(missing)} to "
                f"{config.__name__}: the run fills or reads them (mergeval/methods/registry.py: Needs, Mergekit)"
            )


def get_method(name: str) -> MergeMethod:
    if name not in METHODS:
        raise UserError("method.name", f"unknown merge method '{name}'", f"choose one of: {', '.join(sorted(METHODS))}")
    return METHODS[name]


# ---------------------------------------------------------------- rules: schema


def rule_params(config: type) -> dict[str, type]:
    """The parameters a rule may set: the config's float and int fields (``name`` and bools excluded)."""
    hints = typing.get_type_hints(config)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(config)
        if f.name not in ("name", "rules") and hints[f.name] in (float, int)
    }


def expert_params(config: type) -> tuple[str, ...]:
    """What an expert may set for itself: ``weight`` and the method's density/gamma/epsilon (configs with weights)."""
    names = {f.name for f in dataclasses.fields(config)}
    return ("weight",) + tuple(p for p in PER_EXPERT if p in names) if "weights" in names else ()


def with_rules(config: type) -> type:
    """``config`` plus ``rules: list[<Method>Rule]``, where a rule is ``match`` and one optional field per
    rule parameter (typed Any: a number or a list of numbers), so a misspelt parameter fails at compose time;
    configs with ``weights`` also get ``per_expert: list[dict[str, float]]`` and rules an ``expert`` index.

    The derived classes live in this module under unique names so configs pickle (joblib/submitit launchers).
    """
    if config in _DERIVED or "rules" in {f.name for f in dataclasses.fields(config)}:
        return _DERIVED.get(config, config)
    stem = config.__name__.removesuffix("Config")
    own = expert_params(config)
    rule = dataclasses.make_dataclass(
        f"{stem}Rule",
        [("match", str, dataclasses.field(default="*"))]
        + ([("expert", int | None, dataclasses.field(default=None))] if own else [])
        + [(p, Any, dataclasses.field(default=None)) for p in rule_params(config)]
        + ([("weight", Any, dataclasses.field(default=None))] if own else []),
    )
    extra = [("per_expert", list[dict[str, float]] | None, dataclasses.field(default=None))] if own else []
    derived = dataclasses.make_dataclass(
        f"{stem}ConfigWithRules",
        # list[rule], spelt so for a type checker: rule is a class made at run time
        [("rules", types.GenericAlias(list, (rule,)), dataclasses.field(default_factory=list)), *extra],
        bases=(config,),
    )
    module = sys.modules[__name__]
    for cls in (rule, derived):
        if getattr(module, cls.__name__, cls) is not cls:
            raise ValueError(f"two method configs derive the same class name {cls.__name__}")
        cls.__module__ = __name__
        setattr(module, cls.__name__, cls)
    derived.__doc__ = (config.__doc__ or "") + "\n\n" + RULES_DOC
    _DERIVED[config] = derived
    return derived


def rule_items(rule: Any) -> tuple[str, dict[str, Any]]:
    """(match, {param: value}) of one rule, given as the derived dataclass or a plain mapping."""
    if isinstance(rule, Mapping):
        items = dict(rule)
    elif dataclasses.is_dataclass(rule):
        items = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)}
    else:
        raise UserError(
            "method.rules",
            f"a rule must be a mapping, got {rule!r}",
            "write each rule as {match: GLOB, <param>: VALUE}",
        )
    match = items.pop("match", "*")
    return match, {k: v for k, v in items.items() if v is not None}


# ---------------------------------------------------------------- rules: validation


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def knots(value: Any) -> list[float]:
    """The numbers a rule value holds (a scalar is one knot); linear interpolation never leaves their range."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_rule_shapes(cfg: Any, n_experts: int) -> None:
    """Every rule names a glob and at least one settable parameter with a number or a non-empty number list;
    a rule with ``expert`` names an expert and sets only that expert's own parameters."""
    n_models = n_experts + (1 if getattr(cfg, "include_base", False) else 0)  # linear averages the base first
    for i, rule in enumerate(getattr(cfg, "rules", None) or []):
        match, params = rule_items(rule)
        expert = params.pop("expert", None)
        allowed = rule_params(type(cfg)) if expert is None else expert_params(type(cfg))
        where = f"method.rules[{i}]"
        if not isinstance(match, str) or not match:
            raise UserError(
                f"{where}.match", f"must be a non-empty glob, got {match!r}", f"set e.g. {where}.match='*mlp*'"
            )
        if expert is not None and not (isinstance(expert, int) and 0 <= expert < n_models):
            raise UserError(
                f"{where}.expert",
                f"must be an expert index in 0..{n_models - 1}, got {expert!r}",
                "count the modelset's experts from 0 (the base is 0 for linear with include_base)",
            )
        if not params:
            raise UserError(
                where,
                "sets no parameter",
                f"add one of: {', '.join(allowed) or '(this method has no numeric parameters)'}",
            )
        for p, value in params.items():
            if p not in allowed:
                raise UserError(
                    f"{where}.{p}",
                    "is not a numeric parameter of this method"
                    + (
                        " that an expert can set"
                        if expert is not None
                        else " (weight needs expert: I)"
                        if p == "weight"
                        else ""
                    ),
                    f"{'this rule' if expert is None else 'a rule with expert'} can set: "
                    f"{', '.join(allowed) or '(none)'}",
                )
            if isinstance(value, (list, tuple)) and not value:
                raise UserError(f"{where}.{p}", "is an empty list", "give a number or a list of numbers")
            if not all(_is_number(x) for x in knots(value)):
                raise UserError(
                    f"{where}.{p}",
                    f"must be a finite number or a list of them, got {value!r}",
                    f"set e.g. {where}.{p}=[0.3, 0.7]",
                )


def _validating_rules(validate: ValidateFn) -> ValidateFn:
    """The method's own ``validate``, then each rule's values through it.

    Every number of a rule is checked in place of the top-level value; since a
    gradient interpolates linearly between its numbers, every resolved value
    lies between checked ones (the engine re-checks each tensor's resolved
    config before loading any tensor, which also catches combinations).
    """

    def check(cfg: Any, n_experts: int) -> None:
        validate(cfg, n_experts)
        _check_per_expert(cfg, n_experts, validate)
        rules = getattr(cfg, "rules", None) or []
        if not rules:
            return
        check_rule_shapes(cfg, n_experts)
        for i, rule in enumerate(rules):
            params = rule_items(rule)[1]
            params.pop("expert", None)
            for p, value in params.items():
                for x in knots(value):
                    if p == "weight":
                        continue  # any finite number (check_rule_shapes)
                    trial = dataclasses.replace(cfg, rules=[], **{p: x})
                    with blame_rule(i, p, f"in {value}" if isinstance(value, (list, tuple)) else ""):
                        validate(trial, n_experts)

    check.__doc__ = validate.__doc__
    return check


def _check_per_expert(cfg: Any, n_experts: int, validate: ValidateFn) -> None:
    """per_expert: at most one entry per expert, each setting only that expert's parameters to valid values."""
    own = getattr(cfg, "per_expert", None)
    if not own:
        return
    allowed = expert_params(type(cfg))
    n_experts += 1 if getattr(cfg, "include_base", False) else 0
    if len(own) > n_experts:
        raise UserError(
            "method.per_expert",
            f"{len(own)} entries for {n_experts} experts",
            "give at most one entry per expert, in the modelset's order",
        )
    for i, entry in enumerate(own):
        for p, x in (entry or {}).items():
            field = f"method.per_expert[{i}].{p}"
            if p not in allowed:
                raise UserError(field, "is not a parameter an expert can set", f"use one of: {', '.join(allowed)}")
            if x is None:
                continue
            if not _is_number(x):
                raise UserError(field, f"must be a finite number, got {x!r}", f"set e.g. {field}=0.5")
            if p != "weight":
                try:
                    validate(dataclasses.replace(cfg, rules=[], per_expert=None, **{p: x}), n_experts)
                except UserError as err:
                    raise UserError(field, err.problem, err.fix.replace(f"method.{p}=", f"{field}=")) from None


@contextmanager
def blame_rule(index: int, param: str, where: str):
    """A UserError raised inside is re-raised against ``method.rules[index].<param>`` (``where`` says which value)."""
    try:
        yield
    except UserError as err:
        field = f"method.rules[{index}].{param}"
        problem = err.problem if err.field == f"method.{param}" else f"{err.field} {err.problem}"
        fix = err.fix.replace(f"method.{param}=", f"{field}=")
        raise UserError(field, f"{problem} ({where})" if where else problem, fix) from None
