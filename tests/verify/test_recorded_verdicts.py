"""Claim margins in stderr units and recorded verdicts (mergeval/verify/recorded.py, verify --recorded / --record).

Synthetic result.json files only: no model is built (well under a second).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mergeval.verify.__main__ as verify
from mergeval.core.errors import UserError
from mergeval.verify import Measured, compare
from mergeval.verify.claims import stderr_units
from mergeval.verify.recorded import Record, Recorded, combine, parse_records
from tests.verify.test_verify import EXPERT_CLAIM, SCORES, outcomes, spec_file, write_run


def test_margin_is_the_gap_in_stderrs_beyond_the_claimed_margin(tmp_path):
    run = write_run(tmp_path, "r", SCORES)
    got = outcomes(spec_file(tmp_path, EXPERT_CLAIM), [run])
    se_a, se_b = math.hypot(0.03, 0.05), math.hypot(0.05, 0.05)
    assert got["expert_beats_base (expert=a)"].margin == pytest.approx(0.4 / se_a - 2)  # 0.9 vs 0.5, needs 2 se
    assert got["expert_beats_base (expert=b)"].margin == pytest.approx(0.05 / se_b - 2)  # 0.35 vs 0.3: -1.29


@pytest.mark.parametrize(
    "op,lv,rv,tol,k,want",
    [
        ("<", 0.3, 0.5, 0.0, 1.0, 0.2 / 0.05 - 1),  # r - l for "<"
        ("<=", 0.5, 0.3, 0.1, 0.0, (-0.2 + 0.1) / 0.05),  # the tolerance moves the threshold toward the pass side
        ("==", 0.5, 0.52, 0.0, 2.0, (2 * 0.05 - 0.02) / 0.05),
    ],
)
def test_margin_for_each_operator(op, lv, rv, tol, k, want):
    assert stderr_units(Measured(lv, 0.03), op, Measured(rv, 0.04), tol, k) == pytest.approx(want)


def test_margin_without_stderr_is_none():
    assert stderr_units(Measured(0.5), ">", Measured(0.4)) is None


@given(
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0.001, 0.2),
    st.floats(0.001, 0.2),
    st.sampled_from([">", ">=", "<", "<=", "=="]),
    st.floats(0, 0.3),
    st.floats(0, 3),
)
def test_margin_sign_agrees_with_the_verdict(lv, rv, ls, rs, op, tol, k):
    left, right = Measured(lv, ls), Measured(rv, rs)
    status, _ = compare(left, op, right, tol, k)
    margin = stderr_units(left, op, right, tol, k)
    if abs(margin) > 1e-6:  # at the threshold itself strict and non-strict operators differ
        assert (margin > 0) == (status == "pass")


RECORDED = """\
verdicts:
  full:
    run: "a synthetic run"
    claims:
      expert_beats_base (expert=a): pass +5.00
      expert_beats_base (expert=b): fail -1.29
"""


def test_recorded_run_reproduces_its_record(tmp_path, capsys):
    run = write_run(tmp_path, "r", SCORES)
    spec = spec_file(tmp_path, EXPERT_CLAIM, RECORDED)
    assert verify.main([spec, "--run", str(run), "--recorded", "full"]) == 0  # b fails as recorded: not an error
    out = capsys.readouterr().out
    assert "margin (se)" in out and "+4.86" in out  # (0.9 - 0.5) / 0.0583 - 2
    assert "recorded 'full': 2 same, 0 changed (0 of them enforced); 2 of the 2 results are enforced" in out
    assert out.count("same (enforced)") == 2


def test_enforced_change_fails_and_close_change_is_only_reported(tmp_path, capsys):
    spec = spec_file(tmp_path, EXPERT_CLAIM, RECORDED)
    # b now beats the base by 3 se: its recorded fail (-1.29, enforced) changed
    flipped = write_run(tmp_path, "flip", {**SCORES, "task_b": {**SCORES["task_b"], "b": (0.6, 0.05)}})
    assert verify.main([spec, "--run", str(flipped), "--recorded", "full"]) == 1
    assert "changed (enforced)" in capsys.readouterr().out
    # recorded 0.5 se from the threshold: the same change is reported, not enforced
    close = spec_file(tmp_path, EXPERT_CLAIM, RECORDED.replace("fail -1.29", "fail -0.50"))
    assert verify.main([close, "--run", str(flipped), "--recorded", "full"]) == 0
    out = capsys.readouterr().out
    assert "changed (not enforced)" in out and "1 changed (0 of them enforced); 1 of the 2 results" in out


def test_missing_enforced_result_fails(tmp_path, capsys):
    spec = spec_file(tmp_path, EXPERT_CLAIM, RECORDED.replace("(expert=b)", "(expert=c)"))
    assert verify.main([spec, "--run", str(write_run(tmp_path, "r", SCORES)), "--recorded", "full"]) == 1
    assert "missing (enforced)" in capsys.readouterr().out


def test_record_prints_a_block_that_parses_back(tmp_path, capsys):
    run = write_run(tmp_path, "r", SCORES)
    spec = spec_file(tmp_path, EXPERT_CLAIM)
    assert verify.main([spec, "--run", str(run), "--record", "mine"]) == 0
    block = capsys.readouterr().out
    import yaml

    records = parse_records(yaml.safe_load("verdicts:\n" + block)["verdicts"], "verdicts")
    claims = records["mine"].claims
    assert claims["expert_beats_base (expert=a)"] == Recorded("pass", pytest.approx(4.86, abs=0.005))
    assert claims["expert_beats_base (expert=b)"].verdict == "fail"


@pytest.mark.parametrize(
    "raw,field",
    [
        ({"full": {"claims": {"x": "passes"}}}, "verdicts.full.claims.x"),
        ({"full": {"run": "r"}}, "verdicts.full"),
        ({"full": {"claims": {}, "extra": 1}}, "verdicts.full"),
        (["full"], "verdicts"),
    ],
)
def test_malformed_records_name_the_entry(raw, field):
    with pytest.raises(UserError) as err:
        parse_records(raw, "verdicts")
    assert err.value.field == field


def test_unknown_record_is_one_line(tmp_path, capsys):
    spec = spec_file(tmp_path, EXPERT_CLAIM, RECORDED)
    assert verify.main([spec, "--run", str(write_run(tmp_path, "r", SCORES)), "--recorded", "nope"]) == 2
    assert "records no verdicts named 'nope'" in capsys.readouterr().err


def test_enforced_needs_one_stderr_or_no_stderr():
    assert Recorded("pass", 1.0).enforced and Recorded("fail", -3.2).enforced and Recorded("pass", None).enforced
    assert not Recorded("pass", 0.99).enforced and not Recorded("not run", None).enforced


def test_spec_without_verdicts_still_loads(tmp_path):
    from mergeval.verify import load_spec

    assert load_spec(spec_file(tmp_path, EXPERT_CLAIM)).verdicts == {}
    assert set(load_spec(spec_file(tmp_path, EXPERT_CLAIM, RECORDED)).verdicts) == {"full"}


def _record(name: str, **claims: str):
    return parse_records({name: {"run": f"{name}'s machine", "claims": claims}}, "verdicts")[name]


def test_several_records_enforce_only_what_each_holds_a_stderr_from_the_threshold():
    a = _record("a", same="pass +2.50", near="pass +1.10", split="pass +1.03", lone="fail -3.00", exact="pass")
    b = _record("b", same="pass +1.40", near="pass +0.60", split="fail -0.63", exact="pass")
    both = combine([a, b])
    assert both.name == "a + b" and list(both.claims) == ["same", "near", "split", "lone", "exact"]
    assert both.claims["same"] == Recorded("pass", 1.40) and both.claims["same"].enforced  # the smaller margin
    assert both.claims["near"] == Recorded("pass", 0.60) and not both.claims["near"].enforced
    split = both.claims["split"]
    assert split.verdict == "fail / pass" and not split.enforced and split.allows("fail") and split.allows("pass")
    assert not split.allows("undetermined")
    assert not both.claims["lone"].enforced  # b has no such result: nothing to agree on
    assert both.claims["exact"] == Recorded("pass", None) and both.claims["exact"].enforced
    assert combine([a]) is a


@given(st.lists(st.tuples(st.sampled_from(["pass", "fail"]), st.floats(-5, 5)), min_size=1, max_size=4))
def test_a_combined_record_is_never_more_enforced_than_any_of_its_records(entries):
    records = [Record(f"r{i}", "", {"c": Recorded(v, m)}) for i, (v, m) in enumerate(entries)]
    combined = combine(records).claims["c"]
    assert combined.enforced <= all(r.claims["c"].enforced for r in records)
    assert all(combined.allows(r.claims["c"].verdict) for r in records)


def test_verify_holds_a_run_to_what_two_records_agree_on(tmp_path, capsys):
    # b's result differs between the two machines' records: its change is reported, not enforced
    other = (
        RECORDED
        + """\
  other:
    run: "the same run on another machine"
    claims:
      expert_beats_base (expert=a): pass +3.00
      expert_beats_base (expert=b): pass +1.50
"""
    )
    spec = spec_file(tmp_path, EXPERT_CLAIM, other)
    flipped = write_run(tmp_path, "flip", {**SCORES, "task_b": {**SCORES["task_b"], "b": (0.6, 0.05)}})
    assert verify.main([spec, "--run", str(flipped), "--recorded", "full"]) == 1  # one record alone enforces it
    capsys.readouterr()
    assert verify.main([spec, "--run", str(flipped), "--recorded", "full", "--recorded", "other"]) == 0
    out = capsys.readouterr().out
    assert "recorded verdicts 'full + other'" in out and "fail / pass" in out
    # a's result both records hold far from the threshold stays enforced
    lost = write_run(tmp_path, "lost", {**SCORES, "task_a": {**SCORES["task_a"], "a": (0.4, 0.05)}})
    assert verify.main([spec, "--run", str(lost), "--recorded", "full", "--recorded", "other"]) == 1
    assert "changed (enforced)" in capsys.readouterr().out
