"""Where one model's evaluation spends its time, against the pure forward-pass floor for the same tokens.

One evaluation as a run does it (``Harness.score``: lm-eval builds the requests,
tokenizes, mergeval's shared-prefix scorer runs the forward passes, lm-eval
computes the metrics) of SmolLM2-135M-Instruct on the quickstart's three tasks,
in this machine's default precision (mergeval/core/precision.py), with the model's
``forward`` timed from the inside. Then the floor: the exact inputs the scorer
fed the model (captured during the evaluation: the same token ids, positions,
masks and batch shapes) replayed through the model alone, nothing else
running in the process. Reported, each as a share of the evaluation:

- forward passes inside the evaluation, and what their replay alone takes;
- the scorer's own work around them (packing rows, masks, log-softmax, picking the choices' tokens);
- everything else: lm-eval's request building, tokenization, metrics, Python;
- the replay's arithmetic rate (multiply-adds of every linear layer over the tokens fed, padding included)
  next to a large matrix product's on this machine, in the same precision and thread count: how close the
  forward passes are to what the cores can do.

Run with the machine otherwise idle; ``--repeats`` alternates evaluation and replay and reports medians.

    python benchmarks/eval_profile.py --cache ~/.cache/mergeval --n-items 200 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

TASKS = ["mergeval_chem_count", "mergeval_unit_convert", "mergeval_general_facts"]


def linear_macs(model, tokens: int, vocab_positions: int) -> int:
    """Multiply-adds of the linear layers: every decoder layer's at each token fed, the LM head's only at the
    positions whose vocabulary logits are computed (the scorer's ``logits_to_keep``)."""
    import torch

    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body * tokens + head.weight.numel() * vocab_positions


def matmul_rate(dtype, n: int = 2048, rounds: int = 5) -> float:
    """GFLOP/s of an n x n x n matrix product in ``dtype`` (best of ``rounds``): the cores' practical peak."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="a mergeval cache (the base model is converted there)")
    ap.add_argument("--n-items", type=int, default=200, help="items per task (the quickstart uses 200)")
    ap.add_argument("--batch-size", type=int, default=32, help="questions per forward pass (eval.batch_size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from mergeval.core.precision import auto_dtype
    from mergeval.eval.harness import Harness
    from mergeval.eval.scorer import SharedPrefixLM
    from mergeval.eval.suite import build_suite
    from mergeval.models.checkpoint import load_model
    from mergeval.models.smollm2 import smollm2_dir
    from mergeval.run.config import BenchmarkConfig, EvalConfig

    dtype = auto_dtype("cpu")
    base = smollm2_dir(args.cache, "modelset.base")
    bench = OmegaConf.merge(
        OmegaConf.structured(BenchmarkConfig), {"name": "quickstart", "tasks": TASKS, "n_items": args.n_items}
    )
    suite = build_suite(bench, OmegaConf.structured(EvalConfig), args.cache)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = load_model(base).to(getattr(torch, dtype)).eval()

    forward_s, captured, kept_positions, state = [0.0], [], [0], {"record": True}
    real_forward = model.forward

    @functools.wraps(real_forward)  # the scorer reads the signature (logits_to_keep) through __wrapped__
    def timed_forward(*a, **kw):
        start = time.perf_counter()
        out = real_forward(*a, **kw)
        forward_s[0] += time.perf_counter() - start
        if state["record"]:
            captured.append(kw)
            kept_positions[0] += kw["input_ids"].shape[0] * kw.get("logits_to_keep", kw["input_ids"].shape[1])
        return out

    model.forward = timed_forward
    rows, scorer_s = [], [0.0]
    real_score_rows = SharedPrefixLM._score_rows

    def timed_score_rows(self, chunk, requests):
        start = time.perf_counter()
        out = list(real_score_rows(self, chunk, requests))
        scorer_s[0] += time.perf_counter() - start
        return iter(out)

    SharedPrefixLM._score_rows = timed_score_rows
    harness = Harness(suite, suite.entries, args.batch_size, None)
    for repeat in range(args.repeats):
        state["record"] = repeat == 0
        forward_s[0] = scorer_s[0] = 0.0
        start = time.perf_counter()
        harness.score(model, tokenizer)
        total = time.perf_counter() - start
        inside = forward_s[0]
        with torch.no_grad():
            start = time.perf_counter()
            for kw in captured:
                real_forward(**kw)
            replay = time.perf_counter() - start
        rows.append(
            {"evaluation_s": total, "forward_in_evaluation_s": inside, "scorer_s": scorer_s[0], "replay_s": replay}
        )
        print(
            f"repeat {repeat}: evaluation {total:.2f} s, forward passes inside it {inside:.2f} s, "
            f"scorer around them {scorer_s[0] - inside:.2f} s, replay alone {replay:.2f} s",
            flush=True,
        )

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    tokens = sum(int(kw["input_ids"].numel()) for kw in captured)
    macs = linear_macs(model, tokens, kept_positions[0])
    rate = 2 * macs / med["replay_s"] / 1e9
    peak = matmul_rate(getattr(torch, dtype))
    report = {
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "n_items": args.n_items,
        "tasks": TASKS,
        "requests": sum(harness.requests.values()),
        "forward_calls": len(captured),
        "tokens_fed": tokens,
        "vocab_logit_positions": kept_positions[0],
        "medians_s": med,
        "shares": {
            "forward": med["forward_in_evaluation_s"] / med["evaluation_s"],
            "scorer_around_forward": (med["scorer_s"] - med["forward_in_evaluation_s"]) / med["evaluation_s"],
            "lm_eval_and_rest": (med["evaluation_s"] - med["scorer_s"]) / med["evaluation_s"],
        },
        "evaluation_over_floor": med["evaluation_s"] / med["replay_s"],
        "replay_gflops": rate,
        "matmul_gflops": peak,
        "repeats": rows,
    }
    s = report["shares"]
    print(
        f"\n{report['requests']} requests, {len(captured)} forward passes, {tokens} tokens fed, {dtype}, "
        f"{report['threads']} threads; medians of {args.repeats}:"
    )
    print(
        f"  evaluation {med['evaluation_s']:.2f} s = forward passes {s['forward']:.1%} + scorer around them "
        f"{s['scorer_around_forward']:.1%} + lm-eval and the rest {s['lm_eval_and_rest']:.1%}"
    )
    print(
        f"  the same forward passes replayed alone: {med['replay_s']:.2f} s (the floor); the evaluation takes "
        f"{report['evaluation_over_floor']:.2f}x the floor"
    )
    print(
        f"  replay: {rate:.1f} GFLOP/s of linear layers; a 2048^3 matrix product here: {peak:.1f} GFLOP/s "
        f"({rate / peak:.0%})"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
