"""``python -m mergeval.staged +experiment=quickstart_staged``: a sweep evaluated in three stages.

The same config tree as ``python -m mergeval``; the ``staged`` section lists
the candidates and the stage sizes (see mergeval/staged/pipeline.py). Writes
``staged.json`` into the job directory and prints the candidates and the cost
table. Bad input ends in one line and exit status 2, exactly as in
``python -m mergeval`` (whose error translation this reuses); an early stop
is a result, not an error (exit 0).
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mergeval.run.cli import failing_cleanly, run_cli
from mergeval.run.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://mergeval.run.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    from mergeval.staged import report
    from mergeval.staged.pipeline import run_staged

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    with failing_cleanly(out_dir):
        outcome = run_staged(cfg)
        if outcome.pick is not None:
            outcome.pick_command = pick_command(outcome.result(outcome.pick))
        report.render(outcome, title=f"staged sweep · {cfg.modelset.name} · {cfg.benchmark.name}")
        written = report.write(cfg, outcome, out_dir)
    print(f"staged: {written}")


def pick_command(pick) -> str:
    """The staged pick as a plain run: its method and every field of its config that the plain run's
    composition of that method (this command's other overrides, ``method=<name>``) would set otherwise."""
    from hydra import compose

    from mergeval.core.plain import plain_dict
    from mergeval.run.config import open_mappings
    from mergeval.run.rerun import changed_fields, kept, run_command

    overrides = list(HydraConfig.get().overrides.task)
    plain = [*kept(overrides, ("staged",), pick.method), f"method={pick.method}"]
    composed = compose("config", overrides=open_mappings(plain))  # as the plain run will compose it
    return run_command(
        overrides, ("staged",), changed_fields(pick.config, plain_dict(composed.method)), method=pick.method
    )


def cli() -> None:
    run_cli(
        main,
        "mergeval.staged",
        "Evaluate a sweep in three stages (perplexity, part of the benchmark, all of it); see staged.* fields.",
    )


if __name__ == "__main__":
    cli()
