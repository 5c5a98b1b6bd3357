"""``python -m mergeval``: the Hydra entry point (thin: compose, run, report, record).

Mistakes a user can make end in one line on stderr and exit status 2 (see
mergeval/run/cli.py); HYDRA_FULL_ERROR=1 shows the full traceback instead.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mergeval.core.errors import explain  # noqa: F401  (used by older imports)
from mergeval.run.cli import failing_cleanly, run_cli
from mergeval.run.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://mergeval.run.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    from mergeval.report.table import render
    from mergeval.run import app, mergekit_multi, resume
    from mergeval.run.checks import check_known_keys, check_resolves
    from mergeval.run.devices import job_device

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    with failing_cleanly(out_dir):
        check_resolves(cfg)  # a bad interpolation: one line, before anything reads the config
        mergekit_multi.apply(cfg)  # a mergekit file's method and models, before the title and the store name them
        check_known_keys(cfg)  # before the store is opened: a misspelt +store.paht must not write to the default
        title = f"{cfg.modelset.name} · {cfg.method.name} · {cfg.benchmark.name}"
        app.check_job_dir(cfg, out_dir)
        if resume.skip(cfg, out_dir, title):  # a resumed sweep's job whose configuration finished before
            return
        with job_device(cfg):  # a parallel sweep's job on a node with several GPUs: one of its own
            outcome = app.run(cfg, out_dir)
            render(outcome, title=title)
            path = app.write_result(cfg, outcome, out_dir)
    print(f"result: {path}")


def cli() -> None:
    run_cli(
        main,
        "mergeval",
        "Merge the modelset's experts in memory, evaluate base, experts and merge on the benchmark, print\n  the table and aggregates, write result.json and record the run.",
    )


if __name__ == "__main__":
    cli()
