"""Reductions over runs keep the stderr that follows from the runs' own: min/max the chosen run's,
range that of a difference of two runs, mean that of a mean of independent runs; std none. A claim
such as "TA's score varies with lambda more than TIES's, by more than 1 stderr" needs them."""

from __future__ import annotations

import math

import pytest

from mergeval.specs import evaluate_claim
from mergeval.specs.claims import parse_claims
from mergeval.specs.runs import Run


def scored(value: float, stderr: float, lambda_: float) -> Run:
    config = {"method": {"name": "ties", "lambda_": lambda_}, "modelset": {"name": "m", "experts": {}}}
    models = [{"role": "base", "task": None}, {"role": "merged", "task": None}]
    return Run("result.json", config, {"t": {"merged": {"value": value, "stderr": stderr}}}, models, {})


# three runs: 0.5 +- 0.03, 0.75 +- 0.04, 0.25 +- 0.02 (dyadic values: differences are exact)
RUNS = [scored(0.5, 0.03, 0.5), scored(0.75, 0.04, 1.0), scored(0.25, 0.02, 1.5)]


def reduced(how: str, margin: float = 0.0, right: float = 0.0):
    [claim] = parse_claims([{"id": "c", "says": "s", "left": {"score": {"task": "t", "role": "merged"}, "over_runs": how},
                             "op": ">", "right": right, "stderr_margin": margin}], "claims", {}, {})
    [result] = evaluate_claim(claim, RUNS, {}, {})
    return result


@pytest.mark.parametrize("how,value,stderr", [
    ("max", 0.75, 0.04),                                   # the chosen run's own
    ("min", 0.25, 0.02),
    ("range", 0.5, math.hypot(0.04, 0.02)),                # max - min: a difference of two runs
    ("mean", 0.5, math.sqrt(0.03**2 + 0.04**2 + 0.02**2) / 3),
    ("std", 0.25, 0.0),                                    # no stderr follows
])
def test_each_reduction_keeps_the_stderr_that_follows(how, value, stderr):
    got = reduced(how).left
    assert got.value == pytest.approx(value)
    assert got.stderr == pytest.approx(stderr)


def test_a_range_claim_is_judged_against_its_stderr_margin():
    # range 0.5 with se hypot(0.04, 0.02) = 0.0447: passes "> 0.4" by 2 se (0.089), fails it by 3 se (0.134)
    assert reduced("range", margin=2, right=0.4).status == "pass"
    assert reduced("range", margin=3, right=0.4).status == "fail"
