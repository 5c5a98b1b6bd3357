"""A run's aggregates (summary.py) and score text (outcome.py) on a hand-made score table, worked by hand.

Fast unit-level twins of the end-to-end recomputation in test_cli_methods.py: the numbers below are chosen so
that every aggregate differs from what a plausible slip would give (the base counted as a constituent, base
and expert swapped, the mean instead of the max, a group's scale dropped, the percent scale ignored).
"""

from __future__ import annotations

import math

import pytest

from mergeval.core.outcome import MERGED, ModelInfo, fixed, score_text, score_value
from mergeval.run.config import MetricConfig, MetricGroup
from mergeval.run.summary import LOWER_IS_BETTER, OUT_OF_RANGE, aggregable, aggregate, constituent_roles

#            base  chem  units merged
TABLE = {"chem": (0.20, 0.60, 0.30, 0.50), "units": (0.30, 0.25, 0.70, 0.40), "general": (0.80, 0.60, 0.70, 0.65)}
ROLES = ("base", "chem", "units", MERGED)
MODELS = [
    ModelInfo("base", "b", "fb"),
    ModelInfo("chem", "c", "fc", task="chem"),
    ModelInfo("units", "u", "fu", task="units"),
    ModelInfo(MERGED, "m", "fm"),
]
TASKS = list(TABLE)


def scores(table=TABLE) -> dict:
    return {
        t: {r: {"metric": "acc,none", "value": v, "stderr": 0.01, "n": 100} for r, v in zip(ROLES, row)}
        for t, row in table.items()
    }


def metric(**kw) -> MetricConfig:
    groups = {
        "domains": MetricGroup(tasks=["chem", "units"], scale=100.0),
        "general": MetricGroup(tasks=["general"], scale=50.0),
    }
    return MetricConfig(**{"groups": groups, "forgetting_tasks": ["general"], **kw})


def test_macro_gain_and_og_against_the_experts_by_hand():
    # task averages: base 1.30/3, chem 1.45/3, units 1.70/3, merged 1.55/3
    agg = aggregate(scores(), TASKS, MODELS, metric())
    assert agg["constituents"] == ["chem", "units"]
    assert agg["macro_gain"] == pytest.approx(100 * (1.55 / 3 - (1.45 + 1.70) / 6))  # -0.8333 points
    assert agg["macro_og"] == pytest.approx(100 * (1.55 - 1.70) / 3)  # -5 points: against units, the best


def test_the_base_joins_the_constituents_only_when_asked():
    agg = aggregate(scores(), TASKS, MODELS, metric(constituents="base_and_experts"))
    assert agg["constituents"] == ["base", "chem", "units"]
    assert agg["macro_gain"] == pytest.approx(100 * (1.55 / 3 - 4.45 / 9))  # +2.2222 points
    assert agg["macro_og"] == pytest.approx(-5.0)
    listed = aggregate(scores(), TASKS, MODELS, metric(constituents=["base", "units"]))
    assert listed["macro_gain"] == pytest.approx(100 * (1.55 / 3 - 3.00 / 6))


def test_fraction_scale_reports_the_same_gain_in_fractions():
    agg = aggregate(scores(), TASKS, MODELS, metric(scale="fraction"))
    assert (agg["scale"], agg["macro_gain"], agg["macro_og"]) == (
        "fraction",
        pytest.approx(-0.05 / 6),
        pytest.approx(-0.05),
    )


def test_normalized_scores_place_the_merge_between_base_and_expert():
    agg = aggregate(scores(), TASKS, MODELS, metric())
    # chem: (0.50 - 0.20) / (0.60 - 0.20); units: (0.40 - 0.30) / (0.70 - 0.30); general is no expert's task
    assert agg["normalized"] == {"chem": pytest.approx(0.75), "units": pytest.approx(0.25)}
    assert agg["normalized_mean"] == pytest.approx(0.5)
    assert agg["normalized_band"] == "moderate"


def test_an_expert_no_better_than_the_base_has_no_normalized_score():
    table = dict(TABLE, units=(0.30, 0.25, 0.30, 0.40))
    agg = aggregate(scores(table), TASKS, MODELS, metric())
    assert agg["normalized"] == {"chem": pytest.approx(0.75), "units": None}
    assert agg["normalized_mean"] == pytest.approx(0.75)  # the undefined one is left out, not counted as 0
    assert agg["normalized_band"] == "moderate"


def test_an_expert_below_the_base_keeps_its_ratio_but_leaves_the_mean():
    """units' expert 0.20 < base 0.30: (0.40 - 0.30) / (0.20 - 0.30) = -1 is shown, but the mean and its band
    once counted such ratios (a tiny run printed "1.00 (good)" from -1 and 3)."""
    table = dict(TABLE, units=(0.30, 0.25, 0.20, 0.40))
    agg = aggregate(scores(table), TASKS, MODELS, metric())
    assert agg["normalized"] == {"chem": pytest.approx(0.75), "units": pytest.approx(-1.0)}
    assert agg["normalized_not_counted"] == ["units"]
    assert agg["normalized_mean"] == pytest.approx(0.75) and agg["normalized_band"] == "moderate"
    both = aggregate(scores(dict(table, chem=(0.20, 0.10, 0.50, 0.30))), TASKS, MODELS, metric())
    assert both["normalized_mean"] is None and both["normalized_band"] == "undefined"


def test_group_means_rescale_each_group_and_forgetting_is_base_minus_merged():
    agg = aggregate(scores(), TASKS, MODELS, metric())
    # weighting=tasks: the plain mean of the rescaled tasks, e.g. merged (100*0.5 + 100*0.4 + 50*0.65) / 3
    want = {
        r: (100 * TABLE["chem"][i] + 100 * TABLE["units"][i] + 50 * TABLE["general"][i]) / 3
        for i, r in enumerate(ROLES)
    }
    assert agg["groups"] == pytest.approx(want)
    equal = aggregate(scores(), TASKS, MODELS, metric(weighting="equal"))["groups"]
    assert equal[MERGED] == pytest.approx(((50 + 40) / 2 + 32.5) / 2)
    assert agg["forgetting"] == {"per_task": {"general": pytest.approx(0.15)}, "mean": pytest.approx(0.15)}


def test_a_bare_scale_has_no_groups_and_no_forgetting():
    agg = aggregate(scores(), TASKS, MODELS, "percent")
    assert agg["groups"] == {} and agg["forgetting"] is None
    assert agg["macro_og"] == pytest.approx(-5.0)


def test_constituent_roles():
    roles = ["base", "chem", "units", MERGED]
    assert constituent_roles("experts", roles) == ["chem", "units"]
    assert constituent_roles("base_and_experts", roles) == ["base", "chem", "units"]
    assert constituent_roles(["units"], roles) == ["units"]


def test_aggregable_counts_zero_and_one_and_says_why_it_leaves_a_task_out():
    table = dict(
        TABLE,
        zero=(0.0, 0.1, 0.2, 1.0),
        ppl=(12.0, 11.0, 10.0, 10.5),
        wide=(0.5, 0.6, 1.2, 0.7),
        member=(0.1, 0.2, 0.3, 0.4),
    )
    rows = {
        "ppl": {"higher_is_better": False, "counted": True},
        "member": {"higher_is_better": True, "counted": False},  # counted through its group
        "wide": {"higher_is_better": True, "counted": True},
    }
    counted, excluded = aggregable(scores(table), rows, list(table))
    assert counted == ["chem", "units", "general", "zero"]
    assert excluded == {"ppl": LOWER_IS_BETTER, "wide": OUT_OF_RANGE}


@pytest.mark.parametrize(
    "score,text",
    [
        ({"value": 0.612, "stderr": 0.021}, "0.612 ± 0.021"),
        ({"value": 123.456, "stderr": 2.54}, "123.5 ± 2.5"),  # perplexities: one decimal
        ({"value": 99.9994, "stderr": 0.5}, "99.999 ± 0.500"),
        ({"value": 0.5}, "0.500"),
        ({"value": 0.5, "stderr": None}, "0.500"),
        ({"value": 0.5, "stderr": math.nan}, "0.500"),
        ({"acc": 0.25, "stderr": 0.04}, "0.250 ± 0.040"),  # a result.json from before per-task metrics
    ],
)
def test_score_text(score, text):
    assert score_text(score) == text


def test_score_value_and_fixed():
    assert score_value({"acc": 0.3}) == 0.3 and score_value({"value": 0.4, "acc": 0.3}) == 0.4
    assert fixed(-0.001) == "0.00" and fixed(-0.006) == "-0.01" and fixed(1.234, 1) == "1.2"


def test_two_experts_on_one_task_normalize_it_by_the_better_and_count_it_once():
    """Both experts naming chem: the table said "mean over -1 of 1 expert tasks" (the task counted once per
    expert that does not beat the base) and normalized chem by whichever expert came last."""
    both = [
        ModelInfo("base", "b", "fb"),
        ModelInfo("chem", "c", "fc", task="chem"),
        ModelInfo("units", "u", "fu", task="chem"),
        ModelInfo(MERGED, "m", "fm"),
    ]
    agg = aggregate(scores(), TASKS, both, metric())
    assert agg["normalized"] == {"chem": pytest.approx((0.50 - 0.20) / (0.60 - 0.20))}  # chem 0.60 beats units 0.30
    assert agg["normalized_not_counted"] == []
    worse = scores({**TABLE, "chem": (0.70, 0.60, 0.30, 0.50)})  # neither beats the base: counted once
    assert aggregate(worse, TASKS, both, metric())["normalized_not_counted"] == ["chem"]
