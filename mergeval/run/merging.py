"""A run config's merge written to disk: ``python -m mergeval.merge``'s work, and a mergekit-multi stage's."""

from __future__ import annotations

from pathlib import Path

from mergeval.run.config import RunCfg, RunConfig


def merge_resolved(cfg: RunConfig, method, method_cfg, target: Path, cache: Path, resolved=None) -> Path:
    """Resolve the modelset (fine-tuning zoo experts on first use) unless ``resolved`` (resolve_models' answer)
    is given, prepare the method, merge to ``target`` with the streaming engine and write mergekit.yaml there
    when mergekit can express the merge; the output dir."""
    from mergeval.models.zoo.resolve import resolve_models
    from mergeval.run import mergekit_config
    from mergeval.run.ranking import prepare_method

    base_dir, expert_dirs, models = resolved or resolve_models(cfg, cache)
    method_cfg, _ = prepare_method(cfg, method, method_cfg, models, base_dir, cache, can_evaluate=False)
    out = write_merge(cfg, method, method_cfg, base_dir, expert_dirs, models, target)
    mergekit_config.write_for_run(out / "mergekit.yaml", cfg, models)  # when mergekit can express the merge
    return out


def write_merge(cfg: RunConfig, method, method_cfg, base_dir: Path, expert_dirs, models, target: Path) -> Path:
    """The streaming engine's merge of the resolved models into ``target`` with the run's settings (seed,
    vocab_policy, out_dtype, tokenizer_source, slices, merge.device) and a model card naming the inputs."""
    from mergeval.merge import merge_to_disk
    from mergeval.merge.card import merge_config
    from mergeval.merge.slices import parse

    inputs = [{"role": m.role, "source": m.source, "path": m.path, "fingerprint": m.weights} for m in models]
    return merge_to_disk(
        method,
        method_cfg,
        base_dir,
        expert_dirs,
        target,
        cfg.seed,
        cfg.vocab_policy,
        card={"config": merge_config(cfg), "inputs": inputs},
        progress=True,
        out_dtype=cfg.out_dtype,
        tokenizer_source=getattr(cfg, "tokenizer_source", None),
        slices=parse(getattr(cfg.modelset, "slices", None), ["base", *cfg.modelset.experts]),
        device=merge_device(cfg),
    )


def merge_device(cfg: RunCfg) -> str:
    """The device ``merge.device`` names (the evaluation's by default; ``auto`` resolved as ``eval.device``)."""
    node = getattr(cfg, "merge", None)  # configs recorded before merge.device have none
    device = str(getattr(node, "device", None) or "cpu")
    if device == "auto":
        from mergeval.core.precision import auto_device

        device = auto_device("auto")
    return device
