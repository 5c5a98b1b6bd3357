"""How fast and how exact mergeval's shared-prefix scorer is next to lm-eval's HFLM, side by side.

For each model of a mergeval cache's quickstart (the base and the two experts),
the quickstart's three generated tasks (4 choices per item) are scored as
lm-eval log-likelihood requests by:

- ``hflm``: lm-eval's HFLM (one sequence per choice), and
- ``shared_prefix``: mergeval/eval/scorer.py (each context once, logits only where choices are predicted),

in bfloat16 and float32 (``--dtypes``), alternating the backends
``--repeats`` times (median wall time). The reference is HFLM in float32 (in bfloat16 when float32 is not run):
for every backend and dtype we report the largest per-choice difference from
it and the share of items whose answer (argmax choice) it reproduces.

    python benchmarks/scoring_backends.py --cache ~/.cache/mergeval --n-items 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

TASKS = ["mergeval_chem_count", "mergeval_unit_convert", "mergeval_general_facts"]


def requests(task_dir: Path):
    from lm_eval.api.instance import Instance

    out = []
    for name in TASKS:
        for d, line in enumerate((task_dir / f"{name}.jsonl").read_text().splitlines()):
            item = json.loads(line)
            out += [
                Instance("loglikelihood", item, (item["prompt"], " " + c), j, (name, d, 1))
                for j, c in enumerate(item["choices"])
            ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="a mergeval cache holding the quickstart experts")
    ap.add_argument("--n-items", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("scoring_backends.json"))
    ap.add_argument(
        "--dtypes",
        nargs="+",
        choices=("bfloat16", "float32"),
        default=["bfloat16", "float32"],
        help="float32 alone on a CPU without bfloat16 kernels (AVX2 only), where bfloat16 is emulated",
    )
    ap.add_argument(
        "--hflm-softmax",
        choices=("model", "float32"),
        default="model",
        help="HFLM's log-softmax dtype: the model's (lm-eval's default, as the lm_eval command line runs) "
        "or float32 (as mergeval's scorer and benchmarks/sweep_cost.py take it)",
    )
    ap.add_argument(
        "--roles",
        nargs="+",
        choices=("base", "chem", "units"),
        default=["base", "chem", "units"],
        help="which quickstart models to score (the experts are built in the cache if missing)",
    )
    args = ap.parse_args()

    import numpy as np
    import torch
    from lm_eval.models.huggingface import HFLM
    from sweep_cost import find_models
    from transformers import AutoTokenizer

    from mergeval.eval.scorer import SharedPrefixLM
    from mergeval.eval.tasks import write_tasks
    from mergeval.models.checkpoint import load_model

    if set(args.roles) == {"base"}:  # no expert needed: do not build them
        from mergeval.models.smollm2 import smollm2_dir

        base, experts = smollm2_dir(args.cache.expanduser(), "--cache"), {}
    else:
        base, experts = find_models(args.cache.expanduser())
    task_dir = write_tasks(TASKS, args.n_items, args.cache.expanduser())
    reqs = requests(task_dir)
    tokenizer = AutoTokenizer.from_pretrained(base)
    backends = {"hflm": HFLM, "shared_prefix": SharedPrefixLM}
    report = {
        "n_items_per_task": args.n_items,
        "requests_per_model": len(reqs),
        "hflm_softmax": args.hflm_softmax,
        "models": {},
    }
    for role, path in {"base": base, **experts}.items():
        if role not in args.roles:
            continue
        lls, seconds = {}, {}
        for dtype in args.dtypes:
            model = load_model(path, None, getattr(torch, dtype))
            for _ in range(args.repeats):
                for name, cls in backends.items():
                    softmax = {"softmax_dtype": "float32"} if name == "hflm" and args.hflm_softmax == "float32" else {}
                    lm = cls(pretrained=model, tokenizer=tokenizer, batch_size=32, **softmax)
                    start = time.perf_counter()
                    got = lm.loglikelihood(reqs, disable_tqdm=True)
                    seconds.setdefault((name, dtype), []).append(time.perf_counter() - start)
                    lls[(name, dtype)] = np.array([ll for ll, _ in got]).reshape(-1, 4)
        ref = lls[("hflm", "float32" if "float32" in args.dtypes else "bfloat16")]
        rows = {}
        for (name, dtype), v in lls.items():
            rows[f"{name} {dtype}"] = {
                "median_s": round(statistics.median(seconds[(name, dtype)]), 2),
                "max_abs_diff_vs_hflm_reference": float(np.abs(v - ref).max()),
                "answers_equal_to_hflm_reference": float((v.argmax(1) == ref.argmax(1)).mean()),
                # the two backends in one dtype: per task, the items whose answers differ
                "answers_differing_from_hflm_same_dtype_per_task": [
                    int(d.sum()) for d in np.split(v.argmax(1) != lls[("hflm", dtype)].argmax(1), len(TASKS))
                ],
            }
        for dtype in args.dtypes:
            rows[f"speedup {dtype}"] = round(
                rows[f"hflm {dtype}"]["median_s"] / rows[f"shared_prefix {dtype}"]["median_s"], 2
            )
        report["models"][role] = rows
        print(role, json.dumps(rows, indent=1), flush=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
