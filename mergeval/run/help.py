"""``--help`` of every Hydra entry point: what it does, the real choices of each group, the main overrides.

Hydra's generic page lists its internal ``*_schema`` entries and says nothing of
mergeval; this one is built from the config tree itself, so a new method or
benchmark appears in it without editing anything here.
"""

from __future__ import annotations

from pathlib import Path

GROUPS = ("experiment", "method", "modelset", "benchmark", "metric")

OVERRIDES = """\
  method.lambda_=0.5 method.density=0.3    a method's hyperparameters (conf/method/<name>.yaml lists them)
  method=mergebench/ties                   a paper's preset: conf/method/<paper>/<name>.yaml
  benchmark.tasks=[hellaswag,gsm8k]        lm-eval task/group names, include_path tasks, mergeval_* tasks
  benchmark.limit=50                       only the first 50 items of each task
  '+benchmark.metrics.gsm8k="exact_match,strict-match"'   the metric a task reports
  eval.device=cuda eval.dtype=float32      where and in which precision models are evaluated (default:
                                           bfloat16 where the device runs it natively, else float32)
  eval.apply_chat_template=true            prompting (also system_instruction, gen_kwargs)
  offline=false                            let hub models and data sets download
  save_merged=true                         also write the merged model into the job directory
  out_dtype=bfloat16                       the dtype a saved merge is written in (default: the base's)
  cache_dir=DIR store.path=FILE seed=0     where things are cached and stored; the merge seed
  store.url=postgresql://HOST/DB           a shared results store for many machines (default: SQLite)
  -m method=ties,task_arithmetic method.lambda_=0.5,1.0    a sweep: one job directory per job
  -m hydra/launcher=parallel|ray|slurm ...  run a sweep's jobs in parallel, on Ray or on Slurm
  -m hydra/sweeper=staged method.lambda_=0.5,1.0,2.0   evaluate a sweep's merges in stages (staged.* sizes)
  sweep.resume=false sweep.best=macro_gain  re-run finished configurations; the aggregate the progress line ranks by
  --cfg job                                print the composed config and exit"""

ENTRY_POINTS = """\
  python -m mergeval            merge in memory, evaluate base, experts and merge, print and record
  python -m mergeval.check      what a run needs (models, data), what is missing, what it costs
  python -m mergeval.merge      merge only, streamed to disk: output=DIR
  python -m mergeval.staged     a sweep evaluated in three stages (+experiment=quickstart_staged)
  python -m mergeval.search     tune a method's coefficients with Optuna on a validation split (search=NAME)
  python -m mergeval.report     table, report.md and plots of runs: DIR or --store
  python -m mergeval.results    list, filter and export the runs in the results store
  python -m mergeval.verify     check a paper spec's tables and claims: SPEC [--run result.json]"""


def choices(conf: Path) -> dict[str, list[str]]:
    """Each group's options: its YAML files, those in its subfolders as ``<folder>/<name>`` (a paper's method
    presets: ``method=mergebench/ties``), without Hydra's schema entries."""
    return {
        g: sorted(
            p.relative_to(conf / g).with_suffix("").as_posix()
            for p in (conf / g).rglob("*.yaml")
            if not p.stem.endswith("_schema")
        )
        for g in GROUPS
    }


def help_text(entry: str, summary: str) -> str:
    import mergeval.run.conf

    groups = choices(Path(mergeval.run.conf.__file__).parent)
    width = max(len(g) for g in GROUPS) + 2
    lines = [
        "mergeval: merge LLM checkpoints and evaluate the merges, reproducibly.",
        "",
        f"python -m {entry} [+experiment=NAME] [GROUP=CHOICE ...] [KEY=VALUE ...]",
        f"  {summary}",
        "",
        "Config groups (GROUP=CHOICE; an experiment is added with +experiment=NAME):",
    ]
    for group, names in groups.items():
        lines.append(f"  {group:<{width}}" + _wrap(", ".join(names), 2 + width))
    lines += [
        "",
        "Main overrides:",
        OVERRIDES,
        "",
        "Entry points:",
        ENTRY_POINTS,
        "",
        "Results: each run writes outputs/<date>/<time>/result.json (a sweep: multirun/<date>/<time>/<n>/) and",
        "a row in the results store (default the SQLite file <cache_dir>/results.sqlite; cache_dir defaults to",
        "$MERGEVAL_CACHE or your user cache directory). Errors you can fix end in one line and exit status 2.",
        "",
        "Hydra's own options: --hydra-help. More: README.md.",
    ]
    return "\n".join(lines)


def _wrap(text: str, indent: int, width: int = 100) -> str:
    out, line = [], ""
    for word in text.split(" "):
        if line and len(line) + len(word) + 1 > width - indent:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    out.append(line)
    return ("\n" + " " * indent).join(out)
