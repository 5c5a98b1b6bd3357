"""mergekit merge configurations (YAML) in and out, with ``compat=mergekit`` semantics.

In: ``python -m mergeval mergekit=PATH`` (or ``python -m mergeval.merge mergekit=PATH output=DIR``)
replaces the run's method and modelset by the file's (a mergekit-multi file of several configurations:
mergekit_multi.py runs its stages, each translated as below):

    merge_method            the method of the same name, compat=mergekit
    base_model, models      modelset.base and modelset.experts (a local directory if it exists
                            relative to the working directory, else hf:<id>); for slerp the model
                            that is not the base is the expert; for linear, nuslerp and multislerp
                            without base_model the first model is the base and is merged as one of
                            the models (include_base); karcher averages base_model too (include_base,
                            the base last, where mergekit adds it), and without one the last model
                            is the base
    parameters (global)     lambda -> lambda_, rescale true/false -> l1/none, normalize, t,
                            filter_wise, select_topk, density, gamma, epsilon, r, alpha, weight,
                            nuslerp_flatten, nuslerp_row_wise, normalize_weights, eps, max_iter,
                            tol; int8_mask (no numeric effect) is accepted
    models[i].parameters    weight, density, gamma, epsilon: expert i's own values (rules with
                            expert: i, after the global ones, so they win as in mergekit)
    a gradient [a, b, ...]  a rule {match: '*', <param>: [a, b, ...]} (same depth t as mergekit)
    filters [{filter: f, value: v}, ...]
                            rules {match: '*f*'}, listed in reverse so that the first matching
                            filter wins, as in mergekit; per-model ones carry ``expert: i``
    out_dtype (else dtype)  out_dtype: the dtype the merged model is written in, as in mergekit
                            (which writes in dtype when out_dtype is absent); float32, bfloat16,
                            float16 and their short names. dtype, mergekit's working precision, is
                            not applied: mergeval merges in float32 (a note says so when it is
                            lower; mergekit's result then differs by its roundings)
    tokenizer_source        base, union or a model of the file (also as tokenizer: {source: ...}):
                            tokenizer_source=base|union|<expert name>, the vocabularies aligned by
                            token as mergekit aligns them (mergeval/merge/tokens.py)

    slices + passthrough    modelset.slices (merge/slices.py), method passthrough (scale global);
    slices + another method each slice's sources merged by it (as models: above, over the slice's
                            sources: the base's range first); per-source or per-slice parameters and
                            a slice's own base_model are refused

Anything else (modules, the methods mergeval lacks, tokenizer: tokens or pad_to_multiple_of,
chat_template, LoRA or revision model references, a parameter the method does not have) is a
UserError naming the key.

Out: ``to_mergekit`` writes the mergekit configuration of a merge when mergekit can express it
exactly: compat=mergekit (or a method the same in both modes: linear, task_arithmetic and mergekit's
own nearswap, nuslerp, multislerp, karcher...) and rules whose
globs are '*' or '*<substring>*'; else it returns None.

Which mergekit method a mergeval method is, and how mergekit's configuration holds its base, each method
declares where it is registered (``MergeMethod.mergekit``, ``methods.registry.Mergekit``); this module names none.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from mergeval.core.errors import UserError
from mergeval.models.zoo.sources import looks_like_path


def counterparts() -> dict[str, Any]:
    """mergekit's ``merge_method`` -> the mergeval method (``MergeMethod``) that declares it at registration
    (``Mergekit``), in registration order."""
    from mergeval.methods import METHODS

    return {m.mergekit.name: m for m in METHODS.values() if m.mergekit is not None}


def whole_model_methods() -> list[str]:
    """The mergekit methods mergeval runs over whole models (``models:``), in registration order."""
    return [name for name, m in counterparts().items() if not m.mergekit.slices_only]


SHARED = (
    "lambda_",
    "t",
    "filter_wise",
    "select_topk",
    "normalize",
    "density",
    "gamma",
    "epsilon",
    "r",
    "alpha",
    "nuslerp_flatten",
    "nuslerp_row_wise",
    "normalize_weights",
    "eps",
    "max_iter",
    "tol",
)  # global parameters written out
PER_MODEL = ("weight", "density", "gamma", "epsilon")  # mergekit's per-input parameters
RENAME = {"lambda": "lambda_"}
NO_EFFECT = ("int8_mask",)
# mergekit's top-level keys mergeval does not support: (what they do, the fix)
UNSUPPORTED_TOP = {
    "modules": ("per-module merges", "merge whole models with models:"),
    "chat_template": (
        "chat template replacement",
        "drop chat_template: (the merge keeps the base's template); set "
        "another in the merged model's tokenizer_config.json",
    ),
}


# ---------------------------------------------------------------- in


def load_all(path: str | Path) -> list[dict]:
    """The configurations of a mergekit YAML file: one, or a mergekit-multi file's several (its documents)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError("mergekit", f"no such file '{path}'", "give the path of a mergekit YAML configuration")
    try:
        docs = [d for d in yaml.safe_load_all(file.read_text()) if d is not None]
    except yaml.YAMLError as err:
        raise UserError(
            "mergekit", f"'{path}' is not valid YAML ({str(err).splitlines()[0]})", "fix the file"
        ) from None
    if not docs or not all(isinstance(d, dict) for d in docs):
        raise UserError("mergekit", f"'{path}' does not hold a mapping", "write a mergekit configuration")
    return docs


def _source(ref: Any, field: str) -> str:
    if not isinstance(ref, str) or not ref:
        raise UserError(field, f"must be a model path or Hugging Face id, got {ref!r}", "write it as a string")
    if "+" in ref:
        raise UserError(
            field,
            f"'{ref}' applies a LoRA adapter, which mergeval cannot load",
            "merge the adapter into the model first",
        )
    local = Path(ref).expanduser()
    if local.is_dir():
        return str(local.resolve())
    if looks_like_path(ref):
        raise UserError(
            field,
            f"no such model directory '{local}'",
            "point it at a directory with config.json and *.safetensors, or give a Hugging Face id",
        )
    if "@" in ref:
        raise UserError(
            field,
            f"'{ref}' pins a revision, which mergeval's sources cannot",
            "download that revision and give its directory",
        )
    return f"hf:{ref}"


def _not_a_parameter(field: str, param: str, method: str, known) -> UserError:
    """A parameter the method does not have: the nearest known name when it looks like a typo."""
    import difflib

    near = difflib.get_close_matches(param, [p for p in (*known, *RENAME) if p not in RENAME.values()], n=1)
    return UserError(
        field,
        f"is not a parameter of {method}",
        f"did you mean {near[0]}?" if near else f"remove it (mergekit's {method} has no {param})",
    )


def _glob(filter_: str | None) -> str:
    if filter_ in (None, "*"):
        return "*"
    return "*" + "".join(f"[{c}]" if c in "*?[" else c for c in filter_) + "*"


def _setting(value: Any, field: str) -> list[tuple[str, Any]]:
    """A mergekit setting -> [(glob, scalar or gradient)] in mergeval's rule order (last match wins)."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = []
        for j, cond in enumerate(value):
            if set(cond) - {"filter", "value"} or "value" not in cond:
                raise UserError(
                    f"{field}[{j}]",
                    "a filter entry holds exactly value and an optional filter",
                    "write {filter: mlp, value: 0.5}",
                )
            out.append((_glob(cond.get("filter")), _scalar_or_gradient(cond["value"], f"{field}[{j}].value")))
        return out[::-1]
    return [("*", _scalar_or_gradient(value, field))]


def _scalar_or_gradient(value: Any, field: str) -> Any:
    number = (int, float)
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, number) or (
        isinstance(value, list) and value and all(isinstance(v, number) and not isinstance(v, bool) for v in value)
    ):
        return value
    raise UserError(field, f"unsupported value {value!r}", "use a number, a list of numbers or filter entries")


def from_mergekit(doc: dict, where: str = "mergekit") -> tuple[dict, dict, list[str]]:
    """(method config dict, modelset dict, notes) for a mergekit configuration (module docstring)."""
    from mergeval.methods.registry import expert_params

    for key, (what, fix) in UNSUPPORTED_TOP.items():
        if doc.get(key):
            raise UserError(f"{where}.{key}", f"{what} has no mergeval counterpart", fix)
    known = {
        "merge_method",
        "base_model",
        "models",
        "parameters",
        "dtype",
        "out_dtype",
        "tokenizer_source",
        "slices",
        "modules",
        "tokenizer",
        "chat_template",
        "name",
    }
    for key in doc:
        if key not in known:
            raise UserError(
                f"{where}.{key}",
                "is not a mergekit configuration key mergeval knows",
                f"use: {', '.join(sorted(known))}",
            )
    if doc.get("slices") is not None:
        return _from_slices(doc, where)
    found = doc.get("merge_method")
    name = found if isinstance(found, str) else str(found)
    method = counterparts().get(name) if isinstance(found, str) else None
    if method is None:
        raise UserError(
            f"{where}.merge_method",
            f"'{name}' has no mergeval counterpart",
            f"mergeval runs: {', '.join(whole_model_methods())}",
        )
    if method.mergekit.slices_only:
        raise UserError(
            f"{where}.merge_method",
            f"{name} passes one model on: mergeval runs it over slices",
            "list the layer ranges under slices: (one source each)",
        )
    base_kind = method.mergekit.base
    models = doc.get("models") or []
    if not isinstance(models, list) or not models:
        raise UserError(f"{where}.models", "lists no models", "list the models to merge under models:")
    entries = []
    for i, m in enumerate(models):
        m = {"model": m} if isinstance(m, str) else m
        if not isinstance(m, dict) or "model" not in m or set(m) - {"model", "parameters"}:
            raise UserError(
                f"{where}.models[{i}]", "must hold model and optional parameters", "write - model: PATH_OR_ID"
            )
        entries.append((str(m["model"]), m.get("parameters") or {}, f"{where}.models[{i}]"))
    base_ref = doc.get("base_model")
    notes = _notes(doc, where)

    include_base = False
    if base_kind == "averaged":  # every model is averaged, base_model too (added last where it is not listed)
        refs = [ref for ref, _, _ in entries]
        if base_ref in refs[:-1]:
            notes.append(
                f"{where}.base_model is listed before the last model: mergeval averages it last, so its "
                "tensors differ from mergekit's by float32 rounding (list it last for the same bits)"
            )
        base_ref, include_base = base_ref or refs[-1], True
    elif base_kind in ("optional", "model") and base_ref is None:  # the first model is the base, merged
        base_ref, include_base = entries[0][0], True
    elif base_ref is None:
        raise UserError(f"{where}.base_model", f"{name} needs a base model", "set base_model")
    elif base_kind == "model":  # the base is merged where the file lists it among the models
        include_base = any(ref == base_ref for ref, _, _ in entries)
    if include_base:  # the base is averaged as a model: its parameters (weight) come first
        base_entry = next((e for e in entries if e[0] == base_ref), None)  # karcher's base_model may be unlisted
        experts = [e for e in entries if e is not base_entry]
        weighted = ([base_entry] if base_entry else []) + experts
    else:
        experts = weighted = [e for e in entries if e[0] != base_ref]
    if not experts:
        raise UserError(f"{where}.models", "lists no model besides the base", "add the models to merge")

    names = {f.name for f in fields(method.config)}
    kinds = typing.get_type_hints(method.config)
    cfg: dict[str, Any] = {"name": method.name, "compat": "mergekit"}
    if include_base:
        cfg["include_base"] = True
    rules: list[dict] = []  # global ones first, then per-model ones: later rules win, so a model's own value does
    weights_given = [False] * len(weighted)

    def put(param: str, value: Any, field: str, expert: int | None) -> None:
        target = RENAME.get(param, param)
        if param in NO_EFFECT:
            return
        if target not in names and not (param == "weight" and "weights" in names):
            raise _not_a_parameter(field, param, name, names)
        for glob, v in _setting(value, field):
            if isinstance(v, str) or isinstance(v, bool):
                if glob != "*" or expert is not None:
                    raise UserError(
                        field,
                        "a switch cannot vary by tensor or model in mergeval",
                        "give it once, unfiltered, under the global parameters",
                    )
                cfg[target] = ("l1" if v else "none") if target == "rescale" else v
                continue
            if param == "weight" and expert is None and glob == "*" and not isinstance(v, list):
                cfg["weights"], weights_given[:] = [float(v)] * len(weighted), [True] * len(weighted)
            elif param == "weight" or expert is not None:
                for i in [expert] if expert is not None else range(len(weighted)):
                    weights_given[i] = weights_given[i] or param == "weight"
                    rules.append({"match": glob, "expert": i, param if param == "weight" else target: v})
            elif glob == "*" and not isinstance(v, list):
                cfg[target] = _whole(v, field) if kinds.get(target) is int else float(v)
            else:
                rules.append({"match": glob, target: v})

    for key, value in (doc.get("parameters") or {}).items():
        put(key, value, f"{where}.parameters.{key}", None)
    for i, (_, params, field) in enumerate(weighted):
        for key, value in params.items():
            if key not in PER_MODEL and RENAME.get(key, key) not in names and key not in NO_EFFECT:  # a typo
                raise _not_a_parameter(f"{field}.parameters.{key}", key, name, PER_MODEL)
            # a parameter the method shares across models (ram's epsilon): mergekit ignores it here
            if key not in PER_MODEL or (key in names and key not in expert_params(method.config)):
                raise UserError(
                    f"{field}.parameters.{key}",
                    "mergekit reads it only from the global parameters",
                    f"move {key} under parameters:",
                )
            put(key, value, f"{field}.parameters.{key}", i)
    if "weights" in names:
        missing = [i for i, given in enumerate(weights_given) if not given]
        if missing:
            raise UserError(
                f"{weighted[missing[0]][2]}.parameters.weight",
                f"mergekit's {name} needs a weight for every model",
                "add weight: 1.0",
            )
    if rules:
        cfg["rules"] = rules
    stem = f"mergekit_{name}"
    modelset = {
        "name": stem,
        "base": _source(base_ref, f"{where}.base_model"),
        "experts": _expert_names([(ref, field) for ref, _, field in experts]),
    }
    tokenizer_choice(doc, modelset, where)  # its errors, with the file's others
    return cfg, modelset, notes


def _whole(value: float, field: str) -> int:
    if not float(value).is_integer():
        raise UserError(field, f"must be a whole number, got {value!r}", "write it without a fraction")
    return int(value)


def tokenizer_choice(doc: dict, modelset: dict, where: str = "mergekit") -> str | None:
    """mergeval's tokenizer_source for the file's ``tokenizer_source`` or ``tokenizer: {source}`` (mergekit's
    default source there is union): base, union, or the modelset name of the model it names; None when absent."""
    tok, field = doc.get("tokenizer_source"), f"{where}.tokenizer_source"
    if doc.get("tokenizer") is not None:
        spec, field = doc["tokenizer"], f"{where}.tokenizer"
        if tok is not None:
            raise UserError(field, "is given with tokenizer_source, which mergekit refuses", "keep one of the two")
        if not isinstance(spec, dict) or set(spec) - {"source"}:
            extra = sorted(set(spec) - {"source"}) if isinstance(spec, dict) else [spec]
            raise UserError(
                field,
                f"{extra[0]}: mergeval takes only tokenizer.source (no per-token embeddings or padding)",
                "drop it, or build that tokenizer with mergekit",
            )
        tok, field = spec.get("source", "union"), f"{field}.source"
    if tok is None:
        return None
    if doc.get("base_model") is None:
        raise UserError(
            field, "without base_model mergekit builds the tokenizer around any one of the models", "set base_model"
        )
    if tok in ("base", "union"):
        return tok
    ref = _source(tok, field) if isinstance(tok, str) and tok else tok
    if ref == modelset["base"]:
        return "base"
    for name, expert in modelset["experts"].items():
        if expert["source"] == ref:
            return name
    raise UserError(field, f"'{tok}' is not a model of this file", "use base, union or one of the models")


def _notes(doc: dict, where: str) -> list[str]:
    """The checks of dtype and out_dtype; the notes to print about them (tokenizer_source: tokenizer_choice)."""
    for key in ("dtype", "out_dtype"):  # before any note about them is printed
        if doc.get(key) is not None and doc[key] not in DTYPE_NAMES:
            raise UserError(f"{where}.{key}", f"unknown dtype '{doc[key]}'", f"use one of: {', '.join(DTYPE_NAMES)}")
    if doc.get("dtype") not in (None, "float32", "fp32"):
        return [
            f"{where}.dtype={doc['dtype']}: mergeval merges in float32 (mergekit computes in "
            f"{doc['dtype']}, so its tensors differ by that rounding)"
        ]
    return []


def _from_slices(doc: dict, where: str) -> tuple[dict, dict, list[str]]:
    """``from_mergekit`` of a configuration with slices: (module docstring)."""
    slices, field = doc["slices"], f"{where}.slices"
    if doc.get("models"):
        raise UserError(
            f"{where}.models",
            "cannot be combined with slices:",
            "list the models in the slices' sources, or remove slices: to merge whole models",
        )
    if not isinstance(slices, list) or not slices:
        raise UserError(field, "lists no slices", "write - sources: [{model: PATH_OR_ID, layer_range: [0, 4]}]")
    refs: list[tuple[str, str]] = []  # (model reference, field) in order of first appearance
    parsed = []
    for s, entry in enumerate(slices):
        at = f"{field}[{s}]"
        if not isinstance(entry, dict) or "sources" not in entry:
            raise UserError(at, "must hold sources", "write - sources: [{model: PATH_OR_ID, layer_range: [0, 4]}]")
        for key in set(entry) - {"sources"}:
            if key == "base_model" and entry[key] in (None, doc.get("base_model")):
                continue
            raise UserError(
                f"{at}.{key}",
                "a slice's own " + key + " has no mergeval counterpart",
                "give it once for the whole merge (base_model:, parameters:) or remove it",
            )
        sources = entry["sources"] if isinstance(entry["sources"], list) else []
        for j, src in enumerate(sources):
            if not isinstance(src, dict) or not isinstance(src.get("model"), str):
                raise UserError(
                    f"{at}.sources[{j}]",
                    "must hold model and layer_range",
                    "write - model: PATH_OR_ID\n  layer_range: [0, 4]",
                )
            if src.get("parameters"):
                raise UserError(
                    f"{at}.sources[{j}].parameters",
                    "a source's own parameters have no mergeval counterpart",
                    "move them under the global parameters:",
                )
            unknown = sorted(set(src) - {"model", "layer_range", "parameters"})
            if unknown:
                raise UserError(
                    f"{at}.sources[{j}].{unknown[0]}", "is not a key of a slice source", "keep model and layer_range"
                )
            if src["model"] not in [r for r, _ in refs]:
                refs.append((src["model"], f"{at}.sources[{j}]"))
        parsed.append(sources)
    if not refs:
        raise UserError(field, "name no models", "give each slice its sources")
    base_ref = doc.get("base_model") or refs[0][0]
    others = [(r, f) for r, f in refs if r != base_ref]
    names = dict(zip([r for r, _ in others], _expert_names(others)))
    names[base_ref] = "base"
    out_slices = [
        {"sources": [{"model": names[src["model"]], "layer_range": src.get("layer_range")} for src in sources]}
        for sources in parsed
    ]
    from mergeval.merge.slices import parse

    order = parse(out_slices, list(names.values()), field)  # the sources of each slice, the base's first
    assert order is not None, "out_slices has a slice for each of the file's"
    name = doc.get("merge_method")
    method = counterparts().get(name) if isinstance(name, str) else None
    if method is not None and method.mergekit.slices_only:
        notes = _notes(doc, where)
        cfg: dict[str, Any] = {"name": method.name}
        for key, value in (doc.get("parameters") or {}).items():
            if key != "scale":
                raise _not_a_parameter(f"{where}.parameters.{key}", key, method.mergekit.name, ["scale"])
            for glob, v in _setting(value, f"{where}.parameters.{key}"):
                if glob == "*" and not isinstance(v, list):
                    cfg["scale"] = float(v)
                else:
                    cfg.setdefault("rules", []).append({"match": glob, "scale": v})
    else:  # the method over the first slice's sources, as if they were whole models
        by_name = {v: k for k, v in names.items()}
        models = [{"model": by_name[x.model]} for x in order[0]]
        cfg, _, notes = from_mergekit(
            {k: v for k, v in doc.items() if k != "slices"}
            | {
                "models": models,
                "base_model": doc.get("base_model")
                or (None if method and method.mergekit.base == "model" else base_ref),
            },
            where,
        )
    experts = {names[r]: {"source": _source(r, f"{f}.model")} for r, f in others}
    modelset = {
        "name": f"mergekit_{name}_slices",
        "base": _source(base_ref, f"{where}.base_model"),
        "experts": experts,
        "slices": out_slices,
    }
    return cfg, modelset, notes


DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def output_dtype(doc: dict, where: str = "mergekit") -> str | None:
    """The dtype name mergekit would write the merge in: out_dtype, else dtype, else None (the inputs')."""
    key = "out_dtype" if doc.get("out_dtype") is not None else "dtype"
    value = doc.get(key)
    if value is None:
        return None
    if value not in DTYPE_NAMES:
        raise UserError(f"{where}.{key}", f"unknown dtype '{value}'", f"use one of: {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[value]


def _expert_names(refs: list[tuple[str, str]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for ref, field in refs:
        stem = "".join(c if c.isalnum() or c in "_-" else "_" for c in Path(ref.rstrip("/")).name) or "model"
        key, k = stem, 2
        while key in out:
            key, k = f"{stem}_{k}", k + 1
        out[key] = {"source": _source(ref, f"{field}.model")}
    return out


_NOTED: set[str] = set()


def apply_doc(cfg, doc: dict, where: str = "mergekit", names: dict[str, str] | None = None) -> None:
    """Replace ``cfg.method`` and ``cfg.modelset`` in place by one configuration of a mergekit file
    (``mergekit_multi.apply`` reads the file and runs its earlier stages); ``names``: model path -> the
    modelset name its expert gets."""
    from omegaconf import OmegaConf, open_dict

    from mergeval.methods import get_method
    from mergeval.run.config import ModelsetConfig

    method_cfg, modelset, notes = from_mergekit(doc, where)
    if names:
        modelset = renamed(modelset, names)
    for note in notes:
        if note not in _NOTED:  # a job applies the file before it starts, and validate again
            _NOTED.add(note)
            print(f"note: {note}", file=sys.stderr)
    schema = get_method(method_cfg["name"]).config
    written = output_dtype(doc, where)
    with open_dict(cfg):
        cfg.method = OmegaConf.merge(OmegaConf.structured(schema), method_cfg)
        cfg.modelset = OmegaConf.merge(OmegaConf.structured(ModelsetConfig), modelset)
        if cfg.get("out_dtype") is None:  # an out_dtype given on the command line wins over the file's
            cfg.out_dtype = written
        cfg.tokenizer_source = tokenizer_choice(doc, modelset, where)


def renamed(modelset: dict, names: dict[str, str]) -> dict:
    """``modelset`` with each expert whose source is a key of ``names`` called by its value (where no other
    expert has that name already); its layer slices follow."""
    new: dict[str, str] = {}
    for key, expert in modelset["experts"].items():
        want = names.get(expert["source"])
        if want and want not in modelset["experts"] and want not in new.values() and want != "base":
            new[key] = want
    experts = {new.get(k, k): v for k, v in modelset["experts"].items()}
    out = {**modelset, "experts": experts}
    if modelset.get("slices"):
        out["slices"] = [
            {**s, "sources": [{**src, "model": new.get(src["model"], src["model"])} for src in s["sources"]]}
            for s in modelset["slices"]
        ]
    return out


# ---------------------------------------------------------------- out


def to_mergekit(
    method_cfg: Any, base: str, experts: list[str], out_dtype: str | None = None, tokenizer_source: str | None = None
) -> dict | None:
    """The mergekit configuration of this merge, or None when mergekit cannot give the same tensors.
    ``out_dtype``: the dtype the merge is written in (None: the inputs'). ``tokenizer_source``: base, union or
    the path of the model whose tokenizer the merge gets."""
    from mergeval.methods import get_method
    from mergeval.methods.registry import rule_items

    mk = get_method(method_cfg.name).mergekit
    if mk is None or mk.slices_only:
        return None
    if getattr(method_cfg, "compat", "paper") != "mergekit" and not mk.written_in_both_modes():
        return None
    if getattr(method_cfg, "sign_rule", "sum") != "sum":
        return None
    shared: dict[str, Any] = {}
    own: list[dict[str, Any]] = [
        {} for _ in range(len(experts) + (1 if getattr(method_cfg, "include_base", False) else 0))
    ]
    names = {f.name for f in fields(method_cfg)}
    for f in SHARED:
        value = getattr(method_cfg, f, None)
        if f in names and value is not None:
            shared[{"lambda_": "lambda"}.get(f, f)] = value
    rescale = getattr(method_cfg, "rescale", None)
    if rescale is not None:
        shared["rescale"] = rescale == "l1"
    if "weights" in names:
        from mergeval.methods.compat import expert_value

        for i in range(len(own)):
            own[i]["weight"] = expert_value(method_cfg, "weight", i)
            for p in PER_MODEL[1:]:
                pe = getattr(method_cfg, "per_expert", None) or []
                if i < len(pe) and pe[i] and pe[i].get(p) is not None:
                    own[i][p] = pe[i][p]
        for p in PER_MODEL[1:]:  # every model has its own: mergekit never reads the global one
            if own and all(p in o for o in own) and not isinstance(shared.get(p), list):
                shared.pop(p, None)
    for rule in getattr(method_cfg, "rules", None) or []:
        match, params = rule_items(rule)
        expert = params.pop("expert", None)
        if not (
            match == "*"
            or (
                match.startswith("*")
                and match.endswith("*")
                and len(match) > 2
                and not any(c in match[1:-1] for c in "*?[")
            )
        ):
            return None
        filt = None if match == "*" else match[1:-1]
        for p, v in params.items():
            target = own[expert] if expert is not None else shared
            key = {"lambda_": "lambda"}.get(p, p)
            entries = target.get(key)
            entries = (
                entries
                if isinstance(entries, list) and entries and isinstance(entries[0], dict)
                else ([] if entries is None else [{"value": entries}])
            )
            # mergeval: the last matching rule wins; mergekit: the first filter -> put the rule first
            entries.insert(0, {"filter": filt, "value": v} if filt else {"value": v})
            target[key] = entries
    for target in [shared, *own]:
        for key, entries in target.items():
            if isinstance(entries, list) and entries and isinstance(entries[0], dict):
                cut = next((j for j, e in enumerate(entries) if "filter" not in e), len(entries) - 1)
                target[key] = entries[: cut + 1]  # entries after an unfiltered one are never reached
    include_base = getattr(method_cfg, "include_base", False)
    paths = ([base] if include_base and mk.base != "averaged" else []) + list(experts)
    models: list[dict[str, Any]] = [
        {"model": p, **({"parameters": own[i]} if own[i] else {})} for i, p in enumerate(paths)
    ]
    doc: dict[str, Any] = {"merge_method": mk.name}
    if mk.base == "listed":  # mergekit lists the base among the models it interpolates
        models = [{"model": base}] + models
    # base "model" (linear) and, with include_base, "optional" (nuslerp, multislerp) list the base as a model;
    # "averaged" (karcher) averages base_model (which mergekit adds after the models, where mergeval puts the base)
    # only with include_base
    wants_base = {"model": False, "averaged": include_base}.get(mk.base, not include_base)
    if tokenizer_source is not None and not wants_base:
        if not (mk.base == "model" and include_base):
            return None  # mergekit's tokenizer needs a base_model, which this method would then merge as a model
        wants_base = True
    if wants_base:
        doc["base_model"] = base
    doc.update({"models": models, "parameters": shared, "dtype": "float32"})
    if out_dtype is not None:
        doc["out_dtype"] = out_dtype
    if tokenizer_source is not None:
        doc["tokenizer_source"] = tokenizer_source
    return doc


def sliced_to_mergekit(
    method_cfg: Any, paths: dict[str, str], slices: list, out_dtype: str | None = None
) -> dict | None:
    """The mergekit configuration of a merge over layer slices (``merge.slices.parse``'s, in input order;
    ``paths``: modelset name -> model path), or None when mergekit cannot give the same tensors."""
    from mergeval.methods import get_method

    n = len(slices[0])
    mk = get_method(method_cfg.name).mergekit
    if mk is not None and mk.slices_only:
        if getattr(method_cfg, "rules", None):
            return None
        doc: dict[str, Any] = {"merge_method": mk.name, "base_model": paths["base"]}
        if method_cfg.scale != 1.0:
            doc["parameters"] = {"scale": method_cfg.scale}
        own: dict[int, dict] = {}
    else:  # the method's configuration over placeholders for the input positions, then those put in slices
        converted = to_mergekit(method_cfg, "@0", [f"@{p}" for p in range(1, n)], out_dtype)
        if converted is None:
            return None
        doc = converted
        own = {int(m["model"][1:]): m.get("parameters") or {} for m in doc.pop("models")}
        if "base_model" in doc:
            doc["base_model"] = paths["base"]
    doc["slices"] = [
        {
            "sources": [
                {
                    "model": paths[x.model],
                    "layer_range": [x.start, x.end],
                    **({"parameters": own[p]} if own.get(p) else {}),
                }
                for p, x in enumerate(sources)
            ]
        }
        for sources in slices
    ]
    doc = {k: doc[k] for k in ("merge_method", "base_model", "slices", "parameters") if k in doc} | {
        k: v for k, v in doc.items() if k not in ("merge_method", "base_model", "slices", "parameters")
    }
    doc.setdefault("dtype", "float32")
    if out_dtype is not None:
        doc["out_dtype"] = out_dtype
    return doc


def write(
    path: Path,
    method_cfg: Any,
    base: str,
    experts: list[str],
    out_dtype: str | None = None,
    tokenizer_source: str | None = None,
    doc: dict | None = None,
) -> Path | None:
    """Write ``to_mergekit``'s configuration (or ``doc``) as YAML at ``path`` (nothing when mergekit cannot
    express it)."""
    from mergeval.core.paths import atomic_write_text

    doc = doc or to_mergekit(method_cfg, base, experts, out_dtype, tokenizer_source)
    if doc is None:
        return None
    atomic_write_text(
        path,
        "# mergekit 0.1.5 configuration giving this merge: mergekit-yaml mergekit.yaml OUT\n"
        + yaml.safe_dump(doc, sort_keys=False),
    )
    return path


def write_for_run(path: Path, cfg, models) -> Path | None:
    """``write`` for a run: the method of ``cfg`` over its models (``ModelInfo``: role base, the experts by name)."""
    from mergeval.merge.slices import parse
    from mergeval.run.config import typed

    cfg = typed(cfg)
    paths = {m.role: m.path for m in models}
    base = paths.get("base")
    experts = [e for name in cfg.modelset.experts if (e := paths.get(name)) is not None]
    if base is None or len(experts) != len(cfg.modelset.experts):
        return None
    tok = cfg.tokenizer_source
    tok = tok if tok in (None, "base", "union") else paths.get(tok)
    slices = parse(cfg.modelset.slices, ["base", *cfg.modelset.experts])
    if slices:
        doc = sliced_to_mergekit(cfg.method, paths, slices, cfg.out_dtype)
        return None if doc is None else write(path, cfg.method, base, experts, doc=doc)
    return write(path, cfg.method, base, experts, cfg.out_dtype, tok)
