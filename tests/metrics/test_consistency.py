"""Answer consistency across formats: the lettered task variants, metric.consistency, and a run that reports it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from mergeval.core.errors import UserError
from mergeval.core.outcome import ModelInfo, Outcome
from mergeval.eval.tasks import GENERATED, check_tasks, lettered_prompt, task_digest, write_tasks
from mergeval.metrics.calibration import format_agreement
from mergeval.metrics.composed import consistency
from mergeval.report.table import render
from mergeval.run.checks import check_metric_config
from mergeval.run.config import MetricConfig
from tests.run.test_cli import mergeval
from tests.run.test_cli_methods import result_of

CLOZE = ["mergeval_chem_count", "mergeval_unit_convert", "mergeval_general_facts"]
LETTERED = [f"{t}_mc" for t in CLOZE]


def jsonl(task_dir, name) -> list[dict]:
    return [json.loads(line) for line in (task_dir / f"{name}.jsonl").read_text().splitlines()]


# --- the lettered tasks --------------------------------------------------------------------------------------------


def test_the_lettered_prompt_lists_the_choices_after_the_question():
    item = {"question": "Convert 7 kg to g.", "choices": ["70 g", "7000 g", "700 g"], "answer": 1}
    assert lettered_prompt(item) == "Question: Convert 7 kg to g.\nA. 70 g\nB. 7000 g\nC. 700 g\nAnswer:"
    with pytest.raises(ValueError, match="letters"):
        lettered_prompt({"question": "?", "choices": [str(i) for i in range(27)], "answer": 0})


@pytest.mark.parametrize("split,n_validation", [("test", 0), ("validation", 10)])
def test_each_lettered_task_asks_the_cloze_items_in_order_with_letters_as_choices(cache, split, n_validation):
    task_dir = write_tasks(CLOZE + LETTERED, 12, cache, split=split, n_validation=n_validation)
    for cloze, lettered in zip(CLOZE, LETTERED):
        a, b = jsonl(task_dir, cloze), jsonl(task_dir, lettered)
        assert [(r["question"], r["choices"], r["answer"]) for r in a] == [
            (r["question"], r["choices"], r["answer"]) for r in b
        ]
        for row in b:
            assert row["letters"] == ["A", "B", "C", "D"][: len(row["choices"])]
            letter = row["letters"][row["answer"]]
            assert f"\n{letter}. {row['choices'][row['answer']]}\n" in row["prompt"]
            assert row["prompt"].endswith("\nAnswer:")
        assert 'doc_to_choice: "{{letters}}"' in (task_dir / f"{lettered}.yaml").read_text()
        assert 'doc_to_choice: "{{choices}}"' in (task_dir / f"{cloze}.yaml").read_text()


def test_the_lettered_tasks_share_the_cloze_pools():
    check_tasks(LETTERED[:2], 500)
    check_tasks(["mergeval_general_facts_mc"], 300, n_validation=51)
    with pytest.raises(UserError) as err:
        check_tasks(["mergeval_general_facts_mc"], 352)
    assert err.value.field == "benchmark.n_items"
    assert set(LETTERED) <= set(GENERATED)


# The digests the cloze tasks had before the lettered format existed: they key the evaluations in users'
# results stores, so they must never change (the 200-item ones are the quickstart's). The directory names
# changed once, on purpose, when the task YAML gained datasets' cache_dir (layout 2): that line is no part
# of the digest, so the digests below are the original ones.
CLOZE_DIGESTS = {
    (24, "test", 0): (
        "13a39bd5b92f3d27",
        {
            "mergeval_chem_count": "38e5440b2fb1ae88",
            "mergeval_unit_convert": "c4b0572efb1cf01e",
            "mergeval_general_facts": "3da848ee98208267",
        },
    ),
    (200, "test", 0): (
        "44c91e55e3f6fecf",
        {
            "mergeval_chem_count": "c5209bec94afb021",
            "mergeval_unit_convert": "8b031c3f465a033b",
            "mergeval_general_facts": "c99ed306088acec1",
        },
    ),
    (24, "validation", 20): (
        "80f9ea2747a82e75",
        {
            "mergeval_chem_count": "5229fc121b356c96",
            "mergeval_unit_convert": "37876db1f19d1962",
            "mergeval_general_facts": "9d74977a59c91531",
        },
    ),
}


@pytest.mark.parametrize("key", sorted(CLOZE_DIGESTS))
def test_cloze_tasks_keep_their_digests_alone_and_beside_the_lettered_ones(cache, key):
    n_items, split, n_validation = key
    directory, digests = CLOZE_DIGESTS[key]
    task_dir = write_tasks(CLOZE, n_items, cache, split=split, n_validation=n_validation)
    assert task_dir.name == directory
    assert {t: task_digest(task_dir, t) for t in CLOZE} == digests
    mixed = write_tasks(LETTERED + CLOZE, n_items, cache, split=split, n_validation=n_validation)
    assert mixed != task_dir and {t: task_digest(mixed, t) for t in CLOZE} == digests
    assert len({task_digest(mixed, t) for t in LETTERED + CLOZE}) == 6


# --- metric.consistency: config checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pairs,says",
    [
        ([["mergeval_chem_count"]], "not a pair"),
        ([["mergeval_chem_count", "mergeval_chem_count_mc", "mergeval_unit_convert"]], "not a pair"),
        ([["mergeval_chem_count", "mergeval_chem_count"]], "not a pair"),
        ([["mergeval_chem_count", "mergeval_general_facts_mc"]], "not in benchmark.tasks"),
        ([["mergeval_chem_count", "mergeval_unit_convert_mc"]], "pair mergeval_chem_count with mergeval_chem_count_mc"),
        ([["mergeval_unit_convert_mc", "mergeval_chem_count"]], "pair mergeval_unit_convert with"),
    ],
)
def test_bad_consistency_pairs_are_one_line_errors_naming_the_field(pairs, says):
    tasks = ["mergeval_chem_count", "mergeval_unit_convert", "mergeval_chem_count_mc", "mergeval_unit_convert_mc"]
    with pytest.raises(UserError) as err:
        check_metric_config(MetricConfig(consistency=pairs), tasks)
    assert err.value.field == "metric.consistency" and says in str(err.value) and "\n" not in str(err.value)


def test_pairs_of_one_task_in_two_formats_pass_in_either_order():
    check_metric_config(
        MetricConfig(consistency=[["mergeval_chem_count_mc", "mergeval_chem_count"]]),
        ["mergeval_chem_count", "mergeval_chem_count_mc"],
    )


def test_the_consistency_group_on_a_benchmark_without_lettered_tasks_fails_in_one_line(tmp_path, cache):
    out = mergeval("+experiment=tiny", "metric=consistency", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "metric.consistency" in lines[0] and "Traceback" not in out.stderr, out.stderr


# --- metric.consistency: the composed function ---------------------------------------------------------------------


def rows_of(lls: list[list[float]], gold: list[int]) -> list[dict]:
    return [{"doc_id": i, "lls": ll, "gold": g} for i, (ll, g) in enumerate(zip(lls, gold))]


@st.composite
def two_formats(draw):
    """The same n items with k choices: log-likelihoods in two formats and the gold answers."""
    n, k = draw(st.integers(1, 12)), draw(st.integers(2, 5))
    ll = st.lists(st.floats(-50, 0), min_size=k, max_size=k)
    lls_a = draw(st.lists(ll, min_size=n, max_size=n))
    lls_b = draw(st.lists(ll, min_size=n, max_size=n))
    gold = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    return lls_a, lls_b, gold


@given(two_formats(), st.randoms(use_true_random=False))
def test_agreement_is_a_symmetric_order_free_share_bounded_by_the_accuracies(formats, rnd):
    lls_a, lls_b, gold = formats
    a, b = rows_of(lls_a, gold), rows_of(lls_b, gold)
    out = format_agreement(a, b)
    assert 0 <= out["agreement"] <= 1 and out["n"] == len(gold)
    # Right in both formats means the same answer; the share right in both is at least acc_a + acc_b - 1.
    assert out["both_correct"] <= min(out["acc_a"], out["acc_b"], out["agreement"]) + 1e-12
    assert out["both_correct"] >= out["acc_a"] + out["acc_b"] - 1 - 1e-12
    swapped = format_agreement(b, a)
    assert (swapped["agreement"], swapped["both_correct"]) == (out["agreement"], out["both_correct"])
    assert (swapped["acc_a"], swapped["acc_b"]) == (out["acc_b"], out["acc_a"])
    shuffled_a, shuffled_b = a[:], b[:]
    rnd.shuffle(shuffled_a)
    rnd.shuffle(shuffled_b)
    assert format_agreement(shuffled_a, shuffled_b) == out


@given(two_formats())
def test_formats_with_the_same_argmax_agree_fully(formats):
    lls_a, _, gold = formats
    # Other log-likelihoods, same pick: 0 on the first maximum of format A, -1 elsewhere.
    same_pick = [[0.0 if j == ll.index(max(ll)) else -1.0 for j in range(len(ll))] for ll in lls_a]
    out = format_agreement(rows_of(lls_a, gold), rows_of(same_pick, gold))
    assert out["agreement"] == 1.0 and out["both_correct"] == out["acc_a"] == out["acc_b"]


def test_agreement_on_hand_made_items():
    # Item 0: both formats pick choice 0 (right); item 1: cloze picks 1 (right), lettered 2; item 2: both pick 2
    # (wrong); item 3: ties go to the first choice in both formats (wrong).
    cloze = rows_of([[0, -5, -9], [-4, -1, -3], [-9, -9, -1], [-1, -1, -2]], [0, 1, 0, 2])
    lettered = rows_of([[-1, -2, -3], [-3, -2, -1], [-5, -5, -2], [-3, -3, -3]], [0, 1, 0, 2])
    out = format_agreement(cloze, lettered)
    assert out == {"agreement": 0.75, "n": 4, "acc_a": 0.5, "acc_b": 0.25, "both_correct": 0.25}


@pytest.mark.parametrize(
    "change,says",
    [
        (lambda rows: rows[:-1], "different items"),
        (lambda rows: [dict(r, gold=(r["gold"] + 1) % 2) for r in rows], "differs"),
        (lambda rows: [dict(r, lls=r["lls"] + [-1.0]) for r in rows], "differs"),
        (lambda rows: rows + rows[:1], "twice"),
    ],
)
def test_formats_holding_different_items_are_refused(change, says):
    a = rows_of([[0.0, -1.0], [-1.0, 0.0]], [0, 1])
    with pytest.raises(ValueError, match=says):
        format_agreement(a, change(a))


def test_consistency_per_role_and_pair_with_none_for_models_without_samples():
    cloze, lettered = rows_of([[0, -1], [0, -1]], [0, 1]), rows_of([[0, -1], [-1, 0]], [0, 1])
    out = consistency({"base": {"x": cloze, "x_mc": lettered}, "old": None}, [["x", "x_mc"]])
    assert out["old"] is None
    assert out["base"] == {"x~x_mc": {"agreement": 0.5, "n": 2, "acc": {"x": 0.5, "x_mc": 1.0}, "both_correct": 0.5}}


def test_the_terminal_report_shows_each_models_consistency():
    per_pair = {
        "mergeval_chem_count~mergeval_chem_count_mc": {
            "agreement": 0.625,
            "n": 8,
            "acc": {"mergeval_chem_count": 0.75, "mergeval_chem_count_mc": 0.5},
            "both_correct": 0.375,
        }
    }
    scores = {
        "mergeval_chem_count": {
            r: {"metric": "acc,none", "value": 0.5, "stderr": 0.1, "n": 8} for r in ("base", "merged")
        }
    }
    outcome = Outcome(
        [ModelInfo("base", "zoo", "f0"), ModelInfo("merged", "ta", "f1")],
        list(scores),
        scores,
        {
            "normalized": {},
            "normalized_mean": None,
            "normalized_band": "undefined",
            "scale": "percent",
            "macro_gain": 0.0,
            "macro_og": 0.0,
            "consistency": {"base": per_pair, "merged": None},
        },
        {},
    )
    console = Console(record=True, width=160)
    render(outcome, "t", console)
    text = console.export_text()
    line = next(line for line in text.splitlines() if line.startswith("│ base"))
    assert [c.strip() for c in line.strip("│").split("│")] == [
        "base",
        "chem_count",
        "chem_count_mc",
        "0.625",
        "0.750",
        "0.500",
        "0.375",
        "8",
    ]
    assert "no kept samples" in next(line for line in text.splitlines() if line.startswith("│ merged"))


# --- one real run --------------------------------------------------------------------------------------------------


def test_a_run_reports_consistency_for_every_model_from_the_kept_log_likelihoods(tmp_path, tiny_dir):
    n_items = 6
    out = mergeval(
        "+experiment=tiny",
        "metric=consistency",
        f"benchmark.tasks=[{','.join(CLOZE + LETTERED)}]",
        f"benchmark.n_items={n_items}",
        cwd=tmp_path,
    )
    result = result_of(out, tmp_path)
    got = result["aggregates"]["consistency"]
    assert set(got) == {"base", "chem", "units", "merged"}
    for role, pairs in got.items():
        assert set(pairs) == {f"{t}~{t}_mc" for t in CLOZE}
        for stats in pairs.values():
            assert 0 <= stats["agreement"] <= 1 and stats["n"] == n_items
            for task, acc in stats["acc"].items():  # the argmax of the kept log-likelihoods is lm-eval's acc
                assert acc == pytest.approx(result["scores"][task][role]["value"])
    assert "answer consistency" in out.stdout
    for role in got:
        assert any(line.startswith(f"│ {role} ") and "chem_count_mc" in line for line in out.stdout.splitlines())


def test_samples_of_tasks_evaluated_in_different_runs_are_read_together(tmp_path):
    from mergeval.eval import samples

    one = samples.write(tmp_path / "one.jsonl", {"a": [{"doc_id": 0, "lls": [0.0, -1.0], "gold": 0}]})
    two = samples.write(tmp_path / "two.jsonl", {"b": [{"doc_id": 0, "lls": [-2.0, -1.0], "gold": 1}]})
    got = samples.read_tasks({"a": str(one), "b": str(two)})
    assert got == {
        "a": [{"doc_id": 0, "lls": [0.0, -1.0], "gold": 0}],
        "b": [{"doc_id": 0, "lls": [-2.0, -1.0], "gold": 1}],
    }
    assert samples.read_tasks({"a": str(one), "b": None}) is None  # a task stored without samples
    assert samples.read_tasks({"a": str(two)}) is None  # the file does not hold that task
