"""Every check of a run's config that needs no model and no data: one line each (field and fix), up front."""

from __future__ import annotations

import difflib
import functools
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mergeval.core.errors import UTF8_FIX, UserError, is_utf8, shown  # noqa: F401  (checks' callers import them here)
from mergeval.core.gpus import compute_device
from mergeval.core.plain import plain_dict
from mergeval.eval.harness import check_backend
from mergeval.eval.tasks import GENERATED, LETTERED, PREFIX, check_tasks, items_of, same_items
from mergeval.methods import get_method
from mergeval.metrics.aggregates import NUMBERS, TABLES
from mergeval.models.checkpoint import check_vocab_policy
from mergeval.models.zoo.domains import DOMAINS
from mergeval.run.config import RunCfg


def check_metric_config(metric, tasks: list[str]) -> None:
    """One-line errors for groups / forgetting tasks / consistency pairs that name no benchmark task, a bad
    weighting, or a consistency pair that is not one task's items in two formats."""
    for name, group in (metric.groups or {}).items():
        if not group.tasks:
            raise UserError(f"metric.groups.{name}.tasks", "empty group", "list some of benchmark.tasks")
        unknown = [t for t in group.tasks if t not in tasks]
        if unknown:
            raise UserError(
                f"metric.groups.{name}.tasks", f"{unknown} not in benchmark.tasks", f"use tasks from {tasks}"
            )
    if metric.weighting not in ("tasks", "equal", "given"):
        raise UserError("metric.weighting", f"unknown weighting '{metric.weighting}'", "use tasks, equal or given")
    if metric.weighting == "given" and set(metric.weights or {}) != set(metric.groups or {}):
        raise UserError(
            "metric.weights",
            "weighting=given needs one weight per group",
            f"set metric.weights for {sorted(metric.groups or {})}",
        )
    unknown = [t for t in metric.forgetting_tasks if t not in tasks]
    if unknown:
        raise UserError("metric.forgetting_tasks", f"{unknown} not in benchmark.tasks", f"use tasks from {tasks}")
    check_consistency_pairs([list(pair) for pair in metric.consistency], tasks)


def check_consistency_pairs(pairs: list[list[str]], tasks: list[str]) -> None:
    """Each metric.consistency pair: two distinct benchmark tasks that ask the same items (X and X_mc)."""
    for pair in pairs:
        if len(pair) != 2 or pair[0] == pair[1]:
            raise UserError(
                "metric.consistency",
                f"{pair} is not a pair of two distinct tasks",
                "give [task, task_mc] pairs, e.g. [[mergeval_chem_count, mergeval_chem_count_mc]]",
            )
        missing = [t for t in pair if t not in tasks]
        if missing:
            raise UserError(
                "metric.consistency",
                f"{missing} of pair {pair} not in benchmark.tasks",
                f"add them to benchmark.tasks or pair tasks from {tasks}",
            )
        if not same_items(*pair):
            cloze = items_of(pair[0])
            hint = f"pair {cloze} with {cloze + LETTERED}" if cloze in GENERATED else "pair a task X with X_mc"
            raise UserError("metric.consistency", f"{pair[0]} and {pair[1]} do not ask the same items", hint)


def check_resolves(cfg: DictConfig) -> None:
    """Every interpolation of ``cfg`` resolves (``seed=${oc.env:HOME}``, ``${nope.x}``, ``${oc.env:UNSET}``),
    else one line with the fix its cause needs: a key or an environment variable that is not there is not a
    type error. Run before anything is written, so a bad value leaves no job directory."""
    from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException, UnsupportedInterpolationType

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise _interpolation_error(err, InterpolationKeyError, UnsupportedInterpolationType) from None
    _check_text(resolved, "")


def _check_text(node, prefix: str) -> None:
    """Every string of the resolved config is valid UTF-8: a path given in bytes that are not (Python decodes
    them to lone surrogates) would otherwise fail deep inside, as a UnicodeEncodeError or a wrong diagnosis."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        field = f"{prefix}{key}" if isinstance(node, dict) else f"{prefix[:-1]}[{key}]"
        if isinstance(value, str) and not is_utf8(value):
            raise UserError(field, f"'{shown(value)}' has bytes that are not UTF-8 text", UTF8_FIX)
        _check_text(value, f"{field}.")


def _interpolation_error(err, key_error, unsupported) -> UserError:
    import re

    field = str(getattr(err, "full_key", "") or "config")
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    expression = re.search(r"interpolation '([^']*)'", text)
    env = re.search(r"Environment variable '([^']+)' not found", str(err) + str(err.__cause__ or ""))
    if env:
        var = env.group(1)
        return UserError(
            field,
            f"the environment variable {var} is not set",
            f"set it (export {var}=...) or give a default: ${{oc.env:{var},DEFAULT}}",
        )
    if isinstance(err, key_error):
        missing = re.search(r"key '([^']+)'", text)
        name = missing.group(1) if missing else text
        return UserError(
            field,
            f"${{{name}}} names no field of the config",
            "refer to a field that exists (e.g. ${seed}, ${modelset.name}) or give the value itself",
        )
    if isinstance(err, unsupported):
        resolver = re.search(r"interpolation type '?([\w.-]+)", text)
        return UserError(
            field,
            f"no resolver named '{resolver.group(1) if resolver else text}'",
            "use one of OmegaConf's (oc.env, oc.select, ...) or give the value itself",
        )
    converted = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", text)
    if converted:
        value, _, kind = converted.groups()
        via = f" ({expression.group(1)})" if expression else ""
        kind = kind.lower()
        article = "an" if kind[0] in "aeiou" else "a"
        return UserError(
            field,
            f"the interpolation{via} gives '{value}', not {article} {kind}",
            f"give {article} {kind} value for {field}",
        )
    return UserError(field, f"cannot resolve its value ({text})", "fix the interpolation or give the value itself")


def check_known_keys(cfg: DictConfig, schema=None) -> None:
    """Every key of ``cfg`` is a field of its schema, at every depth (``sead``, ``store.paht``,
    ``modelset.train.stpes``, ``modelset.experts.chem.sorce``, ``method.densty``): a key added with ``+`` slips
    past Hydra's struct check, and a misspelt one would otherwise be ignored (``+store.paht=FILE`` wrote to the
    default store). Free mappings (``eval.gen_kwargs``, ``benchmark.fewshot``...) keep any key. ``schema``: the
    root dataclass (default: the run's, ``config.RunConfig``); ``method`` is read against the schema of the
    method it names. Reads the config unresolved, so a bad interpolation is reported by its own check."""
    from mergeval.run.config import RunConfig

    plain = plain_dict(cfg, resolve=False)
    plain.pop("hydra", None)
    _check_keys(plain, schema or RunConfig, "")


def _check_keys(node: dict, schema, prefix: str) -> None:
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    fields = [f.name for f in dataclasses.fields(schema)]
    for key, value in node.items():
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            where = f"the fields of {prefix[:-1]}" if prefix else "the top-level fields"
            raise UserError(
                f"{prefix}{key}",
                "no such field (added with +?)",
                (f"did you mean {prefix}{near[0]}? " if near else "check the spelling; ")
                + f"{where} are: {', '.join(fields)}",
            )
        if not isinstance(value, dict):
            continue
        if prefix == "" and key == "method":  # Any in the schema: the fields of the method it names
            if isinstance(value.get("name"), str) and value["name"] in _method_names():
                _check_keys(value, get_method(value["name"]).config, "method.")
            continue
        inner, keyed = _schema_of(hints[key])
        if inner is not None and keyed:  # dict[str, <dataclass>]: each value against it
            for name, item in value.items():
                if isinstance(item, dict):
                    _check_keys(item, inner, f"{prefix}{key}.{name}.")
        elif inner is not None:
            _check_keys(value, inner, f"{prefix}{key}.")


def _schema_of(kind) -> tuple[type | None, bool]:
    """(the dataclass a field's values are checked against, whether it is a mapping of them) for a field of type
    ``kind`` (``X``, ``X | None``, ``dict[str, X]``); (None, False) for anything else (free values)."""
    import dataclasses
    import types
    import typing

    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    for option in [a for a in typing.get_args(kind) if a is not type(None)] if union else [kind]:
        if isinstance(option, type) and dataclasses.is_dataclass(option):
            return option, False
        if typing.get_origin(option) is dict and dataclasses.is_dataclass(typing.get_args(option)[1]):
            return typing.get_args(option)[1], True
    return None, False


def _method_names() -> set[str]:
    from mergeval.methods import METHODS

    return set(METHODS)


def check_mapping_keys(bench) -> None:
    """benchmark.fewshot and benchmark.metrics name entries of benchmark.tasks (their keys are free: set from the
    command line as ``benchmark.fewshot.<task>=5``, config.open_mappings; a misspelt one must fail here, before a
    sweep starts its first job, not when its job loads the tasks)."""
    entries = list(bench.tasks)
    for field in ("fewshot", "metrics"):
        for task in bench.get(field) or {}:
            if task not in entries:
                near = difflib.get_close_matches(task, entries, n=1)
                raise UserError(
                    f"benchmark.{field}.{task}",
                    f"'{task}' is not in benchmark.tasks",
                    f"did you mean {near[0]}?" if near else f"use one of {entries}",
                )


# lm-eval's own generation keys; the rest go to transformers' generate (its GenerationConfig's fields)
_LM_EVAL_GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature")


@functools.cache
def _generation_keys() -> frozenset[str]:
    """Once per process: a sweep validates every job's config."""
    from transformers import GenerationConfig

    return frozenset(_LM_EVAL_GEN_KWARGS) | frozenset(GenerationConfig().to_dict())


def check_gen_kwargs(gen_kwargs: dict) -> None:
    """Each eval.gen_kwargs key is one lm-eval or transformers' generate() takes: a misspelt one
    (max_gen_tokens) otherwise ends the run at its first generation task, minutes in, with generate()'s
    traceback."""
    if not gen_kwargs:
        return
    known = _generation_keys()
    for key in gen_kwargs:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            raise UserError(
                f"eval.gen_kwargs.{key}",
                "not a generation setting of lm-eval or transformers' generate()",
                f"did you mean {near[0]}?" if near else "see transformers' GenerationConfig",
            )


def model_slices(cfg: RunCfg) -> list | None:
    """The modelset's layer slices checked and in input order (mergeval/merge/slices.py), or None."""
    from mergeval.merge.slices import parse

    return parse(getattr(cfg.modelset, "slices", None), ["base", *cfg.modelset.experts])


def refuse_slices(cfg: RunCfg, what: str) -> None:
    """A UserError when the modelset has layer slices, which ``what`` does not merge."""
    if getattr(cfg.modelset, "slices", None):
        raise UserError(
            "modelset.slices",
            f"{what} merges whole models, not layer slices",
            "merge and evaluate a frankenmerge with python -m mergeval (or python -m mergeval.merge)",
        )


def validate(cfg: DictConfig, schema=None):
    """All config checks that need no model: returns the method and its typed config. ``schema``: the root
    dataclass the config's keys are checked against (``check_known_keys``; default the run's).

    With ``mergekit=PATH`` the file's method and models first replace cfg.method and cfg.modelset (in place); a
    mergekit-multi file's earlier stages are merged (or reused) first."""
    from mergeval.run import mergekit_multi

    check_resolves(cfg)
    if cfg.eval.device == "auto":  # given as a value (the default resolves by itself): the device that will run
        from mergeval.core.precision import auto_device

        cfg.eval.device = auto_device("auto")
    check_merge_device(cfg)
    mergekit_multi.apply(cfg)
    method = get_method(cfg.method.name)
    check_known_keys(cfg, schema)
    method_cfg: Any = OmegaConf.to_object(cfg.method)  # the method's config dataclass
    generated = [t for t in cfg.benchmark.tasks if t in GENERATED]
    unknown = [t for t in cfg.benchmark.tasks if t.startswith(PREFIX) and t not in GENERATED]
    if unknown:  # registry names are checked when the benchmark is loaded; ours need no index
        raise UserError(
            "benchmark.tasks", f"unknown generated task '{unknown[0]}'", f"choose from: {', '.join(sorted(GENERATED))}"
        )
    if generated:
        check_tasks(generated, cfg.benchmark.n_items)
    experts = cfg.modelset.experts
    slices = model_slices(cfg)
    if slices and cfg.get("metric") is not None and cfg.metric.get("similarity"):
        raise UserError(
            "metric.similarity",
            "compares the merge's tensors with each expert's of the same name, which layer slices renumber",
            "set metric.similarity=false for a merge of modelset.slices",
        )
    if not experts and not slices:
        raise UserError("modelset.experts", "no experts to merge", "list at least one expert in the modelset")
    for name, expert in experts.items():
        if (expert.source is None) == (expert.domain is None):
            raise UserError(
                f"modelset.experts.{name}",
                "needs exactly one of source or domain",
                "set source (a model) or domain (fine-tune the base on generated data)",
            )
        if expert.domain is not None and expert.domain not in DOMAINS:
            raise UserError(
                f"modelset.experts.{name}.domain",
                f"unknown training domain '{expert.domain}'",
                f"choose one of: {', '.join(sorted(DOMAINS))}",
            )
        if expert.task is not None and expert.task not in cfg.benchmark.tasks:
            raise UserError(
                f"modelset.experts.{name}.task",
                f"'{expert.task}' is not in benchmark.tasks",
                f"use one of {list(cfg.benchmark.tasks)} or null",
            )
        if expert.get("calibration") is not None:
            from mergeval.merge.expert_statistics import check_calibration

            check_calibration(expert.calibration, f"modelset.experts.{name}.calibration", cfg.benchmark.n_items)
    if method.needs.expert_names:  # a pipeline's stages refer to experts by their modelset names
        method_cfg.expert_names = list(experts)
    try:
        method.validate(method_cfg, len(slices[0]) - 1 if slices else len(experts))  # slices: their inputs
    except UserError as err:
        if not slices or not err.field.startswith("modelset"):
            raise
        fix = (
            "give every slice the base's range and one per other input, or method=passthrough for one source per slice"
            if len(slices[0]) == 1
            else "give every slice one source, or choose a method that merges them (linear, slerp...)"
        )
        raise UserError("modelset.slices", f"{len(slices[0])} source(s) per slice: {err.problem}", fix) from None
    if method.needs.statistics and method_cfg.statistics is None:  # before minutes of building experts
        missing = [n for n, e in experts.items() if e.get("calibration") is None]
        if missing:
            field = f"modelset.experts.{missing[0]}.calibration"
            raise UserError(
                field,
                f"method {method.name} needs calibration data for every expert",
                f"set {field}={{task: {experts[missing[0]].domain or '<generated domain>'}, split: train, n: 64}}",
            )
    ranking = method.needs.ranking
    if ranking is not None and ranking.pending(method_cfg):
        if not generated:
            raise UserError(
                "method.order",
                "ranking experts needs a validation split, which only mergeval's generated tasks have",
                ranking.fix(),
            )
        check_tasks(generated, cfg.benchmark.n_items, method_cfg.validation_items)
    if cfg.benchmark.limit is not None and cfg.benchmark.limit < 1:
        raise UserError("benchmark.limit", f"must be positive, got {cfg.benchmark.limit}", "set it to null or >= 1")
    if cfg.benchmark.num_fewshot is not None and cfg.benchmark.num_fewshot < 0:
        raise UserError(
            "benchmark.num_fewshot",
            f"must be 0 or more, got {cfg.benchmark.num_fewshot}",
            "set it to null (each task's own default) or a number of examples >= 0",
        )
    check_best(cfg.sweep.best)
    check_mapping_keys(cfg.benchmark)
    check_gen_kwargs(dict(cfg.eval.gen_kwargs or {}))
    if cfg.metric.scale not in ("percent", "fraction"):
        raise UserError("metric.scale", f"unknown scale '{cfg.metric.scale}'", "use percent or fraction")
    if cfg.eval.batch_size < 1:
        raise UserError(
            "eval.batch_size", f"must be positive, got {cfg.eval.batch_size}", "set e.g. eval.batch_size=32"
        )
    check_metric_config(cfg.metric, list(cfg.benchmark.tasks))
    check_constituents(cfg.metric.constituents, list(experts))
    check_backend(cfg.eval.backend, compute_device(cfg.eval.device))  # a simulated GPU computes on the CPU
    if cfg.eval.dtype not in ("float32", "bfloat16", "float16"):
        raise UserError("eval.dtype", f"unknown dtype '{cfg.eval.dtype}'", "use float32, bfloat16 or float16")
    if cfg.get("out_dtype") not in (None, "float32", "bfloat16", "float16"):
        raise UserError(
            "out_dtype", f"unknown dtype '{cfg.out_dtype}'", "use float32, bfloat16 or float16, or null for the base's"
        )
    check_vocab_policy(cfg.vocab_policy)
    from mergeval.merge.tokens import check_tokenizer_source  # loads torch: not on the import of these checks

    check_tokenizer_source(cfg.get("tokenizer_source"), cfg.modelset.experts, cfg.vocab_policy)
    return method, method_cfg


def check_merge_device(cfg: DictConfig) -> None:
    """``merge.device`` is a device torch has here: cpu, or an accelerator torch sees (cuda[:K]); one line."""
    import torch

    from mergeval.core.gpus import kind, simulated
    from mergeval.run.merging import merge_device

    device = merge_device(cfg)
    inherited = " (eval.device's, merge.device's default)" if device == str(cfg.eval.device) else ""
    if inherited:  # the user set eval.device: its own check names it
        check_backend(cfg.eval.backend, compute_device(cfg.eval.device))
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(
            "merge.device",
            f"'{device}'{inherited} is not a device torch knows",
            "set merge.device=cpu, or cuda / cuda:K on a GPU machine",
        ) from None
    if parsed.type == "cpu" or (kind(device) == "cuda" and simulated() is not None):  # simulated: the CPU computes
        return
    backend = getattr(torch, parsed.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise UserError(
            "merge.device",
            f"'{device}'{inherited} is not available: torch sees no {parsed.type} device on this machine",
            "set merge.device=cpu to merge on the CPU (or run on a machine with one)",
        )
    count = getattr(backend, "device_count", None)
    if parsed.index is not None and count is not None and parsed.index >= count():
        raise UserError(
            "merge.device",
            f"'{device}'{inherited} is not available: torch sees {count()} {parsed.type} device(s) here",
            f"set merge.device={parsed.type} (or merge.device=cpu)",
        )


def check_constituents(choice, experts: list[str]) -> None:
    """metric.constituents: experts | base_and_experts | a non-empty list of base and expert roles."""
    if choice in ("experts", "base_and_experts"):
        return
    if isinstance(choice, str) or not choice:
        raise UserError(
            "metric.constituents",
            f"unknown choice {choice!r}",
            f"use experts, base_and_experts, or a list of roles from {['base', *experts]}",
        )
    unknown = [r for r in choice if r not in ["base", *experts]]
    if unknown:
        raise UserError(
            "metric.constituents", f"{unknown} are not roles of the modelset", f"choose from {['base', *experts]}"
        )


def check_rows(cfg: RunCfg, rows: dict) -> None:
    """Checks that need the loaded benchmark (``Suite.rows``): every task an aggregate names must report a
    higher-is-better metric (Macro-Gain, normalized scores, group means and forgetting assume one)."""
    uses = [(f"modelset.experts.{n}.task", e.task) for n, e in cfg.modelset.experts.items() if e.task is not None]
    uses += [(f"metric.groups.{g}.tasks", t) for g, group in (cfg.metric.groups or {}).items() for t in group.tasks]
    uses += [("metric.forgetting_tasks", t) for t in cfg.metric.forgetting_tasks]
    for field, task in uses:
        row = rows[task]
        if not row.higher_is_better:
            raise UserError(
                field,
                f"'{task}' reports {row.metric}, where lower is better, which the aggregates cannot use",
                f"leave {task} out there, or pick a higher-is-better metric with benchmark.metrics.{task}",
            )


def check_best(best: str) -> None:
    """``sweep.best`` names a number among a run's aggregates (a typo would silently drop the best-so-far)."""
    head, _, rest = best.partition(".")
    if (head in NUMBERS and not rest) or (head in TABLES and rest):
        return
    raise UserError(
        "sweep.best",
        f"'{best}' is not a number among a run's aggregates",
        f"use one of {', '.join(NUMBERS)}, or a value inside {', '.join(TABLES)} with dots "
        "(e.g. forgetting.mean; see a run's result.json)",
    )
