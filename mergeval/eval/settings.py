"""Everything besides model and task data that can change a score: part of the results store's key."""

from __future__ import annotations

# The implementation version of the shared-prefix scorer (eval/scorer.py): raise it whenever its scores for the
# same model, items and settings change, so scores it stored before are not reused (merges carry theirs:
# MergeMethod.version). Kept here, not in scorer.py, so the key is known without importing torch and lm-eval.
SHARED_PREFIX_VERSION = 1


def eval_settings(cfg) -> dict:
    """The settings of an evaluation. Keys added after the first release appear only when set away from their
    defaults, so evaluations stored before they existed keep their key (and stay reusable)."""
    from importlib.metadata import version

    settings = {"limit": cfg.benchmark.limit, "num_fewshot": cfg.benchmark.num_fewshot, "dtype": cfg.eval.dtype,
                "batch_size": cfg.eval.batch_size, "device": cfg.eval.device, "lm_eval": version("lm_eval")}
    if cfg.eval.backend != "hflm":  # evaluations stored before backends existed were HFLM's: keep their key
        settings["backend"] = cfg.eval.backend
    if cfg.eval.backend == "shared_prefix" and SHARED_PREFIX_VERSION > 1:  # version 1 keeps the keys it had
        settings["scorer_version"] = SHARED_PREFIX_VERSION
    optional = {"fewshot": dict(cfg.benchmark.fewshot or {}), "apply_chat_template": bool(cfg.eval.apply_chat_template),
                "system_instruction": cfg.eval.system_instruction,
                "fewshot_as_multiturn": bool(cfg.eval.fewshot_as_multiturn),
                "gen_kwargs": dict(cfg.eval.gen_kwargs or {}), "allow_code_execution": cfg.eval.allow_code_execution}
    settings.update({k: v for k, v in optional.items() if v})
    return settings
