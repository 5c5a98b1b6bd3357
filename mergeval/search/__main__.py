"""``python -m mergeval.search +experiment=quickstart search=task_arithmetic``: tune a merge recipe with Optuna.

The same config tree as ``python -m mergeval`` (``conf/search_run.yaml`` adds the
``search`` section; presets in ``conf/search/``). Prints a progress line per
trial and the summary, writes ``search.json`` into the job directory. Bad
input ends in one line and exit status 2, as in ``python -m mergeval``.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mergeval.run.cli import failing_cleanly, run_cli
from mergeval.search.schema import register_search_configs

register_search_configs()


@hydra.main(version_base="1.3", config_path="pkg://mergeval.run.conf", config_name="search_run")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    from mergeval.core.errors import UserError

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    with failing_cleanly(out_dir):
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise UserError(
                "search", "needs Optuna, which is not installed", "pip install 'mergeval[cluster]'"
            ) from None
        from mergeval.run.rerun import run_command
        from mergeval.search import report
        from mergeval.search.run import run_search

        outcome = run_search(cfg)
        if outcome.best is not None:
            outcome.run_command = run_command(list(HydraConfig.get().overrides.task), ("search",), outcome.best_fields)
        report.render(outcome)
        written = report.write(cfg, outcome, out_dir)
    print(f"search: {written}")


def cli() -> None:
    from mergeval.search.schema import SearchConfig

    run_cli(
        main,
        "mergeval.search",
        "Tune a merge method's coefficients with Optuna on a validation split; see search.* fields and conf/search/.",
        sections={"search": SearchConfig},
    )


if __name__ == "__main__":
    cli()
