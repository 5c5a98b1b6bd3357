"""A run's evaluated models written as ``lm_eval`` results files, for tools that read lm-eval's output.

    python -m mergeval.results export RUN_ID DIR [--store PATH]

writes ``DIR/results_<role>.json`` for every model of the finished run (base,
each expert, merged), shaped as ``lm_eval --output_path`` writes them:

- ``results[task]``: ``alias``, then every metric the store holds for that
  model, task and the run's settings as ``"<metric>,<filter>": value`` and
  ``"<metric>_stderr,<filter>": stderr`` (``"N/A"`` where there is none), as
  lm-eval names them; at least the metric the run reported;
- ``group_subtasks`` (each group row's members) and ``groups`` (the group rows again), as lm-eval
  writes them for a benchmark entry that is a group;
- ``versions``, ``n-shot``, ``configs`` (the task's ``dump_config()``):
  from the run's benchmark, rebuilt from its stored config, for each task whose
  digest is still the one evaluated (a task whose data or definition changed
  since, or whose data is gone, is left out of these three);
- ``higher_is_better``, ``n-samples`` (``effective``: the items scored), and
  ``config``: ``model`` ``hf`` with ``model_args`` (``pretrained``: the
  model's directory, null for a merge kept in memory; ``dtype``) and the run's
  batch size, device, limit, generation kwargs and seeds as lm_eval records
  them (``mergeval_backend`` says which scorer ran);
- ``lm_eval_version``, ``model_name``, chat template / system instruction
  fields, and ``mergeval``: run id, role, source, fingerprint, task digests.

Such a file passes ``python -m mergeval.results import`` with the run's
overrides: it holds what that check reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import OmegaConf

from mergeval.core.errors import UserError
from mergeval.eval.harness import BOOTSTRAP_ITERS, FEWSHOT_SEED


def lm_eval_results(run: dict, role: str, metrics: dict[str, dict], suite=None) -> dict:
    """One model's lm-eval-shaped results (module docstring). ``run`` is the store's row plus its result.json
    (``task_digests``, ``rows``); ``metrics`` task -> every stored metric; ``suite`` the rebuilt benchmark."""
    cfg, result = OmegaConf.create(run["config"]), run["result"]
    model = next(m for m in run["models"] if m["role"] == role)
    tasks = [t for t in result["tasks"] if role in run["scores"].get(t, {})]
    results, hib, n_samples = {}, {}, {}
    for task in tasks:
        score = run["scores"][task][role]
        found = dict(metrics.get(task) or {})
        found.setdefault(score["metric"], [score["value"], score["stderr"]])
        results[task] = {"alias": task}
        for key, (value, stderr) in found.items():
            name, filt = key.split(",", 1)
            results[task][key] = value
            results[task][f"{name}_stderr,{filt}"] = "N/A" if stderr is None else stderr
        higher = result["rows"][task]["higher_is_better"]
        hib[task] = {key.split(",", 1)[0]: higher if key == score["metric"] else None for key in found}
        n_samples[task] = (
            {"effective": score["n"]} if cfg.benchmark.limit else {"original": score["n"], "effective": score["n"]}
        )
    known = [
        t
        for t in tasks
        if suite is not None and suite.digests.get(t) == result["task_digests"].get(t) and t in suite.loaded["tasks"]
    ]
    subtasks = group_subtasks(tasks, result["rows"], suite)
    return {
        "results": results,
        **({"groups": {g: results[g] for g in subtasks if g in results}} if subtasks else {}),
        "group_subtasks": subtasks,
        "configs": {t: suite.task(t).dump_config() for t in known},
        "versions": {t: (suite.task(t).get_config("metadata") or {}).get("version") for t in known},
        "n-shot": {t: suite.task(t).get_config("num_fewshot") or 0 for t in known},
        "higher_is_better": hib,
        "n-samples": n_samples,
        "config": {
            "model": "hf",
            "model_args": {"pretrained": model["path"], "dtype": cfg.eval.dtype},
            "batch_size": str(cfg.eval.batch_size),
            "device": cfg.eval.device,
            "limit": cfg.benchmark.limit,
            "bootstrap_iters": BOOTSTRAP_ITERS,
            "gen_kwargs": dict(cfg.eval.gen_kwargs or {}),
            "fewshot_seed": FEWSHOT_SEED,
            "mergeval_backend": cfg.eval.backend,
        },
        "lm_eval_version": (run.get("versions") or {}).get("lm_eval"),
        "model_name": model["path"] or model["source"],
        "chat_template": "applied" if cfg.eval.apply_chat_template else None,
        "system_instruction": cfg.eval.system_instruction,
        "fewshot_as_multiturn": bool(cfg.eval.fewshot_as_multiturn),
        "date": run["created"],
        "mergeval": {
            "run_id": run["run_id"],
            "role": role,
            "source": model["source"],
            "fingerprint": model["fingerprint"],
            "task_digests": {t: result["task_digests"][t] for t in tasks},
        },
    }


def group_subtasks(tasks: list[str], rows: dict, suite=None) -> dict[str, list[str]]:
    """``{group: its direct members}`` for every group row among ``tasks``, as lm-eval's ``group_subtasks``
    (its ``make_table`` indents members under their group). From the rebuilt benchmark's groups when there is one;
    else from the run's rows: a group row (no output type) lists the other rows of its benchmark entry (nested
    groups then appear flattened under the entry's group)."""
    groups = suite.loaded["groups"] if suite is not None else {}
    out = {}
    for task in tasks:
        if task in groups:
            out[task] = list(groups[task].child_names)
        elif rows.get(task, {}).get("output_type", "") is None:
            out[task] = [t for t in tasks if t != task and rows.get(t, {}).get("entry") == rows[task].get("entry")]
    return out


def export_run(store, run_id: str, out_dir: Path, rebuild: bool = True) -> list[Path]:
    """Write ``results_<role>.json`` per model of finished run ``run_id`` into ``out_dir``; their paths."""
    from mergeval.core.paths import atomic_write_text, make_dirs
    from mergeval.eval.settings import PerTask, eval_settings

    run = _finished_run(store, run_id)
    cfg = OmegaConf.create(run["config"])
    suite = _rebuilt_suite(cfg) if rebuild else None
    run_settings = eval_settings(cfg)
    run_settings["lm_eval"] = (run.get("versions") or {}).get("lm_eval") or run_settings["lm_eval"]
    # each task's scores under the key the run stored them with (runs before per-task keys: the run's settings)
    settings = PerTask(run_settings, run["result"].get("task_settings") or {})
    digests = run["result"]["task_digests"]
    _refuse_other_runs_files(out_dir, run["run_id"])
    make_dirs(out_dir)
    written = []
    for model in run["models"]:
        metrics = store.all_metrics(model["fingerprint"], digests, settings)
        path = out_dir / f"results_{re.sub(r'[^A-Za-z0-9_.-]', '_', model['role'])}.json"
        atomic_write_text(
            path, json.dumps(lm_eval_results(run, model["role"], metrics, suite), indent=2, default=str) + "\n"
        )
        written.append(path)
    return written


def _refuse_other_runs_files(out_dir: Path, run_id: str) -> None:
    """An export into a directory that holds another run's results files would replace some and keep others
    (another run's roles): refused. The same run exported again replaces its own files."""
    for path in sorted(out_dir.glob("results_*.json")) if out_dir.is_dir() else []:
        try:
            other = json.loads(path.read_text())["mergeval"]["run_id"]
        except (OSError, ValueError, KeyError, TypeError):
            other = None  # not an export of ours: not ours to replace either
        if other != run_id:
            raise UserError(
                "DIR",
                f"{path} is {'from run ' + other[:8] if other else 'not an export of this run'}",
                "export each run into a directory of its own",
            )


def _finished_run(store, run_id: str) -> dict:
    runs = [r for r in store.runs() if r["run_id"].startswith(run_id)] if run_id else []
    if len(runs) != 1:
        raise UserError(
            "RUN_ID",
            f"{len(runs)} runs in {store.location} start with '{run_id}'",
            "give a run id (or an unambiguous prefix) that `python -m mergeval.results` lists",
        )
    run = runs[0]
    if run["status"] != "finished":
        raise UserError("RUN_ID", f"run {run['run_id']} is {run['status']}", "export a finished run")
    try:
        run["result"] = json.loads(Path(run["result_path"]).read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            "RUN_ID", f"cannot read the run's {run['result_path']} ({err})", "restore its job directory"
        ) from None
    return run


def _rebuilt_suite(cfg):
    """The run's benchmark loaded again (for versions, n-shot, configs); None when its data is gone."""
    from mergeval.core.paths import cache_root
    from mergeval.eval.suite import build_suite

    try:
        return build_suite(cfg.benchmark, cfg.eval, cache_root(cfg.cache_dir))
    except UserError:
        return None


def main(argv: list[str]) -> int:
    """``python -m mergeval.results export RUN_ID DIR [--store PATH]``; 0, or 2 with one line."""
    import argparse
    import sys

    from mergeval.results.store import open_existing

    parser = argparse.ArgumentParser(
        prog="python -m mergeval.results export", description="Write a run's models as lm_eval results files."
    )
    parser.add_argument("run_id", help="the run (an unambiguous prefix of its id)")
    parser.add_argument("out_dir", help="directory for results_<role>.json")
    parser.add_argument("--store", help="the SQLite results store (default: <cache>/results.sqlite)")
    args = parser.parse_args(argv)
    try:
        written = export_run(open_existing(args.store), args.run_id, Path(args.out_dir).expanduser())
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0
