"""Mutation check: does the test suite catch small, plausible bugs in the code that computes numbers?

Copies the checkout's code, configs, specs and tests into a temporary directory,
plants ONE known bug at a time (a file, a snippet of it, its replacement),
runs the tests relevant to that code there and reports each
mutant as killed (some test failed) or survived (every test passed), with the
score killed / total. Bugs cover metrics, merge methods, spec verification
and a run's aggregation; the first five are the ones issue 20 found uncaught.

    python benchmarks/mutants.py                 # every mutant (a few minutes on 2 cores)
    python benchmarks/mutants.py --only ties_ --only agrees_   # names containing these
    python benchmarks/mutants.py --list

Why a copy and not the checkout: the bug must never touch the working tree, and
the tests must import the *copy's* ``mergeval``. The installed package is an
editable install pointing at the checkout, so the copy is put first on
PYTHONPATH and pytest runs from the copy's root; before any mutant the script
checks that ``import mergeval`` resolves into the copy, and plants a canary
(an import that fails) to prove that pytest's tests see the copy too.

A snippet is found by its Python tokens, so reformatting (quotes, line
wrapping, trailing commas, added parentheses, comments) does not lose it: see
"locating a snippet by its tokens" below. A snippet that no longer matches
exactly once in its file is an error, not a skipped mutant: the list must be
updated with the code. Exit status: 0 when every mutant is killed, 1 when one
survives, 2 on an error (a stale snippet, a failing unmutated baseline, a copy
that is not the one imported).
"""

from __future__ import annotations

import argparse
import ast
import functools
import io
import keyword
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the tests need: the package (its conf and specs/library are symlinks to ../conf and ../specs), the
# tests and their conftest, the benchmarks and docs some tests read, and the project metadata pytest reads.
COPIED = ("mergeval", "conf", "specs", "tests", "benchmarks", "docs", "pyproject.toml", "README.md")
PYTEST = ("-q", "-x", "-p", "no:cacheprovider")

# The merge methods' tests, one file per module of mergeval/methods (test_registry.py: every method at once).
METHODS = (
    "tests/methods/test_task_vector.py",
    "tests/methods/test_sparsify.py",
    "tests/methods/test_geometric.py",
    "tests/methods/test_registry.py",
)
SPARSE = (
    "tests/methods/test_sparsify.py",
    "tests/methods/test_task_vector.py",
    "tests/methods/test_geometric.py",
    "tests/methods/test_registry.py",
)
# The metric functions' tests, one file per module of mergeval/metrics.
METRICS = (
    "tests/metrics/test_aggregates.py",
    "tests/metrics/test_calibration.py",
    "tests/metrics/test_groups.py",
    "tests/metrics/test_perplexity.py",
    "tests/metrics/test_similarity.py",
    "tests/metrics/test_tradeoff.py",
    "tests/metrics/test_uncertainty.py",
)
VERIFY = ("tests/verify/test_verify.py", "tests/verify/test_spec_language.py", "tests/verify/test_verify_exact.py")
PAIRED = ("tests/metrics/test_paired.py", "tests/verify/test_paired_claims.py")
HIERARCHICAL = ("tests/methods/test_hierarchical.py",)
CURRICULUM = ("tests/methods/test_curriculum_pipeline.py",)
AGGREGATION = (
    "tests/run/test_aggregation.py",
    "tests/run/test_cli_methods.py::test_every_aggregate_recomputes_from_the_result_files_scores",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    before: str  # must match exactly once in the file, token by token (below)
    after: str  # written at before's indentation
    tests: tuple[str, ...]  # pytest arguments: files or node ids
    bug: str  # the bug in words


MUTANTS = [
    # ------------------------------------------------ the five issue 20 found uncaught
    Mutant(
        "summary_base_is_a_constituent",
        "mergeval/run/summary.py",
        'experts = [r for r in roles if r not in ("base", MERGED)]',
        "experts = [r for r in roles if r != MERGED]",
        AGGREGATION,
        "the base counted as a constituent in the run's Macro-Gain/OG",
    ),
    Mutant(
        "hierarchical_cos_squared",
        "mergeval/methods/hierarchical.py",
        "return t_max * max(0.0, dot / (na * nb))",
        "return t_max * max(0.0, dot / (na * nb)) ** 2",
        HIERARCHICAL,
        "the layer weight cos replaced by cos^2",
    ),
    Mutant(
        "verify_discrepancy_tolerance_doubled",
        "mergeval/verify/tables.py",
        "allowed = (p_hi - p_lo) / 2 + (hi - lo) / 2 + record.by.half_width",
        "allowed = 2 * ((p_hi - p_lo) / 2 + (hi - lo) / 2 + record.by.half_width)",
        VERIFY,
        "verify's tolerance on a recorded discrepancy doubled",
    ),
    Mutant(
        "ties_elects_on_untrimmed_deltas",
        "mergeval/methods/task_vector.py",
        "    return (b + cfg.lambda_ * disjoint_merge(torch.stack(trimmed), cfg)).to(base.dtype)\n",
        "    sparse, untrimmed = torch.stack(trimmed), torch.stack([e.float() - b for e in experts])\n"
        "    wt = torch.tensor(expert_weights(cfg, len(experts))).view(-1, *([1] * b.dim()))\n"
        "    voters = untrimmed * wt if compat.option(cfg, 'weights_before_election', False, True) else untrimmed\n"
        "    voters = voters if cfg.sign_rule == 'sum' else torch.sign(voters)\n"
        "    gamma = torch.sign(voters.sum(0))\n"
        "    agree = (torch.sign(sparse) == gamma) & (sparse != 0)\n"
        "    mass = (wt * agree).sum(0)\n"
        "    tau = (wt * sparse * agree).sum(0) / mass.where(mass != 0, torch.ones_like(mass))\n"
        "    return (b + cfg.lambda_ * tau).to(base.dtype)\n",
        METHODS,
        "TIES elects the sign on the untrimmed deltas",
    ),
    Mutant(
        "agrees_drops_upper_half_width",
        "mergeval/verify/tables.py",
        "ok = meets((p_lo, p_hi), (lo, hi))",
        "ok = meets((printed.value, p_hi), (lo, hi))",
        VERIFY,
        "agrees drops the printed value's half-width on the upper side",
    ),
    # ------------------------------------------------ metrics
    Mutant(
        "normalized_denominator_expert_only",
        "mergeval/metrics/aggregates.py",
        "denom = expert - base",
        "denom = expert",
        METRICS,
        "normalized score divided by the expert's score instead of expert - base",
    ),
    Mutant(
        "macro_og_min_constituent",
        "mergeval/metrics/aggregates.py",
        "return factor * (avg_m - max(avgs))",
        "return factor * (avg_m - min(avgs))",
        METRICS,
        "Macro-OG against the weakest constituent",
    ),
    Mutant(
        "band_good_at_0_8",
        "mergeval/metrics/aggregates.py",
        "if x > 0.8:",
        "if x >= 0.8:",
        METRICS + ("tests/run/test_first_hour.py::test_a_score_shown_as_the_band_edge_gets_that_band",),
        "band: 0.8 counted as good",
    ),
    Mutant(
        "accuracy_stderr_divides_by_n",
        "mergeval/metrics/aggregates.py",
        "acc * (1.0 - acc) / (n - 1)",
        "acc * (1.0 - acc) / n",
        METRICS,
        "accuracy stderr with ddof=0",
    ),
    Mutant(
        "mean_normalized_counts_undefined_as_zero",
        "mergeval/metrics/aggregates.py",
        "defined = [v for v in values if v is not None]",
        "defined = [0.0 if v is None else v for v in values]",
        METRICS,
        "undefined normalized scores averaged in as 0",
    ),
    Mutant(
        "forgetting_sign",
        "mergeval/metrics/groups.py",
        "per_task[t] = b - m",
        "per_task[t] = m - b",
        METRICS + ("tests/metrics/test_composed.py",),
        "forgetting with the wrong sign",
    ),
    Mutant(
        "group_mean_tasks_weighting_is_mean_of_groups",
        "mergeval/metrics/groups.py",
        "return math.fsum(rescaled_all) / len(rescaled_all)",
        "return math.fsum(sums[g] / len(groups[g]) for g in groups) / len(groups)",
        METRICS + ("tests/metrics/test_composed.py",),
        "weighting=tasks as the plain mean of group means",
    ),
    Mutant(
        "group_mean_given_sums_groups",
        "mergeval/metrics/groups.py",
        "math.fsum(w[g] * sums[g] / len(groups[g]) for g in groups) / total",
        "math.fsum(w[g] * sums[g] for g in groups) / total",
        METRICS + ("tests/metrics/test_composed.py",),
        "weighted group mean of group sums, not means",
    ),
    Mutant(
        "ece_unweighted_bins",
        "mergeval/metrics/calibration.py",
        "ece += mask.sum() / conf.size * abs(corr[mask].mean() - conf[mask].mean())",
        "ece += abs(corr[mask].mean() - conf[mask].mean()) / len(np.unique(bins))",
        METRICS,
        "ECE averages bins equally instead of by their size",
    ),
    Mutant(
        "mean_ci_one_sided_z",
        "mergeval/metrics/uncertainty.py",
        "return NormalDist().inv_cdf((1.0 + level) / 2.0)",
        "return NormalDist().inv_cdf(level)",
        METRICS,
        "a one-sided quantile for a two-sided interval",
    ),
    Mutant(
        "wilson_center",
        "mergeval/metrics/uncertainty.py",
        "center = (p + z * z / (2 * n)) / denom",
        "center = (p + z * z / n) / denom",
        METRICS,
        "Wilson interval's centre with z^2/n instead of z^2/(2n)",
    ),
    Mutant(
        "bootstrap_stderr_ddof0",
        "mergeval/metrics/uncertainty.py",
        "np.std(stats, ddof=1)",
        "np.std(stats)",
        METRICS,
        "bootstrap stderr with ddof=0",
    ),
    Mutant(
        "pareto_keeps_equal_y_behind",
        "mergeval/metrics/tradeoff.py",
        "if top_y > best_y and",
        "if top_y >= best_y and",
        METRICS,
        "Pareto front keeps a point dominated by one with the same y and a larger x",
    ),
    Mutant(
        "synergy_normal_flipped",
        "mergeval/metrics/tradeoff.py",
        "nx, ny = dy, -dx",
        "nx, ny = -dy, dx",
        METRICS,
        "synergy area measured below the diagonal",
    ),
    Mutant(
        "sign_conflict_counts_zeros",
        "mergeval/metrics/similarity.py",
        '"conflicts": float((sa * sb < 0).sum())',
        '"conflicts": float((sa * sb <= 0).sum())',
        METRICS,
        "an entry zero in one task vector counted as a sign conflict",
    ),
    Mutant(
        "sar_rank_eps_not_squared",
        "mergeval/metrics/similarity.py",
        "(tails > eps * eps * tails[0])",
        "(tails > eps * tails[0])",
        METRICS,
        "SAR rank keeps all but eps (not eps^2) of the energy",
    ),
    Mutant(
        "perplexity_mean_of_text_means",
        "mergeval/metrics/perplexity.py",
        "values = [float(v) for text in nlls for v in text]",
        "values = [math.fsum(map(float, text)) / len(text) for text in nlls if len(text)]",
        (
            "tests/staged/test_staged.py::test_perplexity_weights_tokens_not_texts",
            "tests/staged/test_staged.py::test_perplexity_is_exp_of_the_token_mean",
            "tests/metrics/test_perplexity.py",
        ),
        "perplexity averages texts, not tokens",
    ),
    # ------------------------------------------------ merge methods
    Mutant(
        "kept_count_floor",
        "mergeval/methods/task_vector.py",
        "return max(1, math.ceil(round(density * n, 9)))",
        "return max(1, int(density * n))",
        METHODS,
        "TIES keeps floor(density n) entries, one fewer at a fractional count",
    ),
    Mutant(
        "linear_divides_by_count",
        "mergeval/methods/task_vector.py",
        "total = total / sum(w)",
        "total = total / len(w)",
        METHODS,
        "weighted linear merge divided by the number of models, not the weights' sum",
    ),
    Mutant(
        "ties_mean_by_count_not_weight",
        "mergeval/methods/task_vector.py",
        "mass = sum_in_order(agree if unit else wt * agree) if normalize else None",
        "mass = sum_in_order(agree) if normalize else None",
        METHODS,
        "TIES' disjoint mean divides by the number of agreeing experts, not their weights",
    ),
    Mutant(
        "dare_no_rescale",
        "mergeval/methods/sparsify.py",
        'return kept if rescale == "none" else kept / keep_prob',
        "return kept",
        SPARSE,
        "DARE and DELLA forget to rescale the kept entries",
    ),
    Mutant(
        "breadcrumbs_outliers_rounded_up",
        "mergeval/methods/sparsify.py",
        "n_top = int(gamma * delta.numel() + 1e-9)",
        "n_top = math.ceil(gamma * delta.numel())",
        SPARSE,
        "Breadcrumbs drops ceil(gamma n) outliers instead of floor",
    ),
    Mutant(
        "della_half_span",
        "mergeval/methods/sparsify.py",
        "by_rank.mul_(2.0 * epsilon).add_(density - epsilon)",
        "by_rank.mul_(epsilon).add_(density - epsilon)",
        SPARSE,
        "DELLA's keep probabilities span half the interval",
    ),
    Mutant(
        "della_rescale_by_density",
        "mergeval/methods/sparsify.py",
        "return torch.div(delta, p).masked_fill_(dropped, 0.0)",
        "return torch.div(delta, density).masked_fill_(dropped, 0.0)",
        SPARSE,
        "DELLA rescales by the mean keep probability, not each entry's",
    ),
    Mutant(
        "disjoint_mean_ignores_weights_before_election",
        "mergeval/methods/task_vector.py",
        'voters = weighted if compat.option(cfg, "weights_before_election", False, True) else sparse',
        "voters = sparse",
        METHODS,
        "the TIES variants ignore weights_before_election",
    ),
    Mutant(
        "sce_energy_mean_abs",
        "mergeval/methods/sparsify.py",
        "energy = [float(d.double().square().mean()) for d in deltas]",
        "energy = [float(d.double().abs().mean()) for d in deltas]",
        SPARSE,
        "SCE weights by mean |delta| instead of mean square",
    ),
    Mutant(
        "slerp_endpoints_swapped",
        "mergeval/methods/geometric.py",
        "return (s0 * v0 + s1 * v1).to(base.dtype)",
        "return (s1 * v0 + s0 * v1).to(base.dtype)",
        METHODS,
        "slerp's coefficients swapped between base and expert",
    ),
    Mutant(
        "model_stock_t_denominator",
        "mergeval/methods/geometric.py",
        "t = (n * cos / (1.0 + (n - 1) * cos))",
        "t = (n * cos / (1.0 + n * cos))",
        METHODS,
        "Model Stock's t with (1 + N cos) in the denominator",
    ),
    Mutant(
        "hierarchical_tensor_anchor_swapped",
        "mergeval/methods/hierarchical.py",
        "return _lerp(a, b, cosine_weight(",
        "return _lerp(b, a, cosine_weight(",
        HIERARCHICAL,
        "non-layer tensors interpolate from B, not the anchor A",
    ),
    Mutant(
        "cmm_linear_schedule_off_by_one",
        "mergeval/methods/curriculum.py",
        "us = [k / (n - 1) if n > 1 else 0.0 for k in range(n)]",
        "us = [k / n for k in range(n)]",
        CURRICULUM,
        "CMM's linear schedule never reaches its end",
    ),
    Mutant(
        "cmm_reverse_breaks_ties_backwards",
        "mergeval/methods/curriculum.py",
        'return ranked if order == "ranked" else sorted(range(n), key=lambda i: (-scores[i], i))',
        'return ranked if order == "ranked" else ranked[::-1]',
        CURRICULUM,
        "reverse order flips tied experts too",
    ),
    Mutant(
        "pipeline_stage_uses_modelset_base",
        "mergeval/methods/pipeline.py",
        "out = method.merge(values[stage.base],",
        "out = method.merge(base,",
        CURRICULUM,
        "a pipeline stage ignores its own base",
    ),
    # ------------------------------------------------ spec verification
    Mutant(
        "printed_full_unit",
        "mergeval/verify/numbers.py",
        "h = 0.0 if printed.exact else 0.5 * 10.0 **",
        "h = 0.0 if printed.exact else 10.0 **",
        VERIFY,
        "a printed number's uncertainty is a whole last digit",
    ),
    Mutant(
        "compare_se_added_linearly",
        "mergeval/verify/claims.py",
        "    return math.hypot(left.stderr, right.stderr)",
        "    return left.stderr + right.stderr",
        VERIFY,
        "a claim's standard errors added, not in quadrature (operands without per-item outcomes)",
    ),
    Mutant(
        "compare_strict_as_non_strict",
        "mergeval/verify/claims.py",
        'status = "pass" if d_lo > need else "fail" if d_hi <= need else "undetermined"',
        'status = "pass" if d_lo >= need else "fail" if d_hi < need else "undetermined"',
        VERIFY,
        "a strict inequality passes at equality",
    ),
    Mutant(
        "compare_tolerance_sign",
        "mergeval/verify/claims.py",
        "need = stderr_margin * se - tolerance",
        "need = stderr_margin * se + tolerance",
        VERIFY,
        "a claim's tolerance makes it stricter instead of lenient",
    ),
    Mutant(
        "over_runs_std_population",
        "mergeval/verify/claims.py",
        "return Measured(statistics.stdev(values))",
        "return Measured(statistics.pstdev(values))",
        VERIFY,
        "std over runs with ddof=0",
    ),
    Mutant(
        "run_score_drops_stderr",
        "mergeval/verify/runs.py",
        'stderr = float(s.get("stderr") or 0.0)',
        "stderr = 0.0",
        VERIFY,
        "a run's score loses its stderr",
    ),
    Mutant(
        "forgetting_stderr_sqrt_t",
        "mergeval/verify/runs.py",
        "form = total([base[t].run_form - other[t].run_form for t in base]) * (scale / len(base))",
        "form = total([base[t].run_form - other[t].run_form for t in base]) * (scale / math.sqrt(len(base)))",
        VERIFY,
        "the forgetting metric's stderr divided by sqrt(T), not T",
    ),
    Mutant(
        "forgetting_default_counts_expert_tasks",
        "mergeval/verify/runs.py",
        'tasks = self.body.get("tasks") or [t for t in run.scores if t not in own]',
        'tasks = self.body.get("tasks") or list(run.scores)',
        VERIFY,
        "forgetting by default also averages the experts' own tasks",
    ),
    Mutant(
        "group_metric_stderr_linear",
        "mergeval/metrics/paired.py",
        "    return math.sqrt(math.fsum(var))",
        "    return math.fsum(math.sqrt(v) for v in var)",
        VERIFY + PAIRED,
        "the stderrs of independent tasks summed linearly, not in quadrature",
    ),
    Mutant(
        "paired_se_not_over_n",
        "mergeval/metrics/paired.py",
        "var.append(sample_variance(z) / len(z))",
        "var.append(sample_variance(z))",
        PAIRED,
        "a paired variance not divided by the items",
    ),
    Mutant(
        "paired_variance_population",
        "mergeval/metrics/paired.py",
        "for v in values) / (n - 1)",
        "for v in values) / n",
        PAIRED,
        "the per-item variance with n, not n - 1 as lm-eval's stderr",
    ),
    Mutant(
        "paired_se_ignores_pairing",
        "mergeval/metrics/paired.py",
        "            same = [(o, c) for o, c in items if o.ids == ids]",
        "            same = [(o, c) for o, c in items if o.ids == ids][:1]",
        PAIRED,
        "only one model's items combined per task: the others taken as independent",
    ),
    Mutant(
        "untestable_ignores_preconditions",
        "mergeval/verify/claims.py",
        "        if not related or failing:",
        "        if not related:",
        PAIRED,
        "a finding whose precondition fails is judged as if it held",
    ),
    Mutant(
        "normalized_mean_base_expert_swapped",
        "mergeval/verify/formulas.py",
        "normalized_score(xs[i], xs[n + i], xs[2 * n + i])",
        "normalized_score(xs[i], xs[2 * n + i], xs[n + i])",
        VERIFY,
        "a derived normalized mean takes the expert as the base",
    ),
    Mutant(
        "strict_ignores_not_run",
        "mergeval/verify/__main__.py",
        'unsure = any(not c.ok for c in checks) or any(r.status != "pass" for r in results)',
        "unsure = any(not c.ok for c in checks)",
        VERIFY,
        "--strict lets claims that did not run (or were undetermined) pass",
    ),
    # ------------------------------------------------ a second batch, written before any test aimed at it
    Mutant(
        "wilson_half_width_4n",
        "mergeval/metrics/uncertainty.py",
        "z * z / (4 * n * n)",
        "z * z / (4 * n)",
        METRICS,
        "Wilson half-width with z^2/(4n) under the root",
    ),
    Mutant(
        "bootstrap_ci_one_sided_levels",
        "mergeval/metrics/uncertainty.py",
        "[(1.0 - level) / 2.0, (1.0 + level) / 2.0]",
        "[1.0 - level, level]",
        METRICS,
        "bootstrap interval from one-sided quantiles",
    ),
    Mutant(
        "ece_confidence_not_normalized",
        "mergeval/metrics/calibration.py",
        "confidences.append(1.0 / math.fsum(np.exp(ll - ll[pred])))",
        "confidences.append(min(1.0, float(np.exp(ll[pred]))))",
        METRICS,
        "ECE takes the raw choice probability, not the softmax over the choices",
    ),
    Mutant(
        "both_correct_ignores_gold",
        "mergeval/metrics/calibration.py",
        "sum(p == q == g for p, q, g in",
        "sum(p == q for p, q, g in",
        METRICS + ("tests/metrics/test_consistency.py",),
        "both-correct counts agreeing answers, right or wrong",
    ),
    Mutant(
        "sign_conflict_nonzero_over_all",
        "mergeval/metrics/similarity.py",
        '"sign_conflict_nonzero": sums["conflicts"] / both if both else None',
        '"sign_conflict_nonzero": sums["conflicts"] / sums["numel"] if both else None',
        METRICS,
        "sign conflicts among non-zero entries divided by all entries",
    ),
    Mutant(
        "perplexity_ratio_inverted",
        "mergeval/metrics/perplexity.py",
        "math.log(candidate[t] / reference[t])",
        "math.log(reference[t] / candidate[t])",
        (
            "tests/staged/test_staged.py::test_the_reference_shifts_every_stage1_key_alike",
            "tests/metrics/test_perplexity.py",
        ),
        "the stage-1 key's log ratio inverted",
    ),
    Mutant(
        "synergy_no_expert_endpoint",
        "mergeval/metrics/tradeoff.py",
        "knots.setdefault(0.0, 0.0)",
        "pass",
        METRICS,
        "the synergy frontier does not start at expert 1",
    ),
    Mutant(
        "band_without_rounding",
        "mergeval/metrics/aggregates.py",
        "x = round(normalized, 9)",
        "x = normalized",
        METRICS + ("tests/run/test_first_hour.py::test_a_score_shown_as_the_band_edge_gets_that_band",),
        "a mean a rounding error below 0.5 is failing",
    ),
    Mutant(
        "task_arithmetic_in_input_dtype",
        "mergeval/methods/task_vector.py",
        "delta = weighted_sum((torch.sub(e.float(), b, out=term) for e in experts), w, b)",
        "delta = weighted_sum(((e - base).float() for e in experts), w, b)",
        METHODS,
        "task arithmetic in the checkpoint's dtype (bf16), not float32",
    ),
    Mutant(
        "trim_by_signed_value",
        "mergeval/methods/task_vector.py",
        "keep = first_k_mask(flat.abs(), k)",
        "keep = first_k_mask(flat, k)",
        METHODS,
        "TIES keeps the largest values, not the largest magnitudes",
    ),
    Mutant(
        "l1_rescale_inverted",
        "mergeval/methods/compat.py",
        "    return before / after",
        "    return after / before",
        SPARSE,
        "L1 rescale by the inverse ratio",
    ),
    Mutant(
        "della_rank_over_n",
        "mergeval/methods/sparsify.py",
        "by_rank = torch.arange(n, dtype=torch.float32, device=delta.device).div_(n - 1)",
        "by_rank = torch.arange(n, dtype=torch.float32, device=delta.device).div_(n)",
        SPARSE,
        "DELLA's largest entry never reaches density + epsilon",
    ),
    Mutant(
        "della_radix_ties_reversed",
        "mergeval/methods/fused_kernels.py",
        "    for p in range(n):\n        k = x[p] & mag\n        d = k",
        "    for p in range(n - 1, -1, -1):\n        k = x[p] & mag\n        d = k",
        ("tests/methods/test_fused.py",) + SPARSE,
        "DELLA's compiled ranks order tied magnitudes last position first",
    ),
    Mutant(
        "della_radix_rows_by_rank",
        "mergeval/methods/fused_kernels.py",
        "        i = p // row_len",
        "        i = j // row_len",
        ("tests/methods/test_fused.py",) + SPARSE,
        "DELLA's compiled ranks assign rows by sorted position, not entry",
    ),
    Mutant(
        "threefry_kernel_rotation",
        "mergeval/methods/fused_kernels.py",
        "x0, x1 = _round(x0, x1, U32(29))",
        "x0, x1 = _round(x0, x1, U32(28))",
        ("tests/methods/test_fused.py",),
        "the compiled draws rotate by a wrong constant in one of Threefry's rounds",
    ),
    Mutant(
        "threefry_key_injection_count",
        "mergeval/methods/draws.py",
        "x1.add_(ks[(s + 1) % 3] + s).bitwise_and_(MASK)",
        "x1.add_(ks[(s + 1) % 3]).bitwise_and_(MASK)",
        ("tests/methods/test_draws.py",),
        "Threefry's key injection leaves out the injection count",
    ),
    Mutant(
        "dare_block_draws_at_offset_zero",
        "mergeval/methods/rows.py",
        "keep_only_(d, self.gen.keep(i, d.shape, density, start=offset, device=d.device))",
        "keep_only_(d, self.gen.keep(i, d.shape, density, start=0, device=d.device))",
        ("tests/merge/test_rows.py",),
        "DARE's row blocks draw the first entries' uniforms instead of their own",
    ),
    Mutant(
        "sce_keeps_lowest_variance",
        "mergeval/methods/sparsify.py",
        "variance = ordered.var(0, unbiased=False).flatten()\n",
        "variance = ordered.var(0, unbiased=False).flatten()\nvariance = variance.max() - variance\n",
        SPARSE,
        "SCE selects the entries of least variance",
    ),
    Mutant(
        "slerp_antiparallel_not_lerped",
        "mergeval/methods/geometric.py",
        "if abs(cos) > COLINEAR_COS:\n    return ((1.0 - t) * v0 + t * v1)",
        "if cos > COLINEAR_COS:\n    return ((1.0 - t) * v0 + t * v1)",
        METHODS,
        "slerp of nearly opposite tensors divides by sin(theta) ~ 0",
    ),
    Mutant(
        "model_stock_negative_cos",
        "mergeval/methods/geometric.py",
        "cos = torch.stack(cosines).mean(0).clamp(0.0, 1.0)",
        "cos = torch.stack(cosines).mean(0).clamp(-1.0, 1.0)",
        METHODS,
        "Model Stock's t leaves [0, 1] for opposed task vectors",
    ),
    Mutant(
        "cmm_interpolates_from_the_base",
        "mergeval/methods/curriculum.py",
        "theta.mul_(1 - c).add_(torch.mul(e, c, out=step))",
        "theta.add_(torch.sub(e, b, out=step).mul_(c))",
        CURRICULUM,
        "CMM's interpolate step takes the task vector against the base (additive)",
    ),
    Mutant(
        "cmm_ignores_lambda",
        "mergeval/methods/curriculum.py",
        "return theta.sub_(b).mul_(cfg.lambda_).add_(b).to(base.dtype)",
        "return theta.to(base.dtype)",
        CURRICULUM,
        "CMM ignores lambda",
    ),
    Mutant(
        "claim_equality_passes_when_possible",
        "mergeval/verify/claims.py",
        'status = "pass" if far <= allowed + slack else',
        'status = "pass" if near <= allowed + slack else',
        VERIFY,
        "== passes when rounding merely allows equality",
    ),
    Mutant(
        "range_over_one_run",
        "mergeval/verify/claims.py",
        'need = 2 if op.over_runs in ("range", "std") else 1',
        "need = 1",
        VERIFY,
        "range/std over a single run (always 0)",
    ),
    Mutant(
        "derived_macro_counts_merged",
        "mergeval/verify/formulas.py",
        "return metric(cut[0], cut[1:], scale=scale)",
        "return metric(cut[0], cut, scale=scale)",
        VERIFY,
        "a derived Macro-Gain counts the merged row as a constituent",
    ),
    Mutant(
        "interval_ignores_upper_bound",
        "mergeval/verify/numbers.py",
        "lo, hi = max(lo, bounds[0]), min(hi, bounds[1])",
        "lo, hi = max(lo, bounds[0]), hi",
        VERIFY,
        "a column's range clips only the lower end",
    ),
    Mutant(
        "corner_range_lower_corners_only",
        "mergeval/verify/numbers.py",
        "for ends in itertools.product((0, 1), repeat=len(free)):",
        "for ends in itertools.product((0,), repeat=len(free)):",
        VERIFY,
        "the derived range evaluated at the lower corner only",
    ),
    Mutant(
        "checkable_window_ignores_printed",
        "mergeval/verify/tables.py",
        "window = (hi - lo) + (p_hi - p_lo)",
        "window = hi - lo",
        VERIFY,
        "'not checkable' ignores the printed value's own rounding",
    ),
    Mutant(
        "aggregable_any_to_all",
        "mergeval/run/summary.py",
        'elif any(not 0.0 <= s["value"] <= 1.0',
        'elif all(not 0.0 <= s["value"] <= 1.0',
        AGGREGATION,
        "a task is left out only when every model is out of range",
    ),
    Mutant(
        "forgetting_of_merge_swapped",
        "mergeval/metrics/composed.py",
        'return forgetting({t: scores[t]["base"]["value"] for t in tasks}, {t: scores[t][merged]["value"]',
        'return forgetting({t: scores[t][merged]["value"] for t in tasks}, {t: scores[t]["base"]["value"]',
        AGGREGATION + ("tests/metrics/test_composed.py",),
        "the run's forgetting is merged minus base",
    ),
    # ------------------------------------------------ the run's aggregation
    Mutant(
        "aggregable_excludes_zero",
        "mergeval/run/summary.py",
        'not 0.0 <= s["value"] <= 1.0',
        'not 0.0 < s["value"] <= 1.0',
        AGGREGATION,
        "a task where some model scores exactly 0 is left out of the aggregates",
    ),
    Mutant(
        "aggregable_counts_group_members",
        "mergeval/run/summary.py",
        'if not row.get("counted", True) and row.get("higher_is_better", True):',
        'if False and not row.get("counted", True):',
        AGGREGATION,
        "a group's member tasks counted beside their group",
    ),
    Mutant(
        "aggregate_normalized_base_expert_swapped",
        "mergeval/run/summary.py",
        'normalized_score(s[MERGED]["value"], s["base"]["value"], s[role]["value"])',
        'normalized_score(s[MERGED]["value"], s[role]["value"], s["base"]["value"])',
        AGGREGATION,
        "the run's normalized score with base and expert swapped",
    ),
    Mutant(
        "aggregate_ignores_percent_scale",
        "mergeval/run/summary.py",
        '"macro_gain": macro_gain(merged, constituents, scale=scale)',
        '"macro_gain": macro_gain(merged, constituents)',
        AGGREGATION,
        "the run's Macro-Gain ignores metric.scale",
    ),
    Mutant(
        "group_scores_drop_scale",
        "mergeval/metrics/composed.py",
        "scale = {name: g.scale for name, g in metric.groups.items()}",
        "scale = None",
        AGGREGATION + ("tests/metrics/test_composed.py",),
        "group means ignore each group's scale",
    ),
    Mutant(
        "score_text_drops_stderr",
        "mergeval/core/outcome.py",
        'return text if stderr is None or stderr != stderr else f"{text} ± {stderr:.{digits}f}"',
        "return text",
        AGGREGATION + ("tests/report/test_report.py",),
        "the score table drops the stderr",
    ),
]


class MutantError(Exception):
    """The list of mutants no longer fits the code (or the copy is not what the tests import)."""


# ---------------------------------------------------------------- locating a snippet by its tokens
#
# A snippet is matched against its file token by token (the ``tokenize`` module), not character by character,
# so the list survives reformatting (``ruff format``; tests/test_mutants_list.py formats every mutated file and
# matches again) and code moving within its file. What may differ between the snippet and the file:
#   - layout: whitespace, line breaks inside brackets and backslash continuations, blank lines, indentation
#     (INDENT/DEDENT), comments. A statement's end (NEWLINE) must still match one in the file, except at the
#     snippet's end (a snippet may stop mid-statement, or mid-bracket, as before);
#   - how a literal is spelled: strings compared by value (quote style, prefix case, escapes: ``'a'``, ``"a"``
#     and ``"\x61"`` are one string), adjacent plain literals by their concatenation, an f-string by its text
#     between the quotes with ``\'``/``\"`` unescaped (quotes and prefix case may change, what is in its braces
#     may not), numbers by value and type (``0XFF`` is ``0xff``; ``1`` is not ``1.0``). On Python 3.12+ an
#     f-string's tokens are put back together into one first;
#   - a trailing comma before a closing bracket, on either side, except one that makes a one-element tuple
#     (``(a,)``, ``x[a,]``);
#   - parentheses that change nothing, on either side: around a whole expression (a ``(`` that is no call's,
#     holding no top-level ``,``, ``for``, ``lambda``, ``yield``, ``:=`` or leading ``*``; preceded by the start of
#     a statement, ``=``, an augmented assignment, ``:=``, ``->``, ``return``, ``assert``, ``del``, ``if``,
#     ``elif``, ``while``, ``(``, ``[``, ``{``, ``,`` or ``:``; its ``)`` followed by the end of a statement or
#     by ``)``, ``]``, ``}``, ``,``, ``:``, ``=``, ``;`` or ``for``), around a tuple that is a whole assignment
#     target or right-hand side or a whole return value, around a for loop's target. Where the file's
#     parentheses open inside the match and close after it (``x = (`` ... ``)`` around a snippet that stops
#     mid-expression), planting puts the ``(`` back into ``after``, before the token that follows the same
#     tokens as in ``before`` (or precedes the same tokens); when ``after`` shares neither, it is an error.
# The snippet must match exactly once (matches that overlap count once, like str.count). Planting replaces the
# file's text from the first matched token's start to the last one's end (closing parentheses and a trailing
# comma the match skipped at its end included) by ``after``. ``after`` is written at ``before``'s indentation:
# each of its lines loses up to as much leading whitespace as ``before``'s first line has and, past the first,
# gains the matched line's indentation; its trailing newline goes (the matched line keeps its own). So a
# multi-line ``after`` lands at the depth of the match; inside brackets indentation does not matter, and a
# single-line ``after`` replacing a span over several lines (a call ruff wrapped) is valid as it stands.

_LAYOUT = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
_CLOSERS = {")": "(", "]": "[", "}": "{"}
_WHOLE_BEFORE = {
    "=",
    "+=",
    "-=",
    "*=",
    "/=",
    "//=",
    "%=",
    "**=",
    ">>=",
    "<<=",
    "&=",
    "^=",
    "|=",
    "@=",
    ":=",
    "->",
    "return",
    "assert",
    "del",
    "if",
    "elif",
    "while",
    "(",
    "[",
    "{",
    ",",
    ":",
}
_WHOLE_AFTER = {")", "]", "}", ",", ":", "=", ";", "for"}
_NOT_WHOLE_INSIDE = {",", "for", "lambda", "yield", ":="}
_TUPLE_BEFORE = {"=", "+=", "-=", "*=", "/=", "//=", "%=", "**=", ">>=", "<<=", "&=", "^=", "|=", "@=", "return"}


@dataclass(frozen=True)
class Token:
    key: tuple  # what is compared
    text: str
    start: tuple[int, int]  # (row, col) as tokenize gives them
    end: tuple[int, int]

    @property
    def statement_end(self) -> bool:
        return self.key[0] == "NEWLINE"


def _string_key(text: str) -> tuple:
    """A string literal's value (an f-string's text between its quotes, escaped quotes unescaped)."""
    prefix = re.match(r"[A-Za-z]*", text).group(0)
    if "f" not in prefix.lower():
        return ("s", ast.literal_eval(text))
    quote = (
        text[len(prefix) : len(prefix) + 3]
        if text[len(prefix) : len(prefix) + 3] in ('"""', "'''")
        else text[len(prefix)]
    )
    body = text[len(prefix) + len(quote) : len(text) - len(quote)]
    body = re.sub(r"\\(\\|'|\")", lambda m: m.group(0) if m.group(1) == "\\" else m.group(1), body)
    return ("f", "".join(sorted(prefix.lower())), body)


def _offsets(source: str) -> list[int]:
    """The offset of each line's start (index row - 1)."""
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def tokens(source: str, partial: bool = False) -> list[Token]:
    """The significant tokens of ``source``. ``partial``: a snippet, which may stop inside brackets (the
    tokens up to there are its tokens) and whose final statement end does not count."""
    raw = []
    try:
        raw.extend(tokenize.generate_tokens(io.StringIO(source).readline))
    except tokenize.TokenError as err:
        if not (partial and "multi-line statement" in str(err)):
            raise
    lines = _offsets(source)
    out: list[Token] = []
    k = 0
    while k < len(raw):
        tok = raw[k]
        if tok.type in _LAYOUT:
            k += 1
            continue
        if tok.type == getattr(tokenize, "FSTRING_START", None):  # Python 3.12+: an f-string is many tokens
            depth, m = 0, k
            while True:
                depth += {tokenize.FSTRING_START: 1, tokenize.FSTRING_END: -1}.get(raw[m].type, 0)
                if depth == 0:
                    break
                m += 1
            end = raw[m].end
            text = source[lines[tok.start[0] - 1] + tok.start[1] : lines[end[0] - 1] + end[1]]
            tok, k = tokenize.TokenInfo(tokenize.STRING, text, tok.start, end, tok.line), m
        if tok.type == tokenize.STRING:
            part = _string_key(tok.string)
            if out and out[-1].key[0] == "STRING":  # adjacent literals: one value
                prev = out[-1]
                parts = prev.key[1:] + (part,)
                if all(p[0] == "s" for p in parts):
                    parts = (("s", parts[0][1] + parts[1][1]),)
                out[-1] = Token(("STRING", *parts), prev.text + " " + tok.string, prev.start, tok.end)
            else:
                out.append(Token(("STRING", part), tok.string, tok.start, tok.end))
        elif tok.type == tokenize.NUMBER:
            value = ast.literal_eval(tok.string)
            out.append(Token(("NUMBER", type(value).__name__, value), tok.string, tok.start, tok.end))
        elif tok.type == tokenize.NEWLINE:
            out.append(Token(("NEWLINE",), tok.string, tok.start, tok.end))
        else:
            out.append(Token(("OP" if tok.type == tokenize.OP else "NAME", tok.string), tok.string, tok.start, tok.end))
        k += 1
    if partial:
        while out and out[-1].statement_end:
            out.pop()
    return out


def _pairs(toks: list[Token]) -> dict[int, int]:
    """Matching brackets, both ways (an unmatched one, at a snippet's edge, has no entry)."""
    pairs, stack = {}, []
    for i, t in enumerate(toks):
        if t.text in ("(", "[", "{") and t.key[0] == "OP":
            stack.append(i)
        elif t.text in _CLOSERS and t.key[0] == "OP":
            if stack and toks[stack[-1]].text == _CLOSERS[t.text]:
                o = stack.pop()
                pairs[o], pairs[i] = i, o
            else:
                stack.clear()
    return pairs


def _is_callee(tok: Token | None) -> bool:
    """Whether a bracket after ``tok`` is a call's or a subscript's."""
    if tok is None:
        return False
    if tok.key[0] == "NAME":
        return not keyword.iskeyword(tok.text)
    return tok.key[0] == "STRING" or tok.text in _CLOSERS


def _top_level(toks: list[Token], pairs: dict[int, int], o: int, c: int) -> list[Token]:
    """The tokens directly inside the brackets o..c (nested brackets skipped)."""
    out, k = [], o + 1
    while k < c:
        out.append(toks[k])
        k = pairs.get(k, k) + 1 if toks[k].text in ("(", "[", "{") else k + 1
    return out


def _comma_optional(toks: list[Token], pairs: dict[int, int], i: int) -> bool:
    """``toks[i]`` is a trailing comma that could go without changing the code."""
    if toks[i].text != "," or i + 1 >= len(toks) or toks[i + 1].text not in _CLOSERS:
        return False
    o = pairs.get(i + 1)
    if o is None:
        return toks[i + 1].text == "}"  # the opening bracket lies outside a snippet: only a set/dict is sure
    before = toks[o - 1] if o > 0 else None
    if (
        toks[o].text == "{"
        or (toks[o].text == "(" and _is_callee(before))
        or (toks[o].text == "[" and not _is_callee(before))
    ):
        return True
    return sum(t.text == "," for t in _top_level(toks, pairs, o, i + 1)) > 1  # not a one-element tuple


def _whole_before(tok: Token | None) -> bool:
    return tok is None or tok.statement_end or tok.text in _WHOLE_BEFORE and tok.key[0] in ("OP", "NAME")


def _whole_after(tok: Token | None) -> bool:
    return tok is None or tok.statement_end or tok.text in _WHOLE_AFTER and tok.key[0] in ("OP", "NAME")


def _redundant_parens(
    toks: list[Token], pairs: dict[int, int], o: int, before: Token | None, after: Token | None
) -> bool:
    """``toks[o]`` opens parentheses that can go without changing the code: around a whole expression that
    is not a tuple, a generator, a lambda, a yield, a walrus or starred; around a tuple that is a whole
    assignment target or right-hand side or return value; around a for loop's target. ``before``, ``after``:
    the tokens around the parentheses (None beyond a snippet's edge)."""
    if toks[o].text != "(" or o not in pairs:
        return False
    inside = _top_level(toks, pairs, o, pairs[o])
    if before is not None and before.text == "for" and after is not None and after.text == "in":
        return bool(inside)  # a for loop's target
    if _is_callee(before) or not _whole_before(before) or not _whole_after(after):
        return False
    if not inside or inside[0].text in ("*", "**"):
        return False
    special = [t.text for t in inside if t.text in _NOT_WHOLE_INSIDE and t.key[0] in ("OP", "NAME")]
    if not special:
        return True
    return (
        set(special) == {","}
        and (before is None or before.statement_end or before.text in _TUPLE_BEFORE)
        and (after is None or after.statement_end or after.text in ("=", ";"))
    )  # a bare tuple


@dataclass(frozen=True)
class Match:
    start: int  # the file's first token in the span
    end: int  # one past its last
    reopen: tuple[int, ...]  # snippet positions where a "(" the file closes after the span opened


def _match_at(F: list[Token], fp: dict[int, int], S: list[Token], sp: dict[int, int], start: int) -> Match | None:
    """The first way the snippet's tokens ``S`` match the file's ``F`` from ``start`` on, or None.

    ``fskip``: the file's closing parentheses still to skip (each with the snippet position where its skipped
    "(" was), ``sskip``: the snippet's; ``check_end``: the skipped snippet parentheses that close at its end
    (position, the token before them), checked again with the file's token after the match."""

    def step(i: int, j: int, fskip: frozenset, sskip: frozenset, check_end: tuple) -> Match | None:
        while True:
            pending = {c: o for c, o in fskip}
            if i in pending:
                fskip, i = fskip - {(i, pending[i])}, i + 1
            elif j in sskip:
                sskip, j = sskip - {j}, j + 1
            else:
                break
        if j == len(S):
            pending = {c for c, _ in fskip}
            while i + 1 in pending and _comma_optional(F, fp, i):  # a trailing comma before them goes with them
                i += 1
                while i in pending:
                    fskip, i, pending = {f for f in fskip if f[0] != i}, i + 1, pending - {i}
            if not all(_redundant_parens(S, sp, o, b, F[i] if i < len(F) else None) for o, b in check_end):
                return None
            return Match(start, i, tuple(sorted(o for _, o in fskip)))
        if i < len(F) and F[i].key == S[j].key:
            found = step(i + 1, j + 1, fskip, sskip, check_end)
            if found:
                return found
        if i < len(F) and _comma_optional(F, fp, i):
            found = step(i + 1, j, fskip, sskip, check_end)
            if found:
                return found
        if _comma_optional(S, sp, j):
            found = step(i, j + 1, fskip, sskip, check_end)
            if found:
                return found
        if (
            i < len(F)
            and F[i].text == "("
            and i in fp
            and _redundant_parens(F, fp, i, F[i - 1] if i else None, F[fp[i] + 1] if fp[i] + 1 < len(F) else None)
        ):
            found = step(i + 1, j, fskip | {(fp[i], j)}, sskip, check_end)
            if found:
                return found
        before = S[j - 1] if j else (F[i - 1] if i else None)
        if (
            S[j].text == "("
            and j in sp
            and _redundant_parens(S, sp, j, before, S[sp[j] + 1] if sp[j] + 1 < len(S) else None)
        ):
            ends = ((j, before),) if sp[j] + 1 == len(S) else ()
            return step(i, j + 1, fskip, sskip | {sp[j]}, check_end + ends)
        return None

    return step(start, 0, frozenset(), frozenset(), ())


@functools.lru_cache(maxsize=64)
def _file_tokens(source: str) -> tuple[list[Token], dict[int, int]]:
    toks = tokens(source)
    return toks, _pairs(toks)


def find(source: str, snippet: str) -> tuple[list[Token], list[Match]]:
    """The file's tokens and every place ``snippet`` matches in ``source`` (one per starting token)."""
    F, fp = _file_tokens(source)
    S = tokens(snippet, partial=True)
    sp = _pairs(S)
    found: list[Match] = []
    for start in range(len(F)) if S else ():
        overlaps = found and start < found[-1].end  # a match overlapping the previous one is the same (str.count)
        if (F[start].key == S[0].key or "(" in (S[0].text, F[start].text)) and not overlaps:
            m = _match_at(F, fp, S, sp, start)
            if m is not None and m.end > m.start:
                found.append(m)
    return F, found


def _indentation(text: str, row: int) -> int:
    line = text.splitlines()[row - 1] if text.splitlines() else ""
    return len(line) - len(line.lstrip())


def replacement(before: str, after: str, indent: int, reopen: tuple[int, ...] = ()) -> str:
    """``after`` as it replaces the span: at ``before``'s indentation moved to ``indent`` columns, its first
    line starting at the span, no trailing newline, a "(" put back before each snippet position in ``reopen``
    (found in ``after`` by the tokens before it, or else those after it, that ``before`` and ``after`` share)."""
    S = tokens(before, partial=True)
    depth = _indentation(before, S[0].start[0]) if S else 0
    lines = after.rstrip("\n").split("\n")
    lines = [line[min(depth, len(line) - len(line.lstrip(" "))) :] for line in lines]
    text = "\n".join([lines[0].lstrip(), *lines[1:]])
    if reopen:
        A = tokens(text, partial=True)
        starts = _offsets(text)
        for j in sorted(reopen, reverse=True):
            tail = len(S) - j
            if j < len(A) and [t.key for t in A[:j]] == [t.key for t in S[:j]]:
                k = j
            elif tail <= len(A) and [t.key for t in A[len(A) - tail :]] == [t.key for t in S[j:]]:
                k = len(A) - tail
            else:
                raise ValueError(
                    f"the file's parentheses around the snippet's end open before its token {j} "
                    "and after differs from before on both sides of it"
                )
            at = starts[A[k].start[0] - 1] + A[k].start[1]
            text = text[:at] + "(" + text[at:]
    return "\n".join([text.split("\n")[0], *[" " * indent + line if line else line for line in text.split("\n")[1:]]])


def plant(source: str, before: str, after: str) -> tuple[int, str]:
    """(how many times ``before`` matches in ``source``, the source with the match replaced when once)."""
    F, found = find(source, before)
    if len(found) != 1:
        return len(found), source
    m = found[0]
    lines = _offsets(source)
    first, last = F[m.start], F[m.end - 1]
    a = lines[first.start[0] - 1] + first.start[1]
    b = lines[last.end[0] - 1] + last.end[1]
    text = replacement(before, after, _indentation(source, first.start[0]), m.reopen)
    return 1, source[:a] + text + source[b:]


def copy_checkout(root: Path, dest: Path) -> None:
    """The parts of the checkout the tests need, symlinks kept (mergeval/run/conf -> ../conf), no caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache", "outputs", "multirun")
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def planted(text: str, mutant: Mutant) -> str:
    """``text`` with the mutant's snippet replaced (matched by tokens, above); MutantError unless the snippet
    matches exactly once."""
    try:
        count, result = plant(text, mutant.before, mutant.after)
    except (ValueError, SyntaxError, tokenize.TokenError) as err:
        raise MutantError(f"{mutant.name}: cannot plant in {mutant.path}: {err}") from err
    if count != 1:
        raise MutantError(
            f"{mutant.name}: the snippet matches {count} times in {mutant.path} (expected once): {mutant.before!r}"
        )
    return result


def copy_env(copy: Path) -> dict[str, str]:
    """The environment that makes Python (and every subprocess a test starts) import the copy's mergeval:
    the copy first on PYTHONPATH, ahead of the editable install's finder; no bytecode written, so a restored
    file can never be shadowed by the mutant's .pyc."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("MERGEVAL_HYPOTHESIS", None)  # the derandomized profile: a mutant is killed every time or never
    return env


def imported_from(copy: Path, env: dict[str, str]) -> Path:
    """Where ``import mergeval`` resolves when run in the copy with its environment."""
    out = subprocess.run(
        [sys.executable, "-c", "import mergeval; print(mergeval.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip()).resolve()


@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    seconds: float
    detail: str  # the first failing test, or what ran


def pytest_run(copy: Path, env: dict[str, str], tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    """(exit code, output) of pytest on ``tests`` in the copy; a run past ``timeout`` counts as a failure
    (a mutant that makes a test hang is caught), reported as code -1."""
    cmd = [sys.executable, "-m", "pytest", *PYTEST, *tests]
    try:
        out = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"no result within {timeout:.0f} s"
    return out.returncode, out.stdout + out.stderr


def first_failure(output: str) -> str:
    """The first FAILED/ERROR line of pytest's short summary, or the output's last line."""
    match = re.search(r"^(FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if match:
        return f"{match.group(1)} {match.group(2)}"
    lines = output.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def run_mutant(copy: Path, env: dict[str, str], mutant: Mutant, timeout: float) -> Outcome:
    """Plant the mutant in the copy, run its tests, restore the file (also when interrupted)."""
    path = copy / mutant.path
    original = path.read_text()
    path.write_text(planted(original, mutant))
    start = time.perf_counter()
    try:
        code, output = pytest_run(copy, env, mutant.tests, timeout)
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - start
    if code not in (0, 1, 2, -1):  # 3-5: internal error, usage error (a missing test), nothing collected
        raise MutantError(f"{mutant.name}: pytest exited {code} ({first_failure(output)}): fix its tests")
    killed = code != 0  # 1: a test failed; 2: collection failed (the mutant broke an import); -1: hung
    return Outcome(mutant, killed, seconds, first_failure(output) if killed else "all passed")


def check_copy_is_tested(copy: Path, env: dict[str, str], tests: tuple[str, ...], timeout: float) -> None:
    """MutantError unless mergeval resolves into the copy and a canary planted there breaks pytest's tests."""
    where = imported_from(copy, env)
    if copy.resolve() not in where.parents:
        raise MutantError(f"import mergeval resolves to {where}, not into the copy {copy}")
    canary = Mutant("canary", "mergeval/__init__.py", "", "raise ImportError('mutants.py canary')\n", tests, "")
    init = copy / canary.path
    original = init.read_text()
    init.write_text(canary.after + original)
    try:
        code, output = pytest_run(copy, env, tests, timeout)
    finally:
        init.write_text(original)
    if "mutants.py canary" not in output:
        raise MutantError(
            f"a canary planted in the copy's mergeval did not reach pytest (exit {code}): "
            "the tests import another mergeval"
        )


def selected(names: list[str]) -> list[Mutant]:
    if not names:
        return list(MUTANTS)
    chosen = [m for m in MUTANTS if any(n in m.name for n in names)]
    if not chosen:
        raise MutantError(f"no mutant name contains any of {names}")
    return chosen


def check_snippets(root: Path, mutants: list[Mutant]) -> None:
    """Every snippet occurs exactly once, checked up front so a stale list fails before minutes of tests."""
    errors = []
    for m in mutants:
        try:
            planted((root / m.path).read_text(), m)
        except MutantError as err:
            errors.append(str(err))
        except FileNotFoundError:
            errors.append(f"{m.name}: {m.path} does not exist")
    if errors:
        raise MutantError("\n".join(errors))


def baseline_tests(mutants: list[Mutant]) -> tuple[str, ...]:
    """Every test any chosen mutant runs, once (a node id is dropped when its whole file is listed)."""
    tests = dict.fromkeys(t for m in mutants for t in m.tests)
    return tuple(t for t in tests if "::" not in t or t.split("::")[0] not in tests)


def score_line(outcomes: list[Outcome]) -> str:
    killed = sum(o.killed for o in outcomes)
    return f"score: {killed}/{len(outcomes)} killed ({100 * killed / len(outcomes):.0f}%)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", default=[], help="run the mutants whose name contains this")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a mutant's tests count as hung")
    p.add_argument("--no-baseline", action="store_true", help="skip running the unmutated tests first")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout to copy (default: this one)")
    args = p.parse_args(argv)
    try:
        mutants = selected(args.only)
        if args.list:
            for m in mutants:
                print(f"{m.name:48} {m.path:36} {m.bug}")
            return 0
        check_snippets(args.root, mutants)
        with tempfile.TemporaryDirectory(prefix="mergeval-mutants-") as tmp:
            copy = Path(tmp)
            copy_checkout(args.root, copy)
            env = copy_env(copy)
            check_copy_is_tested(copy, env, ("tests/metrics/test_aggregates.py",), args.timeout)
            print(f"copy in {copy}; import mergeval -> {imported_from(copy, env)} (canary reached pytest)")
            if not args.no_baseline:
                code, output = pytest_run(copy, env, baseline_tests(mutants), args.timeout)
                if code != 0:
                    raise MutantError(f"the unmutated tests fail: {first_failure(output)}")
                print("baseline: the unmutated tests pass")
            outcomes = []
            for m in mutants:
                outcome = run_mutant(copy, env, m, args.timeout)
                outcomes.append(outcome)
                verdict = "killed  " if outcome.killed else "SURVIVED"
                print(f"{verdict} {m.name:48} {outcome.seconds:5.1f} s  {outcome.detail}", flush=True)
    except MutantError as err:
        print(f"mutants: error: {err}", file=sys.stderr)
        return 2
    print(score_line(outcomes))
    survivors = [o.mutant for o in outcomes if not o.killed]
    for m in survivors:
        print(f"  survived: {m.name} ({m.path}): {m.bug}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
