"""A modelset resolved to checkpoint directories and fingerprints (zoo experts built on first use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mergeval.core.errors import UserError
from mergeval.core.outcome import ModelInfo
from mergeval.models.adapters import applied_adapter, is_adapter
from mergeval.models.checkpoint import check_compatible, compat_policy
from mergeval.models.fingerprint import fingerprint, model_identity
from mergeval.models.quantized import dequantized, quantization_of
from mergeval.models.zoo.sources import resolve_source


def resolve_models(cfg: Any, cache: Path) -> tuple[Path, dict[str, Path], list[ModelInfo]]:
    """The base's directory, each expert's directory (zoo experts built here) and their ModelInfo rows. ``cfg``: the
    run config, as composed or typed (``run.config.typed``); only its fields are read.

    Given models are checked for shape compatibility before any expert is fine-tuned
    (cheap checks before minutes of work).
    """
    from mergeval.models.zoo.experts import expert_dir

    fp_cache = cache / "fingerprints.json"
    # layer slices may take models of other layer counts: the merge checks those (merge/slices.py)
    check = check_compatible if not getattr(cfg.modelset, "slices", None) else (lambda *args: None)
    given = {
        name: resolve_source(e.source, f"modelset.experts.{name}.source", cache, cfg.offline)
        for name, e in cfg.modelset.experts.items()
        if e.source is not None
    }
    base_dir = _unquantized(
        resolve_source(cfg.modelset.base, "modelset.base", cache, cfg.offline), cache, "modelset.base"
    )
    given = {name: _unquantized(path, cache, f"modelset.experts.{name}.source") for name, path in given.items()}
    if is_adapter(base_dir):
        raise UserError(
            "modelset.base",
            f"'{base_dir}' is a PEFT adapter, not a full model",
            "make the adapter's "
            "own base (base_model_name_or_path in adapter_config.json) the base and the adapter an expert",
        )
    models = [_info("base", cfg.modelset.base, base_dir, base_dir, fp_cache, field="modelset.base")]
    for name, path in given.items():  # adapters applied to the base, once (cached)
        if is_adapter(path):
            given[name] = applied_adapter(
                path, base_dir, models[0].fingerprint, cfg.modelset.base, cache, f"modelset.experts.{name}.source"
            )
    policy = compat_policy(cfg.vocab_policy, getattr(cfg, "tokenizer_source", None))
    check(base_dir, given, policy)  # before spending minutes on building experts
    expert_dirs: dict[str, Path] = {}
    for name, expert in cfg.modelset.experts.items():
        if name in given:
            path, source = given[name], expert.source
        else:
            path = expert_dir(
                base_dir,
                models[0].fingerprint,
                expert.domain,
                cfg.modelset.train,
                cache,
                f"modelset.experts.{name}.domain",
            )
            source = f"finetune:{expert.domain}"
        expert_dirs[name] = path
        models.append(
            _info(
                name,
                source,
                path,
                evaluation_tokenizer(path, base_dir, getattr(cfg, "tokenizer_source", None)),
                fp_cache,
                expert.task,
                f"modelset.experts.{name}",
            )
        )
        _refuse_a_copy(models)  # as each expert comes: before later ones are fine-tuned
    check(base_dir, expert_dirs, policy)
    return base_dir, expert_dirs, models


def _unquantized(path: Path, cache: Path, field: str) -> Path:
    """``path``, or its dequantized copy when config.json says it is quantized (models/quantized.py)."""
    quant = quantization_of(path)
    return path if quant is None else dequantized(path, quant, cache, field)


def evaluation_tokenizer(path: Path, base_dir: Path, tokenizer_source: str | None) -> Path:
    """The directory of the tokenizer a run evaluates the model in ``path`` with: the base's (the tokenizer the
    merge has), or with a tokenizer_source (vocabularies aligned by token) the model's own where it has one."""
    own = tokenizer_source and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return path if own else base_dir


def _info(
    role: str,
    source: str,
    path: Path,
    tokenizer_dir: Path,
    fp_cache: Path,
    task: str | None = None,
    field: str = "modelset",
) -> ModelInfo:
    """A model's row: its weights' fingerprint and its identity as a run evaluates it (its own config, the
    tokenizer of ``tokenizer_dir``: evaluation_tokenizer). A damaged checkpoint is reported under ``field``."""
    weights = fingerprint(path, fp_cache, field)
    return ModelInfo(role, source, model_identity(weights, path, tokenizer_dir), str(path), task, weights=weights)


def _refuse_a_copy(models: list[ModelInfo]) -> None:
    """The last expert of ``models`` must differ (by its weights) from the base and from every earlier expert.

    A copy of the base has a zero task vector, and its "does not beat the base" warning sent users to train it
    longer; a second copy of an expert silently counts its task vector twice. Both are modelset mistakes."""
    last = models[-1]
    first = next((m for m in models[:-1] if m.weights == last.weights), None)
    if first is None:
        return
    if first.role == "base":
        raise UserError(
            f"modelset.experts.{last.role}",
            f"is the base model itself ({last.source}): its task vector is zero",
            "point it at a model fine-tuned from the base",
        )
    raise UserError(
        f"modelset.experts.{last.role}",
        f"is the same model as expert {first.role} ({last.source})",
        f"point one of them at another model, or remove {last.role} (a larger share of one expert is "
        "a weight: method.weights)",
    )
