"""Stderrs of operands computed from several scores. Reductions over runs keep the stderr that follows
from the runs' own: min/max the chosen run's, range that of a difference of two runs, mean that of a mean of
independent runs; std none. Macro-Gain / Macro-OG carry the stderr of their linear form. Claims such as
"TA's score varies with lambda more than TIES's, by more than 1 stderr" need them."""

from __future__ import annotations

import math

import pytest

from mergeval.verify import evaluate_claim
from mergeval.verify.claims import parse_claims
from mergeval.verify.runs import Run


def scored(value: float, stderr: float, lambda_: float) -> Run:
    config = {"method": {"name": "ties", "lambda_": lambda_}, "modelset": {"name": "m", "experts": {}}}
    models = [{"role": "base", "task": None}, {"role": "merged", "task": None}]
    return Run("result.json", config, {"t": {"merged": {"value": value, "stderr": stderr}}}, models, {})


# three runs: 0.5 +- 0.03, 0.75 +- 0.04, 0.25 +- 0.02 (dyadic values: differences are exact)
RUNS = [scored(0.5, 0.03, 0.5), scored(0.75, 0.04, 1.0), scored(0.25, 0.02, 1.5)]


def reduced(how: str, margin: float = 0.0, right: float = 0.0):
    [claim] = parse_claims(
        [
            {
                "id": "c",
                "says": "s",
                "left": {"score": {"task": "t", "role": "merged"}, "over_runs": how},
                "op": ">",
                "right": right,
                "stderr_margin": margin,
            }
        ],
        "claims",
        {},
        {},
    )
    [result] = evaluate_claim(claim, RUNS, {}, {})
    return result


@pytest.mark.parametrize(
    "how,value,stderr",
    [
        ("max", 0.75, 0.04),  # the chosen run's own
        ("min", 0.25, 0.02),
        ("range", 0.5, math.hypot(0.04, 0.02)),  # max - min: a difference of two runs
        ("mean", 0.5, math.sqrt(0.03**2 + 0.04**2 + 0.02**2) / 3),
        ("std", 0.25, 0.0),  # no stderr follows
    ],
)
def test_each_reduction_keeps_the_stderr_that_follows(how, value, stderr):
    got = reduced(how).left
    assert got.value == pytest.approx(value)
    assert got.stderr == pytest.approx(stderr)


def test_a_range_claim_is_judged_against_its_stderr_margin():
    # range 0.5 with se hypot(0.04, 0.02) = 0.0447: passes "> 0.4" by 2 se (0.089), fails it by 3 se (0.134)
    assert reduced("range", margin=2, right=0.4).status == "pass"
    assert reduced("range", margin=3, right=0.4).status == "fail"


def test_macro_gain_and_macro_og_carry_the_stderr_of_their_linear_form():
    # two tasks, constituents a (avg 0.5) and b (avg 0.625: the best), scale percent: c/T = 50
    scores = {
        t: {r: {"value": v, "stderr": s} for r, (v, s) in by_role.items()}
        for t, by_role in {
            "t1": {"merged": (0.75, 0.03), "a": (0.5, 0.04), "b": (0.75, 0.02), "base": (0.25, 0.01)},
            "t2": {"merged": (0.5, 0.04), "a": (0.5, 0.02), "b": (0.5, 0.03), "base": (0.25, 0.01)},
        }.items()
    }
    aggregates = {"scale": "percent", "constituents": ["a", "b"], "macro_gain": 6.25, "macro_og": 0.0, "excluded": {}}
    run = Run(
        "result.json",
        {"method": {"name": "ties"}, "modelset": {"name": "m", "experts": {"a": {}, "b": {}}}},
        scores,
        [{"role": "merged", "task": None}],
        aggregates,
    )
    merged_var = 0.03**2 + 0.04**2
    assert run.aggregate_stderr("macro_gain") == pytest.approx(
        50 * math.sqrt(merged_var + 0.25 * (0.04**2 + 0.02**2 + 0.02**2 + 0.03**2))
    )
    assert run.aggregate_stderr("macro_og") == pytest.approx(50 * math.sqrt(merged_var + 0.02**2 + 0.03**2))  # b only
    assert run.aggregate_stderr("normalized_mean") == 0.0
    [claim] = parse_claims(
        [{"id": "gain", "says": "s", "left": {"metric": "macro_gain"}, "op": ">", "right": 0}], "claims", {}, {}
    )
    [result] = evaluate_claim(claim, [run], {}, {})
    assert result.left.value == 6.25 and result.left.stderr == pytest.approx(run.aggregate_stderr("macro_gain"))
