"""Claims on runs compared paired (per-item outcomes in result.json), preconditions and untestable verdicts, and
verify refusing to report on runs it was not given."""

from __future__ import annotations

import json
import math

import pytest

from mergeval.metrics.paired import sample_variance
from mergeval.verify import ClaimResult, evaluate_claims, load_runs, load_spec
from mergeval.verify.__main__ import exit_status, main
from mergeval.verify.recorded import parse_records
from tests.verify.test_verify import SCORES, spec_file, write_run


def with_items(path, items: dict) -> None:
    """Add per-item outcomes (task -> role -> values, ids 0..n-1) to a result.json, and scores that match them."""
    result = json.loads(path.read_text())
    result["items"] = {}
    for task, by_role in items.items():
        for role, values in by_role.items():
            n = len(values)
            result["scores"][task][role] = {
                "value": sum(values) / n,
                "stderr": math.sqrt(sample_variance(values) / n),
                "n": n,
            }
            result["items"].setdefault(task, {})[role] = {"ids": list(range(n)), "values": values}
    path.write_text(json.dumps(result))


def results(spec_path, run_paths, ids=None):
    spec = load_spec(spec_path)
    runs = load_runs([str(p) for p in run_paths]) if run_paths is not None else None
    selected = [c for c in spec.claims if ids is None or c.id in ids]
    return {r.id: r for r in evaluate_claims(spec.claims, selected, runs, spec.tables, spec.metrics)}


BEATS = """\
- id: merged_beats_b
  says: the merge beats expert b on task_a
  left: {score: {task: task_a, role: merged}}
  op: ">"
  right: {score: {task: task_a, role: b}}
  stderr_margin: 2
"""


def test_models_answering_the_same_items_alike_are_compared_paired(tmp_path):
    # 40 items; the merge answers every item b answers, and 8 more: a gain of 0.2
    b = [1] * 16 + [0] * 24
    merged = [1] * 24 + [0] * 16
    run = write_run(tmp_path, "r", SCORES)
    with_items(run, {"task_a": {"b": b, "merged": merged}})
    got = results(spec_file(tmp_path, BEATS), [run])["merged_beats_b"]
    d = [m - x for m, x in zip(merged, b)]
    paired = math.sqrt(sample_variance(d) / 40)
    unpaired = math.hypot(got.left.stderr, got.right.stderr)
    assert paired < 0.6 * unpaired  # the same items: much of the noise cancels
    assert got.status == "pass" and got.margin == pytest.approx(0.2 / paired - 2)
    assert "2 x paired se" in got.detail
    assert 0.2 / unpaired < 2  # compared as independent, the same runs would not settle it


def test_without_items_the_comparison_is_unpaired_as_before(tmp_path):
    run = write_run(tmp_path, "r", SCORES)  # task_a: merged 0.8 +- 0.04, b 0.5 +- 0.05
    got = results(spec_file(tmp_path, BEATS), [run])["merged_beats_b"]
    assert got.margin == pytest.approx(0.3 / math.hypot(0.04, 0.05) - 2)
    assert "2 x se" in got.detail


def test_a_reduction_over_runs_pairs_the_same_items_across_runs(tmp_path):
    # two runs of one merge method: the range of their scores on the same items
    runs = []
    for name, merged in (("r1", [1] * 20 + [0] * 20), ("r2", [1] * 26 + [0] * 14)):
        run = write_run(tmp_path, name, SCORES, params={"lambda_": 0.5 if name == "r1" else 1.0})
        with_items(run, {"task_a": {"merged": merged}})
        runs.append(run)
    claim = """\
    - id: spread
      says: the score moves with lambda
      left: {score: {task: task_a, role: merged}, over_runs: range}
      op: ">"
      right: 0
      stderr_margin: 2
    """
    got = results(spec_file(tmp_path, claim), runs)["spread"]
    d = [1.0 if 20 <= i < 26 else 0.0 for i in range(40)]  # the items the runs answer differently
    assert got.left.value == pytest.approx(0.15)
    assert got.left.stderr == pytest.approx(math.sqrt(sample_variance(d) / 40))
    assert got.status == "pass"


PRECONDITION = """\
- id: experts_learn
  says: each expert beats the base on its own task
  for_each: expert
  left: {score: {task: "{task}", role: "{expert}"}}
  op: ">"
  right: {score: {task: "{task}", role: base}}
  stderr_margin: 2
- id: merge_keeps_skill
  says: the merge keeps most of each expert's gain
  for_each: expert
  requires: [experts_learn]
  left: {score: {task: "{task}", role: merged}}
  op: ">"
  right: {score: {task: "{task}", role: base}}
"""


def test_a_finding_whose_precondition_fails_is_untestable_per_repetition(tmp_path):
    run = write_run(tmp_path, "r", SCORES)  # expert a learned task_a (6.9 se); b did not learn task_b (0.7 se)
    got = results(spec_file(tmp_path, PRECONDITION), [run], ids={"merge_keeps_skill"})
    assert got["experts_learn (expert=a)"].status == "pass"  # required claims are evaluated with it
    assert got["merge_keeps_skill (expert=a)"].status == "pass"
    b = got["merge_keeps_skill (expert=b)"]
    assert b.status == "untestable"
    assert b.detail.startswith("precondition experts_learn (expert=b) is fail")
    assert "as measured: pass" in b.detail  # what the claim itself gave stays visible
    assert b.margin == got["experts_learn (expert=b)"].margin


def test_requires_names_claims_of_the_spec_and_no_cycle(tmp_path, capsys):
    unknown = PRECONDITION.replace("requires: [experts_learn]", "requires: [experts_lern]")
    assert main([spec_file(tmp_path, unknown)]) == 2
    assert "claims.merge_keeps_skill.requires: 'experts_lern' is not another claim" in capsys.readouterr().err
    cycle = PRECONDITION.replace(
        "  stderr_margin: 2\n- id: merge", "  stderr_margin: 2\n  requires: [merge_keeps_skill]\n- id: merge"
    )
    assert main([spec_file(tmp_path, cycle)]) == 2
    assert "requires itself through" in capsys.readouterr().err


def test_untestable_does_not_fail_unless_strict_and_a_failed_precondition_does(tmp_path, capsys):
    run = write_run(tmp_path, "r", SCORES)
    spec = spec_file(tmp_path, PRECONDITION)
    assert main([spec, "--run", str(run), "--claim", "merge_keeps_skill"]) == 1  # expert b did not learn: a fail
    out = capsys.readouterr().out
    assert "claims 2 pass, 1 fail, 1 untestable, 0 not run" in out
    untestable = ClaimResult("c", "s", "untestable", ">")
    assert exit_status([], [untestable], strict=False) == 0
    assert exit_status([], [untestable], strict=True) == 1  # as "not run" is


def test_verify_without_runs_never_exits_0_for_checks_that_need_them(tmp_path, capsys):
    spec = spec_file(
        tmp_path,
        PRECONDITION,
        extra="verdicts:\n  ci:\n    run: x\n    claims:\n      merge_keeps_skill (expert=a): pass +3.0\n",
    )
    assert main([spec, "--recorded", "ci"]) == 2
    assert capsys.readouterr().err.startswith("mergeval: error: --recorded: compares runs with a record, and no --run")
    assert main([spec, "--claim", "merge_keeps_skill"]) == 2
    assert "are all about runs, and no --run is given" in capsys.readouterr().err
    assert main([spec]) == 0  # the published part only: says so, as before


def test_a_record_may_hold_untestable():
    record = parse_records({"ci": {"run": "x", "claims": {"c (expert=b)": "untestable -1.5"}}}, "verdicts")["ci"]
    assert record.claims["c (expert=b)"].verdict == "untestable" and record.claims["c (expert=b)"].enforced
