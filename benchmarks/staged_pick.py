"""Staged vs full evaluation of one sweep: does the staged pick match, and at what share of the cost?

    python benchmarks/staged_pick.py                       # the quickstart sweep (8 candidates), real SmolLM2
    python benchmarks/staged_pick.py --smoke               # the same on the tiny zoo, in seconds
    python benchmarks/staged_pick.py --lambdas 0.25,0.5,0.75,1,1.25,1.5,1.75,2   # 16 candidates
    python benchmarks/staged_pick.py -- staged.stage3_keep=2 benchmark.n_items=100   # any Hydra override

Runs ``python -m mergeval.staged`` with ``staged.full=true``: the three stages,
then the full benchmark on every candidate. Costs are counted from the data
(forward passes = scored sequences; see mergeval/staged/cost.py), so they do
not depend on the machine; wall-clock seconds per phase are printed beside
them. By default the evaluations go to a fresh results store in a temporary
directory, so every phase really runs (constituents included); ``--store PATH``
reuses one. The models come from ``MERGEVAL_CACHE`` as usual. Writes the
summary as JSON with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

TARGET = 0.30  # the target: the same pick at no more than 30% of the evaluation cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny zoo (tiny_staged) instead of the quickstart")
    parser.add_argument("--lambdas", help="comma-separated lambda_ values for both methods of the grid")
    parser.add_argument("--store", help="results store to use (default: a fresh one in a temporary directory)")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    args = parser.parse_args(argv)

    from hydra import compose, initialize_config_module

    from mergeval.run.config import register_configs
    from mergeval.staged.pipeline import run_staged

    overrides = [f"+experiment={'tiny_staged' if args.smoke else 'quickstart_staged'}", "staged.full=true"]
    if args.lambdas:
        values = "[" + ",".join(str(float(v)) for v in args.lambdas.split(",")) + "]"
        overrides += [f"staged.grid.task_arithmetic.lambda_={values}", f"staged.grid.ties.lambda_={values}"]
    tmp = tempfile.TemporaryDirectory(prefix="staged-pick-")
    overrides.append(f"store.path={args.store or Path(tmp.name) / 'results.sqlite'}")
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides + args.overrides)

    start = time.perf_counter()
    out = run_staged(cfg)
    wall = time.perf_counter() - start
    t = out.timings
    staged_s = t.get("stage1", 0) + t.get("stages_2_3", 0)
    cost, cmp = out.cost, out.comparison
    frac = cost["staged"].forward_passes / cost["full"].forward_passes
    frac_examples = cost["staged"].examples / cost["full"].examples
    summary = {
        "sweep": cfg.modelset.name,
        "candidates": len(out.candidates),
        "items_per_task": out.n_full,
        "stage2_items": out.stage2_items,
        "stage1_keep": cfg.staged.stage1_keep,
        "stage3_keep": cfg.staged.stage3_keep,
        "staged_pick": out.pick,
        "full_pick": cmp["full_pick"],
        "same_pick": cmp["same_pick"],
        "regret": cmp["regret"],
        "early_stop": out.early_stop,
        "forward_passes": {k: v.forward_passes for k, v in cost.items()},
        "examples": {k: v.examples for k, v in cost.items()},
        "fraction_forward_passes": frac,
        "fraction_examples": frac_examples,
        "wall_s": {
            "staged_stages": round(staged_s, 1),
            "full_every_candidate": t.get("full"),
            "constituents": t.get("constituents"),
            "total": round(wall, 1),
        },
        "full_mean_acc": {c.label: c.mean("full") for c in out.candidates},
        "stage1_ratio": {c.label: c.degradation + 1 for c in out.candidates},
    }
    print(f"\nstaged vs full: {summary['sweep']}, {len(out.candidates)} candidates, {out.n_full} items per task")
    for c in out.candidates:
        mark = " <- staged pick" if c.label == out.pick else ""
        mark += " <- full pick" if c.label == cmp["full_pick"] else ""
        print(f"  {c.label:36s} PPL/experts {c.degradation + 1:9.3g}   full acc {c.mean('full'):.3f}{mark}")
    print(
        f"staged pick: {out.pick}   full pick: {cmp['full_pick']}   same pick: {'yes' if cmp['same_pick'] else 'NO'}"
        + ("" if cmp["regret"] is None else f"   regret {cmp['regret']:.3f} mean acc")
    )
    for stage in ("stage1", "stage2", "stage3", "staged", "full"):
        print(f"  {stage:7s} {cost[stage].forward_passes:8,d} forward passes  {cost[stage].examples:7,d} examples")
    print(
        f"cost of staged / full: {frac:.1%} of forward passes, {frac_examples:.1%} of examples "
        f"(target <= {TARGET:.0%}: {'met' if frac <= TARGET and cmp['same_pick'] else 'NOT met'})"
    )
    print(
        f"wall: staged stages {staged_s:.1f} s, full on every candidate {t.get('full', 0):.1f} s "
        f"(constituents {t.get('constituents', 0):.1f} s, total {wall:.1f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
