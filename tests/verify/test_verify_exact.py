"""Spec verification worked by hand at its boundaries: a claim's verdict at equality and at the edge of its
stderr margin and tolerance, a spec metric's propagated stderr, reductions over runs, a derived normalized
mean, and the exit status with and without --strict."""

from __future__ import annotations

import math

import pytest

from mergeval.verify import compare, evaluate_claim
from mergeval.verify.__main__ import exit_status
from mergeval.verify.claims import ClaimResult, parse_claims
from mergeval.verify.formulas import parse_formula
from mergeval.verify.runs import Measured, Run, parse_metrics

# dyadic values: every difference below is exact in binary floating point
HALF, QUARTER, THREE_QUARTERS = 0.5, 0.25, 0.75


def verdict(left, op, right, **kw) -> str:
    return compare(left, op, right, **kw)[0]


# ---------------------------------------------------------------- compare


@pytest.mark.parametrize(
    "op,strict_at_equality", [(">", "fail"), (">=", "pass"), ("<", "fail"), ("<=", "pass"), ("==", "pass")]
)
def test_equal_values_pass_only_the_non_strict_relations(op, strict_at_equality):
    assert verdict(Measured(HALF), op, Measured(HALF)) == strict_at_equality


def test_less_than_compares_right_minus_left():
    assert verdict(Measured(QUARTER), "<", Measured(HALF)) == "pass"
    assert verdict(Measured(HALF), "<", Measured(QUARTER)) == "fail"
    assert verdict(Measured(HALF), ">", Measured(QUARTER)) == "pass"


def test_the_stderr_margin_combines_the_two_errors_in_quadrature():
    # se = hypot(0.03, 0.04) = 0.05; d = 0.25: 4.5 se = 0.225 passes (linearly added, 0.315, it would not)
    left, right = Measured(THREE_QUARTERS, 0.03), Measured(HALF, 0.04)
    assert verdict(left, ">", right, stderr_margin=4.5) == "pass"
    assert verdict(left, ">", right, stderr_margin=5.5) == "fail"  # 0.275 > 0.25
    assert verdict(Measured(HALF, 0.03), "==", Measured(THREE_QUARTERS, 0.04), stderr_margin=4.5) == "fail"
    assert verdict(Measured(HALF, 0.03), "==", Measured(THREE_QUARTERS, 0.04), stderr_margin=5.5) == "pass"


def test_the_tolerance_makes_a_claim_lenient():
    # d = 0.25 - 0.5 = -0.25: fails plainly, passes with a tolerance beyond 0.25, fails at exactly 0.25 for >
    assert verdict(Measured(QUARTER), ">", Measured(HALF)) == "fail"
    assert verdict(Measured(QUARTER), ">", Measured(HALF), tolerance=0.375) == "pass"
    assert verdict(Measured(QUARTER), ">", Measured(HALF), tolerance=0.25) == "fail"
    assert verdict(Measured(QUARTER), ">=", Measured(HALF), tolerance=0.25) == "pass"
    assert verdict(Measured(QUARTER), "==", Measured(HALF), tolerance=0.25) == "pass"
    assert verdict(Measured(QUARTER), "==", Measured(HALF), tolerance=0.125) == "fail"


def test_a_printed_cell_decides_only_beyond_its_rounding():
    # 0.50 printed is [0.495, 0.505]: against 0.5 exactly, > can be neither confirmed nor refuted
    cell = Measured(0.5, lo=0.495, hi=0.505)
    assert verdict(cell, ">", Measured(0.5)) == "undetermined"
    assert verdict(cell, ">", Measured(0.49)) == "pass"
    assert verdict(cell, ">", Measured(0.51)) == "fail"
    assert verdict(cell, "<=", Measured(0.505)) == "pass"


# ---------------------------------------------------------------- spec metrics on a run


def run(scores: dict, experts: dict[str, str] | None = None, method: str = "ties") -> Run:
    experts = experts or {}
    models = [
        {"role": "base", "task": None},
        *({"role": e, "task": t} for e, t in experts.items()),
        {"role": "merged", "task": None},
    ]
    config = {"method": {"name": method}, "modelset": {"name": "m", "experts": {e: {} for e in experts}}}
    table = {t: {r: {"value": v, "stderr": s} for r, (v, s) in by_role.items()} for t, by_role in scores.items()}
    return Run("result.json", config, table, models, {})


def test_a_runs_score_keeps_its_stderr():
    got = run({"t": {"merged": (0.5, 0.02)}}).score("t", "merged")
    assert (got.value, got.stderr) == (0.5, 0.02)


def test_a_mean_metric_propagates_independent_stderrs():
    metrics = parse_metrics({"avg": {"mean": {"tasks": ["t1", "t2"], "scale": 100}}}, "metrics")
    got = metrics["avg"].measure(run({"t1": {"merged": (0.5, 0.03)}, "t2": {"merged": (0.75, 0.04)}}), "merged")
    assert got.value == pytest.approx(62.5)
    assert got.stderr == pytest.approx(100 * math.hypot(0.03, 0.04) / 2)  # 2.5, not 100 * 0.07 / 2


def test_a_group_metric_weights_each_tasks_stderr_by_its_weight():
    # groups a = {t1, t2}, b = {t3}, equal weighting: 0.25 t1 + 0.25 t2 + 0.5 t3
    metrics = parse_metrics(
        {"g": {"group_mean": {"groups": {"a": ["t1", "t2"], "b": ["t3"]}, "weighting": "equal"}}}, "metrics"
    )
    scores = {"t1": {"merged": (0.5, 0.04)}, "t2": {"merged": (0.25, 0.04)}, "t3": {"merged": (0.75, 0.02)}}
    got = metrics["g"].measure(run(scores), "merged")
    assert got.value == pytest.approx(0.25 * 0.5 + 0.25 * 0.25 + 0.5 * 0.75)
    assert got.stderr == pytest.approx(math.sqrt(2 * (0.25 * 0.04) ** 2 + (0.5 * 0.02) ** 2))


def test_forgetting_defaults_to_the_tasks_no_expert_owns_and_divides_its_stderr_by_t():
    metrics = parse_metrics({"forget": {"forgetting": {"scale": 100}}}, "metrics")
    scores = {
        "own": {"base": (0.2, 0.05), "merged": (0.9, 0.05)},
        "g1": {"base": (0.75, 0.03), "merged": (0.5, 0.0)},
        "g2": {"base": (0.5, 0.04), "merged": (0.5, 0.0)},
    }
    got = metrics["forget"].measure(run(scores, experts={"x": "own"}), "merged")
    assert got.value == pytest.approx(100 * (0.25 + 0.0) / 2)  # "own" is expert x's task: left out
    assert got.stderr == pytest.approx(100 * math.hypot(0.03, 0.04) / 2)


def test_std_over_runs_is_the_sample_standard_deviation():
    runs = [run({"t": {"merged": (v, 0.0)}}) for v in (0.25, 0.5, 0.75)]
    [claim] = parse_claims(
        [
            {
                "id": "stable",
                "says": "the spread is small",
                "left": {"score": {"task": "t", "role": "merged"}, "over_runs": "std"},
                "op": "<=",
                "right": 0.25,
            }
        ],
        "claims",
        {},
        {},
    )
    [result] = evaluate_claim(claim, runs, {}, {})
    assert result.left.value == pytest.approx(0.25)  # sqrt((0.0625 + 0 + 0.0625) / 2), not / 3
    assert result.status == "pass"


# ---------------------------------------------------------------- derivations and exit status


def test_a_derived_normalized_mean_takes_base_then_expert():
    formula = parse_formula(
        {"normalized_mean": {"merged": ["m1", "m2"], "base": ["b1", "b2"], "expert": ["e1", "e2"]}},
        "f",
        lambda raw, field: ("t", "r", raw),
    )
    # inputs in the order of refs: merged, base, expert -> (0.5 - 0.2)/(0.6 - 0.2) = 0.75, (0.4 - 0.3)/(0.8 - 0.3)
    assert formula.fn([0.5, 0.4, 0.2, 0.3, 0.6, 0.8]) == pytest.approx((0.75 + 0.2) / 2)


def test_a_derived_macro_gain_in_percent():
    formula = parse_formula(
        {"macro_gain": {"merged": ["m1", "m2"], "constituents": [["a1", "a2"], ["b1", "b2"]], "scale": "percent"}},
        "f",
        lambda raw, field: ("t", "r", raw),
    )
    assert formula.fn([0.5, 0.75, 0.25, 0.5, 0.5, 0.5]) == pytest.approx(100 * (0.625 - (0.375 + 0.5) / 2))


def result(status: str) -> ClaimResult:
    return ClaimResult("c", "says", status, ">")


@pytest.mark.parametrize(
    "statuses,plain,strict",
    [
        (["pass", "pass"], 0, 0),
        (["pass", "not run"], 0, 1),
        (["pass", "undetermined"], 0, 1),
        (["fail", "pass"], 1, 1),
    ],
)
def test_exit_status_with_and_without_strict(statuses, plain, strict):
    results = [result(s) for s in statuses]
    assert (exit_status([], results, False), exit_status([], results, True)) == (plain, strict)
