"""mergekit-multi files: several mergekit configurations in one YAML file, run as stages.

The format is mergekit-multi's: each YAML document is a mergekit configuration; a document with
``name: STAGE`` is an intermediate merge, and a later (or any other) document uses it by giving STAGE
where a model goes (base_model, models, slice sources, tokenizer_source). The one document without a
name is the final merge: mergekit-multi writes it to ``--out-path``, mergeval makes it the run's merge
(``python -m mergeval``) or writes it to ``output=`` (``python -m mergeval.merge``).

Each stage is translated as a single file is (mergekit_config.from_mergekit) and merged by mergeval's
streaming engine, in dependency order, into a content-addressed cache:
``<cache>/mergekit_stages/<key>``, where the key (results.store.merge_key) covers the stage's translated
method, the content identity (models.fingerprint.model_identity) of each of its inputs in order, the
seed, vocab_policy, out_dtype, tokenizer_source and layer slices. A rerun of the file, or another file
with the same stage over the same inputs, reuses the merge; a changed input or stage misses. Stage
names are not part of the key. Only the stages the final merge needs are built.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from mergeval.core.errors import UserError
from mergeval.core.plain import plain_list

STAGES_DIR = "mergekit_stages"
KEY_FORMAT = "mergekit-stage-1"  # raise when what a stage's key covers changes: every stage is merged anew


def apply(cfg: DictConfig) -> None:
    """``cfg.mergekit``'s file, of one configuration or several, applied to ``cfg``: the stages the final one needs are
    merged (or reused from the cache) first, then the final one replaces ``cfg.method`` and ``cfg.modelset``,
    its models the stages' directories."""
    from mergeval.run.mergekit_config import apply_doc, load_all

    path = cfg.get("mergekit")
    if not path:
        return
    docs = load_all(path)
    if len(docs) == 1:
        apply_doc(cfg, docs[0])
        return
    doc, names = final_config(cfg, docs)
    apply_doc(cfg, doc, final_label(docs), names)


def final_label(docs: list[dict]) -> str:
    return label(next(i for i, d in enumerate(docs) if d.get("name") is None), None)


def label(index: int, name: str | None) -> str:
    """How errors name a document: by its stage name, the unnamed (final) one by its position."""
    return f"mergekit[{name}]" if name is not None else f"mergekit[{index}]"


def stages(docs: list[dict]) -> tuple[dict[str, dict], dict]:
    """(stage name -> configuration without name, the final configuration), checked: names unique, one
    document without a name."""
    named: dict[str, dict] = {}
    final: dict | None = None
    for i, doc in enumerate(docs):
        name = doc.get("name")
        body = {k: v for k, v in doc.items() if k != "name"}
        if "name" in doc and (not isinstance(name, str) or not name.strip()):
            raise UserError(
                f"mergekit[{i}].name",
                f"must be a stage name, got {name!r}",
                "write name: STAGE (or drop it on the final merge)",
            )
        if name is None:
            if final is not None:
                raise UserError(
                    f"mergekit[{i}].name",
                    "a second document without a name: the file's one unnamed configuration is its final merge",
                    "give every other stage a name: STAGE",
                )
            final = body
        elif name in named:
            raise UserError(f"mergekit[{i}].name", f"stage '{name}' is named twice", "give each stage its own name")
        else:
            named[name] = body
    if final is None:
        raise UserError(
            "mergekit",
            "every document has a name, so none is the final merge (mergekit-multi "
            "writes the unnamed one to its output)",
            "remove name: from the final merge",
        )
    return named, final


def references(doc: dict, where: str) -> list[tuple[tuple, str, str]]:
    """Each place of ``doc`` that names a model: (path of keys, the reference, field)."""
    out: list[tuple[tuple, str, str]] = []

    def put(keys: tuple, value, field: str) -> None:
        if isinstance(value, str):
            out.append((keys, value, field))

    put(("base_model",), doc.get("base_model"), f"{where}.base_model")
    for i, m in enumerate(doc.get("models") or [] if isinstance(doc.get("models"), list) else []):
        if isinstance(m, str):
            put(("models", i), m, f"{where}.models[{i}]")
        elif isinstance(m, dict):
            put(("models", i, "model"), m.get("model"), f"{where}.models[{i}].model")
    for s, entry in enumerate(doc.get("slices") or [] if isinstance(doc.get("slices"), list) else []):
        if not isinstance(entry, dict):
            continue
        put(("slices", s, "base_model"), entry.get("base_model"), f"{where}.slices[{s}].base_model")
        for j, src in enumerate(entry.get("sources") or [] if isinstance(entry.get("sources"), list) else []):
            if isinstance(src, dict):
                put(("slices", s, "sources", j, "model"), src.get("model"), f"{where}.slices[{s}].sources[{j}].model")
    tok = doc.get("tokenizer_source")
    if tok not in ("base", "union"):
        put(("tokenizer_source",), tok, f"{where}.tokenizer_source")
    if isinstance(doc.get("tokenizer"), dict) and doc["tokenizer"].get("source") not in ("base", "union"):
        put(("tokenizer", "source"), doc["tokenizer"].get("source"), f"{where}.tokenizer.source")
    return out


def uses(doc: dict, where: str, names: set[str]) -> list[str]:
    """The stages ``doc`` uses, in order of first use; a reference that is neither a stage nor a model
    directory nor a Hugging Face id (org/name) is refused as an unknown stage."""
    out: list[str] = []
    for _, ref, field in references(doc, where):
        if ref in names:
            if ref not in out:
                out.append(ref)
        elif "/" not in ref and not set("+@") & set(ref) and not Path(ref).expanduser().is_dir():
            listed = ", ".join(sorted(names)) or "none"
            raise UserError(
                field,
                f"'{ref}' is neither a stage of this file nor a model directory",
                f"name a stage ({listed}), a model directory or a Hugging Face id as org/name",
            )
    return out


def order(named: dict[str, dict], final: dict, final_where: str) -> list[str]:
    """The stages the final merge needs, each after the stages it uses; a cycle between stages is refused
    (also among stages the final does not use: it is still a mistake in the file)."""
    needs = {name: uses(doc, label(0, name), set(named)) for name, doc in named.items()}
    done: list[str] = []  # every stage, each after those it uses
    path: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in path:
            cycle = path[path.index(name) :] + [name]
            raise UserError(
                f"mergekit[{name}]",
                f"the stages use each other in a cycle: {' -> '.join(cycle)}",
                "make one of them use a model or another stage instead",
            )
        path.append(name)
        for dep in needs[name]:
            visit(dep)
        path.pop()
        done.append(name)

    for name in named:
        visit(name)
    wanted = set(uses(final, final_where, set(named)))
    for name in reversed(done):  # those that a wanted stage uses, after it in reverse order
        if name in wanted:
            wanted.update(needs[name])
    return [name for name in done if name in wanted]


def substituted(doc: dict, paths: dict[str, str], where: str) -> dict:
    """``doc`` with each stage name where a model goes replaced by that stage's directory."""
    out = copy.deepcopy(doc)
    for keys, ref, _ in references(doc, where):
        if ref in paths:
            node = out
            for k in keys[:-1]:
                node = node[k]
            node[keys[-1]] = paths[ref]
    return out


def check_all(named: dict[str, dict], final: dict, final_where: str) -> None:
    """Translate every stage before any is merged (a mistake in the last stage must not wait for minutes of
    merging the first): stage references stand for empty placeholder directories."""
    from mergeval.run.mergekit_config import from_mergekit, output_dtype, tokenizer_choice

    with tempfile.TemporaryDirectory(prefix="mergeval-stages-") as tmp:
        paths = {}
        for i, name in enumerate(named):
            paths[name] = str(Path(tmp) / str(i))
            Path(paths[name]).mkdir()
        for where, doc in [*((label(0, n), d) for n, d in named.items()), (final_where, final)]:
            doc = substituted(doc, paths, where)
            _, modelset, _ = from_mergekit(doc, where)
            output_dtype(doc, where)
            tokenizer_choice(doc, modelset, where)


_BUILT: dict[tuple, tuple[dict, dict[str, str]]] = {}  # a job applies the file before it starts and again in validate


def final_config(cfg: DictConfig, docs: list[dict]) -> tuple[dict, dict[str, str]]:
    """Merge (or reuse) the stages the final configuration needs; (the final configuration with each stage
    replaced by its merged directory, directory -> stage name)."""
    import yaml

    from mergeval.core.paths import cache_root

    named, final = stages(docs)
    final_where = final_label(docs)
    needed = order(named, final, final_where)
    cache = cache_root(cfg.get("cache_dir"))
    memo = (yaml.safe_dump(docs), str(cache), cfg.get("seed"), cfg.get("vocab_policy"), cfg.get("offline"))
    if memo in _BUILT:
        return _BUILT[memo]
    check_all(named, final, final_where)
    for name in named:
        if name not in needed:
            print(f"note: mergekit stage '{name}' is not used by the final merge: not merged", flush=True)
    paths: dict[str, str] = {}
    for name in needed:
        where = label(0, name)
        paths[name] = str(
            build_stage(
                cfg, substituted(named[name], paths, where), where, {p: n for n, p in paths.items()}, name, cache
            )
        )
    out = (substituted(final, paths, final_where), {p: n for n, p in paths.items()})
    _BUILT[memo] = out
    return out


def stage_key(cfg: DictConfig, models) -> str:
    """The cache key of a stage: its translated merge over its inputs' content identities (module docstring)."""
    from mergeval.results.store import merge_key

    names = ["base", *cfg.modelset.experts]
    tok = cfg.get("tokenizer_source")
    slices = plain_list(cfg.modelset.slices) if cfg.modelset.get("slices") else None
    for s in slices or []:  # by input position: the names a file gives do not change the merge
        for src in s["sources"]:
            src["model"] = names.index(src["model"])
    options = {
        "format": KEY_FORMAT,
        "vocab_policy": cfg.vocab_policy,
        "out_dtype": cfg.get("out_dtype"),
        "tokenizer_source": names.index(tok) if tok in names[1:] else tok,
        "slices": slices,
    }
    return merge_key([m.fingerprint for m in models], OmegaConf.to_object(cfg.method), cfg.seed, options)


def build_stage(cfg: DictConfig, doc: dict, where: str, names: dict[str, str], name: str, cache: Path) -> Path:
    """The directory of stage ``name`` (``doc``: its configuration, earlier stages as directories): merged into
    the cache, or the cached merge of the same configuration over the same inputs."""
    from mergeval.core.paths import one_builder
    from mergeval.methods import get_method
    from mergeval.models.zoo.resolve import resolve_models
    from mergeval.run.config import typed
    from mergeval.run.mergekit_config import apply_doc
    from mergeval.run.merging import merge_resolved

    stage = copy.deepcopy(cfg)
    with open_dict(stage):
        stage.mergekit, stage.out_dtype = None, None  # the stage's own out_dtype, not the final's
    apply_doc(stage, doc, where, names)
    method = get_method(stage.method.name)
    method_cfg = OmegaConf.to_object(stage.method)
    resolved = resolve_models(stage, cache)
    target = cache / STAGES_DIR / stage_key(stage, resolved[2])
    with one_builder(target, f"mergekit stage '{name}'") as build:
        if not build:
            print(f"mergekit stage '{name}': reused {target} (same configuration and inputs)", flush=True)
            return target
        print(f"mergekit stage '{name}': merging into {target}", flush=True)
        merge_resolved(typed(stage), method, method_cfg, target, cache, resolved)
    return target
