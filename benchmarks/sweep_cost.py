"""What an 8-configuration sweep costs with mergeval versus the usual mergekit + lm_eval scripts.

The sweep: task_arithmetic and ties at four lambdas over the quickstart models
(SmolLM2-135M-Instruct and its two fine-tuned experts) and tasks, run side by
side on this machine:

(a) mergeval: one ``python -m mergeval -m`` multirun; merges in memory; the
    results store starts empty (cold), so the base and the experts are
    evaluated once and reused by every later job. Then the same sweep again
    (warm: everything is reused).
(b) the usual way: for each configuration ``mergekit-yaml`` writes the merged
    model to disk, then the ``lm_eval`` command line evaluates the merged model
    and the three constituents on all tasks (each configuration's script
    produces its own complete table). We also report, from the same measured
    timings, the variant where the constituents are evaluated only for the
    first configuration (``--constituents-once`` measures only that one, in
    about half the time).
(c) mergeval's staged sweep (``-m hydra/sweeper=staged``, the same eight
    configurations, its own empty store): a cheap first stage ranks every
    merge, only the finalists get the whole benchmark. It does not score every
    configuration in full, so it answers a narrower question, which one is
    best; the report says whether its pick is the best configuration of (a)'s
    full evaluation and what the pick gives up (``regret``, in mean accuracy
    over the tasks; 0 when it is the same). ``--skip-staged`` leaves it out.

Both sides evaluate the same task files (mergeval's generated tasks), in
mergeval's default precision for this CPU (bfloat16 where it runs natively,
else float32: mergeval/core/precision.py) with batch size 32, on the CPU, with the
log-softmax in float32 (the ``lm_eval`` side gets ``softmax_dtype=float32``,
which mergeval's scorer always uses; lm-eval's default would round
log-probabilities to bfloat16). The experts
must already exist in the given mergeval cache (run the quickstart once); they
are linked, not rebuilt.

Both sides must also get the same accuracies: every (model, task) pair's
accuracy from mergeval's cold sweep is compared with the ``lm_eval`` command
line's, within the scorer's stated tolerance for that precision
(``mergeval.eval.scorer.ACCURACY_TOLERANCE``); the script exits 1 naming every
pair that differs by more (after writing its report), so a speed-up is never
reported for work that computed something else.

    python benchmarks/sweep_cost.py --cache ~/.cache/mergeval --n-items 50
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mergeval.core.precision import auto_dtype  # noqa: E402
from mergeval.eval.scorer import ACCURACY_TOLERANCE  # noqa: E402

TASKS = ["mergeval_chem_count", "mergeval_unit_convert", "mergeval_general_facts"]
METHODS = ["task_arithmetic", "ties"]
EXPERTS = {"chem": "chem_count", "units": "unit_convert"}  # role -> domain, as conf/modelset/quickstart.yaml
DTYPE = auto_dtype("cpu")  # what a mergeval run here computes in by default (both sides use it)


BIN = Path(sys.executable).parent  # mergekit-yaml and lm_eval live beside this interpreter (a venv's bin/)


def timed(cmd: list[str], log: Path, **kw) -> float:
    start = time.perf_counter()
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, **kw)
    return time.perf_counter() - start


def find_models(cache: Path) -> tuple[Path, dict[str, Path]]:
    """The quickstart base and experts inside a mergeval cache (built there first if missing)."""
    from omegaconf import OmegaConf

    from mergeval.models.fingerprint import fingerprint
    from mergeval.models.smollm2 import smollm2_dir
    from mergeval.models.zoo.experts import expert_dir
    from mergeval.run.config import TrainConfig

    base = smollm2_dir(cache, "--cache")
    base_fp = fingerprint(base, cache / "fingerprints.json")
    return base, {
        role: expert_dir(base, base_fp, domain, OmegaConf.structured(TrainConfig), cache, "--cache")
        for role, domain in EXPERTS.items()
    }


def mergekit_config(method: str, lam: float, base: Path, experts: dict[str, Path]) -> str:
    models = "\n".join(
        f"  - model: {p}\n    parameters: {{weight: 1.0{', density: 0.5' if method == 'ties' else ''}}}"
        for p in experts.values()
    )
    # TIES with normalize: true is the disjoint mean mergeval's ties computes; task arithmetic sums
    normalize = "true" if method == "ties" else "false"
    return (
        f"merge_method: {method}\nbase_model: {base}\nmodels:\n{models}\n"
        f"parameters:\n  lambda: {lam}\n  normalize: {normalize}\ndtype: float32\n"
    )


def lm_eval_cmd(model: Path, task_dir: Path, out: Path) -> list[str]:
    return [
        str(BIN / "lm_eval"),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model},dtype={DTYPE},softmax_dtype=float32",
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        str(task_dir),
        "--batch_size",
        "32",
        "--device",
        "cpu",
        "--output_path",
        str(out),
    ]


def run_mergeval(
    cache: Path, store: Path, lambdas: list[float], n_items: int, work: Path, log: Path, staged: bool = False
) -> tuple[float, Path]:
    """(seconds, the sweep directory: each job's result.json, or with ``staged`` the sweep's staged.json)."""
    sweep = work / f"multirun-{time.time_ns()}"
    cmd = [
        sys.executable,
        "-m",
        "mergeval",
        "-m",
        f"method={','.join(METHODS)}",
        f"method.lambda_={','.join(map(str, lambdas))}",
        f"cache_dir={cache}",
        f"store.path={store}",
        f"benchmark.n_items={n_items}",
        f"eval.dtype={DTYPE}",
        f"hydra.sweep.dir={sweep}",
    ]
    return timed(cmd + ["hydra/sweeper=staged"] * staged, log, cwd=work), sweep


def linked_cache(models_from: Path, at: Path) -> Path:
    """A fresh cache at ``at`` whose models and experts are links into ``models_from``: nothing evaluated or
    stored yet (cold), nothing trained again."""
    at.mkdir()
    for sub in ("models", "experts"):
        (at / sub).symlink_to(models_from.expanduser().resolve() / sub)
    return at


def merge_label(method: str, lam: float) -> str:
    return f"{method} lambda={float(lam):g}"


def mergeval_accuracies(sweep: Path) -> dict[tuple[str, str], tuple[str, float, int]]:
    """(model, task) -> (lm-eval metric, value, items) from a sweep's result.json files; the merge of each job is
    named by its method and lambda, the base and the experts by their roles."""
    out = {}
    for path in sorted(sweep.rglob("result.json")):
        result = json.loads(path.read_text())
        method = result["config"]["method"]
        for task, by_role in result["scores"].items():
            for role, score in by_role.items():
                model = merge_label(method["name"], method["lambda_"]) if role == "merged" else role
                out[model, task] = (
                    score.get("metric", "acc,none"),
                    score.get("value", score.get("acc")),
                    score.get("n"),
                )
    return out


def full_means(sweep: Path) -> dict[str, float]:
    """Each configuration's mean accuracy over the tasks of its merged model (labelled as ``merge_label``), from
    a full sweep's result.json files: what the staged sweep ranks its finalists by, computed by the same function
    (``math.fsum``), so equal accuracies in another task order are a tie here too."""
    from mergeval.staged.selection import mean_accuracy

    means = {}
    for path in sorted(sweep.rglob("result.json")):
        result = json.loads(path.read_text())
        method = result["config"]["method"]
        merged = {
            task: {"value": by_role["merged"].get("value", by_role["merged"].get("acc"))}
            for task, by_role in result["scores"].items()
        }
        means[merge_label(method["name"], method["lambda_"])] = mean_accuracy(merged)
    return means


def staged_pick(sweep: Path) -> str | None:
    """The staged sweep's pick (from its staged.json), labelled as ``merge_label``; None when it stopped early."""
    staged = json.loads((sweep / "staged.json").read_text())
    if staged["pick"] is None:
        return None
    [picked] = [c for c in staged["candidates"] if c["label"] == staged["pick"]]
    return merge_label(picked["method"], picked["config"]["lambda_"])


def pick_comparison(means: dict[str, float], order: list[str], pick: str | None) -> dict:
    """The full evaluation's best configuration (ties: the first in the sweep's order), whether the staged pick
    is it, and ``regret = best mean - the pick's mean`` (None without a pick). The staged sweep breaks a tie
    between finalists by their stage-2 rank, so a pick that ties the best is ``same_pick: false`` with regret 0:
    the regret is what a pick gives up."""
    best = max(order, key=lambda label: (means[label], -order.index(label)))
    return {
        "full_pick": best,
        "staged_pick": pick,
        "same_pick": pick == best,
        "regret": None if pick is None else round(means[best] - means[pick], 6),
    }


def lm_eval_accuracies(out_dir: Path, model: str) -> dict[tuple[str, str], dict[str, float]]:
    """(model, task) -> lm-eval's metrics for the one ``lm_eval`` run written under ``out_dir``."""
    [results] = sorted(out_dir.rglob("results_*.json"))
    return {(model, task): metrics for task, metrics in json.loads(results.read_text())["results"].items()}


def accuracy_mismatches(
    ours: dict[tuple[str, str], tuple[str, float, int]],
    theirs: dict[tuple[str, str], dict[str, float]],
    tolerance: float,
) -> list[str]:
    """One line per (model, task) whose accuracies differ by more than ``tolerance`` (a fraction of the items),
    that only one side scored, or whose metric the lm_eval side does not report."""
    lines = [f"{m} / {t}: only the lm_eval side scored it" for m, t in sorted(set(theirs) - set(ours))]
    for (model, task), (metric, value, n) in sorted(ours.items()):
        other = theirs.get((model, task))
        if other is None:
            lines.append(f"{model} / {task}: only mergeval scored it")
        elif metric not in other:
            lines.append(f"{model} / {task}: lm_eval reports no {metric}")
        elif abs(value - other[metric]) > tolerance + 1e-9:
            items = f" ({abs(value - other[metric]) * n:.0f} of {n} items)" if n else ""
            lines.append(
                f"{model} / {task}: {metric} {value:.4f} (mergeval) vs {other[metric]:.4f} (lm_eval), "
                f"differ by {abs(value - other[metric]):.4f}{items} > {tolerance:g}"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="a mergeval cache holding the quickstart experts")
    ap.add_argument("--n-items", type=int, default=200, help="items per task (the quickstart uses 200)")
    ap.add_argument("--lambdas", default="0.25,0.5,0.75,1.0")
    ap.add_argument("--out", type=Path, default=Path("sweep_cost.json"))
    ap.add_argument(
        "--constituents-once",
        action="store_true",
        help="the baseline evaluates the constituents with the first configuration only (the smart "
        "baseline, measured; the re-evaluating one is then not reported)",
    )
    ap.add_argument("--skip-staged", action="store_true", help="leave out mergeval's staged sweep")
    args = ap.parse_args()
    lambdas = [float(x) for x in args.lambdas.split(",")]
    base, experts = find_models(args.cache.expanduser())
    work = Path(tempfile.mkdtemp(prefix="sweep-cost-"))
    log = work / "log.txt"
    print(f"work dir and full log: {work}", flush=True)

    # A fresh cache that links the existing models: cold evaluation, no re-training.
    cache = linked_cache(args.cache, work / "cache")
    store = work / "results.sqlite"
    cold, cold_sweep = run_mergeval(cache, store, lambdas, args.n_items, work, log)
    print(f"mergeval cold sweep: {cold:.1f} s", flush=True)
    warm, _ = run_mergeval(cache, store, lambdas, args.n_items, work, log)
    print(f"mergeval warm rerun: {warm:.1f} s", flush=True)
    staged = None
    if not args.skip_staged:  # cold as well: its own cache and store, so nothing of (a) is reused
        staged_s, staged_sweep = run_mergeval(
            linked_cache(args.cache, work / "cache-staged"),
            work / "results-staged.sqlite",
            lambdas,
            args.n_items,
            work,
            log,
            staged=True,
        )
        order = [merge_label(m, lam) for m in METHODS for lam in lambdas]
        staged = {
            "staged_s": round(staged_s, 1),
            **pick_comparison(full_means(cold_sweep), order, staged_pick(staged_sweep)),
        }
        print(
            f"mergeval staged sweep: {staged_s:.1f} s, pick {staged['staged_pick']} "
            f"(full evaluation's best: {staged['full_pick']})",
            flush=True,
        )

    from mergeval.eval.tasks import write_tasks

    task_dir = write_tasks(TASKS, args.n_items, work / "baseline-tasks")
    constituents = {"base": base, **experts}
    rows, first_constituents, theirs = [], 0.0, {}
    for i, (method, lam) in enumerate((m, lam) for m in METHODS for lam in lambdas):
        cfg = work / f"{method}-{lam}.yaml"
        cfg.write_text(mergekit_config(method, lam, base, experts))
        out_dir = work / f"merged-{method}-{lam}"
        t_merge = timed([str(BIN / "mergekit-yaml"), str(cfg), str(out_dir), "--copy-tokenizer"], log)
        merged_out = work / "lm_eval_out" / f"{method}-{lam}"
        t_eval_merged = timed(lm_eval_cmd(out_dir, task_dir, merged_out), log)
        theirs.update(lm_eval_accuracies(merged_out, merge_label(method, lam)))
        t_constituents = 0.0
        for name, path in constituents.items() if i == 0 or not args.constituents_once else ():
            constituent_out = work / "lm_eval_out" / f"{name}-{i}"
            t_constituents += timed(lm_eval_cmd(path, task_dir, constituent_out), log)
            if i == 0:  # every configuration re-evaluates the same constituents; the first one is compared
                theirs.update(lm_eval_accuracies(constituent_out, name))
        if i == 0:
            first_constituents = t_constituents
        shutil.rmtree(out_dir)
        rows.append(
            {
                "method": method,
                "lambda": lam,
                "mergekit_s": round(t_merge, 1),
                "lm_eval_merged_s": round(t_eval_merged, 1),
                "lm_eval_constituents_s": round(t_constituents, 1),
            }
        )
        print(
            f"baseline {method} lambda={lam}: merge {t_merge:.1f} s, eval merged {t_eval_merged:.1f} s, "
            f"eval constituents {t_constituents:.1f} s",
            flush=True,
        )
    baseline_once = sum(r["mergekit_s"] + r["lm_eval_merged_s"] for r in rows) + first_constituents
    report = {
        "configurations": len(rows),
        "n_items_per_task": args.n_items,
        "tasks": TASKS,
        "cpu_count": os.cpu_count(),
        "mergeval_cold_s": round(cold, 1),
        "mergeval_warm_rerun_s": round(warm, 1),
        "baseline_constituents_once_s": round(baseline_once, 1),
        "speedup_cold_vs_constituents_once": round(baseline_once / cold, 2),
    }
    if not args.constituents_once:
        baseline = sum(r["mergekit_s"] + r["lm_eval_merged_s"] + r["lm_eval_constituents_s"] for r in rows)
        report.update(baseline_s=round(baseline, 1), speedup_cold=round(baseline / cold, 2))
    if staged is not None:
        report["staged"] = {**staged, "speedup_vs_constituents_once": round(baseline_once / staged["staged_s"], 2)}
    report["baseline_rows"] = rows
    tolerance = ACCURACY_TOLERANCE[DTYPE]
    mismatches = accuracy_mismatches(mergeval_accuracies(cold_sweep), theirs, tolerance)
    report["accuracy_tolerance"], report["accuracy_mismatches"] = tolerance, mismatches
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "baseline_rows"}, indent=2))
    if mismatches:
        print(
            f"sweep_cost: the two sides' accuracies differ beyond the scorer's {DTYPE} tolerance ({tolerance:g}), "
            "so the timings compare different computations:\n  " + "\n  ".join(mismatches),
            file=sys.stderr,
        )
        sys.exit(1)
    print(f"accuracies agree within {tolerance:g} on all {len(theirs)} (model, task) pairs")


if __name__ == "__main__":
    main()
