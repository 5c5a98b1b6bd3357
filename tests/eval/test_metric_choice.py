"""mergeval.eval.metric_choice: which of a task's lm-eval metrics a run reports (``acc_norm`` over ``acc``,
``flexible-extract`` over other filters, else the task's first). Once caught only by a 130-second CLI test."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mergeval.eval.metric_choice import default_metric, metric_keys, normalize_key


@pytest.mark.parametrize(
    "keys,expected",
    [
        (["acc,none", "acc_norm,none"], "acc_norm,none"),  # HellaSwag, ARC
        (["acc_norm,none", "acc,none"], "acc_norm,none"),
        (["acc,none"], "acc,none"),  # a task without acc_norm
        (["exact_match,strict-match", "exact_match,flexible-extract"], "exact_match,flexible-extract"),  # GSM8K
        (["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"], "word_perplexity,none"),  # wikitext
        (["f1,none", "exact_match,none"], "f1,none"),  # the task's first metric
        (["acc,strict", "acc,loose"], "acc,strict"),  # the first filter
    ],
)
def test_the_default_metric(keys, expected):
    assert default_metric(keys) == expected


def test_a_task_without_metrics_is_an_error():
    with pytest.raises(ValueError):
        default_metric([])


names = st.sampled_from(["acc", "acc_norm", "exact_match", "f1", "mcc", "word_perplexity"])
filters = st.sampled_from(["none", "strict-match", "flexible-extract", "remove_whitespace"])


@given(st.lists(names, min_size=1, max_size=4, unique=True), st.lists(filters, min_size=1, max_size=3, unique=True))
def test_the_choice_is_a_reported_key_and_follows_the_preferences(metrics, task_filters):
    keys = metric_keys(metrics, task_filters)
    chosen = default_metric(keys)
    metric, flt = chosen.split(",", 1)
    assert chosen in keys
    assert metric == ("acc_norm" if "acc_norm" in metrics else metrics[0])
    assert flt == ("flexible-extract" if "flexible-extract" in task_filters else task_filters[0])
    assert normalize_key(chosen, keys) == chosen


def test_a_metric_without_its_filter_means_its_only_one():
    keys = ["acc,none", "acc_norm,none", "exact_match,strict-match", "exact_match,flexible-extract"]
    assert normalize_key("acc_norm", keys) == "acc_norm,none"
    assert normalize_key("exact_match", keys) is None  # two filters: ambiguous
    assert normalize_key("bleu", keys) is None
