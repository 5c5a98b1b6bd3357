"""Time the merge a run does: every tensor merged into the live model built from the base (``merge_into_model``).

``benchmarks/merge_throughput.py`` times the merge to disk against mergekit; this times the in-memory merge
that ``python -m mergeval`` evaluates, per method, and prints the merged model's fingerprint, so two checkouts
can be compared for speed and for the same bits::

    python benchmarks/live_merge.py --base <base dir> --experts <dir> <dir> ... \\
        --method ties:density=0.3,lambda_=0.4 della:density=0.6,epsilon=0.05 --repeats 3

Each METHOD is ``name[:field=value,...]`` (the fields of ``conf/method/<name>.yaml``). Methods that need
statistics measured before merging (localize_stitch with scope=model, fisher, regmean) are not timed here.
The peak RSS is the process's (the base model loaded once per repeat included): time one method per process
to compare memory.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path


def parse_method(text: str) -> tuple[str, dict]:
    """ "ties:density=0.3,lambda_=0.4" -> ("ties", {"density": 0.3, "lambda_": 0.4})."""
    import yaml

    name, _, fields = text.partition(":")
    params = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        params[key] = yaml.safe_load(value)
    return name, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="base checkpoint directory")
    parser.add_argument("--experts", nargs="+", required=True, help="expert checkpoint directories")
    parser.add_argument("--method", nargs="+", required=True, help="name[:field=value,...] per method")
    parser.add_argument("--repeats", type=int, default=3, help="timed merges per method (default 3)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads of the main thread (the merge's workers use one each; default: torch's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from mergeval.merge.memory import merge_into_model
    from mergeval.methods import get_method
    from mergeval.models.checkpoint import load_model
    from mergeval.models.fingerprint import fingerprint_state_dict

    if args.threads:
        torch.set_num_threads(args.threads)
    base = Path(args.base)
    experts = {Path(p).name: Path(p) for p in args.experts}
    print(f"base {base}; {len(experts)} experts; torch threads {torch.get_num_threads()}")
    for text in args.method:
        name, params = parse_method(text)
        method = get_method(name)
        cfg = method.config(**params)
        times, digest = [], None
        for _ in range(args.repeats):
            model = load_model(base)
            began = time.perf_counter()
            merge_into_model(model, method, cfg, base, experts, seed=args.seed)
            times.append(time.perf_counter() - began)
            digest = fingerprint_state_dict(model.state_dict())
            del model
        print(
            f"{text}: median {statistics.median(times):.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}); "
            f"merged state dict fingerprint {digest}; process peak RSS so far "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
        )


if __name__ == "__main__":
    main()
