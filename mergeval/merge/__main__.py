"""``python -m mergeval.merge``: merge only, streamed to disk; no evaluation.

Composes the same config tree as ``python -m mergeval`` (method, modelset,
``seed``, ``vocab_policy``; benchmark and metric are composed but unused) and
writes the merged model with the bounded-memory streaming engine to
``output=DIR`` (default: ``<job dir>/merged_model``). DIR must not exist; it
appears only when the merge is complete. Errors a user can cause end in one
line on stderr and exit status 2, as with ``python -m mergeval``.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mergeval.core.errors import UserError, from_os_error
from mergeval.run.cli import discard_job_dir, failing_cleanly, run_cli
from mergeval.run.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://mergeval.run.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    with failing_cleanly(job_dir):
        target = merge(cfg, job_dir)
    if cfg.output:  # the merge went elsewhere: the job directory would hold only Hydra's files
        discard_job_dir(job_dir)
    print(f"merged model: {target}")


def merge(cfg: DictConfig, job_dir: Path) -> Path:
    """Validate, resolve the modelset (fine-tuning zoo experts on first use), merge to disk; the output dir.
    A mergekit-multi file (mergekit=FILE): its earlier stages are merged or reused first (run/mergekit_multi.py)."""
    from mergeval.core.paths import cache_root, check_creatable
    from mergeval.run.checks import check_resolves, validate
    from mergeval.run.config import typed
    from mergeval.run.merging import merge_resolved
    from mergeval.run.ranking import refuse_ranking

    check_resolves(cfg)
    target = Path(cfg.output).expanduser().resolve() if cfg.output else job_dir / "merged_model"
    if target.exists():  # these two before minutes of fine-tuning experts or merging stages
        raise UserError("output", f"'{target}' already exists", "choose a new directory or remove that one")
    try:
        check_creatable(target)
    except OSError as err:  # procfs answers ENOENT, which from_os_error does not take for the environment's
        raise from_os_error(err) or UserError(
            "output",
            f"cannot create '{target}' in '{err.filename}' ({err.strerror})",
            "choose a directory you can write to",
        ) from None
    method, method_cfg = validate(cfg)
    refuse_ranking(method, method_cfg)  # before minutes of building experts
    return merge_resolved(typed(cfg), method, method_cfg, target, cache_root(cfg.cache_dir))


def cli() -> None:
    run_cli(
        main,
        "mergeval.merge",
        "Merge only, streamed to disk with bounded memory: output=DIR (default <job dir>/merged_model).",
    )


if __name__ == "__main__":
    cli()
