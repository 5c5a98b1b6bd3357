"""The spec language as a new user meets it: the two-table spec of docs/specs.md, verified as written, with
planted errors, added rows and a rounding tie; names, strict loading, plain formulas and the search path."""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.verify import evaluate_claim, load_spec
from mergeval.verify.__main__ import main
from mergeval.verify.expr import evaluate, parse_expr

DOC = Path(__file__).resolve().parents[2] / "docs" / "specs.md"


def doc_spec() -> str:
    """The YAML block under "A complete two-table spec" in docs/specs.md, as a user would copy it."""
    match = re.search(r"## A complete two-table spec.*?```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/specs.md lost its two-table example"
    return match.group(1)


def verify(tmp_path, text: str, *args: str, capsys) -> tuple[int, str, str]:
    path = tmp_path / "my_paper.yaml"
    path.write_text(text)
    code = main([str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def set_cell(text: str, row: str, column_index: int, token: str) -> str:
    """The spec text with one printed cell of ``row`` replaced."""
    pattern = re.compile(rf'^(\s+{re.escape(row)}:\s+")([^"]*)(")', re.M)
    match = pattern.search(text)
    tokens = match.group(2).split()
    tokens[column_index] = token
    return text[: match.start(2)] + " ".join(tokens) + text[match.end(2) :]


def add_row(text: str, after: str, line: str) -> str:
    """The spec text with a row line inserted after the row ``after``."""
    return re.sub(
        rf"^(\s+){re.escape(after)}:(.*)$", lambda m: f"{m.group(0)}\n{m.group(1)}{line}", text, count=1, flags=re.M
    )


# the derived cells of the example: (table, row, index of the cell in its row string, printed)
DERIVED = [
    ("main", "Base", 4, "44.52"),
    ("main", "TA", 4, "51.07"),
    ("main", "TIES", 4, "47.53"),
    ("main", "CMM", 4, "56.34"),
    ("steps", "A", 3, "0.446"),
    ("steps", "B", 3, "0.250"),
]
COLUMN = {"main": "Overall", "steps": "Mean"}


def test_the_reference_example_verifies_strictly(tmp_path, capsys):
    code, out, _ = verify(tmp_path, doc_spec(), "--strict", capsys=capsys)
    assert code == 0, out
    assert "6/6 derived cells agree; claims 7 pass, 0 fail, 0 not run" in out


@pytest.mark.parametrize(
    "table,row,index,printed,error", [(*cell, e) for cell in DERIVED for e in (0.3, -0.3) if float(cell[3]) + e >= 0]
)  # below the steps table's range [0, 1]: a load error, below
def test_a_planted_error_of_0_3_in_any_derived_cell_fails_naming_it(
    tmp_path, capsys, table, row, index, printed, error
):
    decimals = len(printed.split(".")[1])
    wrong = float(printed) + error
    code, out, _ = verify(tmp_path, set_cell(doc_spec(), row, index, f"{wrong:.{decimals}f}"), capsys=capsys)
    assert code == 1
    bad = [line.split()[:5] for line in out.splitlines() if "disagree:" in line]
    assert bad == [[table, "/", row, "/", COLUMN[table]]], out


def test_a_printed_value_outside_the_declared_range_is_one_line_naming_the_cell(tmp_path, capsys):
    code, _, err = verify(tmp_path, set_cell(doc_spec(), "B", 3, "-0.050"), capsys=capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(
        f"mergeval: error: {tmp_path}/my_paper.yaml:tables.steps.rows.B: column Mean: -0.050 is outside"
    )


def test_declared_decimals_and_range_are_what_make_the_cells_checkable(tmp_path, capsys):
    """TIES prints MolInst as '0' in a 2-decimal 0-1 column. Without decimals: 0 +- 0.5, x200/13 = +-7.7 points:
    a 0.3 error in TIES' Overall could not fail, and the check says so instead of 'agree'."""
    spec = load_spec(str(_write(tmp_path, doc_spec())))
    ties = {c.at: c for c in spec.check_tables()}["main", "TIES", "Overall"]
    assert ties.lo == pytest.approx((9 * 53.845 + 200 * 0.0 + 72.195 + 60.995) / 13)  # clipped at 0, not -0.005
    assert ties.hi == pytest.approx((9 * 53.855 + 200 * 0.005 + 72.205 + 61.005) / 13)
    loose = doc_spec().replace("    decimals: 2 ", "    # decimals: 2 ", 1)
    assert loose != doc_spec()
    code, out, _ = verify(tmp_path, loose, capsys=capsys)
    assert code == 0 and "main / TIES / Overall" in out and "not checkable" in out
    assert verify(tmp_path, loose, "--strict", capsys=capsys)[0] == 1


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "my_paper.yaml"
    path.write_text(text)
    return path


def _results(tmp_path, text: str) -> dict:
    spec = load_spec(str(_write(tmp_path, text)))
    return {r.id: r for c in spec.claims for r in evaluate_claim(c, None, spec.tables, spec.metrics)}


def test_claims_about_the_best_row_cover_a_row_added_later(tmp_path):
    # a consistent new row: (9*50 + 200*0.25 + 70 + 61) / 13 = 50.0769
    worse = add_row(doc_spec(), "CMM", 'New:  "50.00 0.25 70.00 61.00 50.08"')
    got = _results(tmp_path, worse)
    assert got["cmm_best_overall"].status == "pass"
    assert got["cmm_best_on_gsm8k (model=New)"].status == "pass"  # the quantifier reaches the new row
    assert got["cmm_first_base_last (last=Base)"].status == "pass"
    # a better new row: (9*60 + 200*0.40 + 74 + 64) / 13 = 58.3077: the claim now fails, naming it
    better = add_row(doc_spec(), "CMM", 'New:  "60.00 0.40 74.00 64.00 58.31"')
    got = _results(tmp_path, better)
    assert got["cmm_best_overall"].status == "fail" and "New" in got["cmm_best_overall"].detail
    assert got["cmm_best_on_gsm8k (model=New)"].status == "fail"


def test_a_claim_resting_on_a_rounding_tie_is_undetermined(tmp_path, capsys):
    # Tie: (9*58.40 + 200*0.35 + 73.85 + 63.00) / 13 = 56.3423, printed 56.34 like CMM's: the order of the two
    # true values is anyone's guess
    tie = add_row(doc_spec(), "CMM", 'Tie:  "58.40 0.35 73.85 63.00 56.34"')
    got = _results(tmp_path, tie)
    assert got["cmm_best_overall"].status == "undetermined" and "Tie" in got["cmm_best_overall"].detail
    assert got["cmm_best_on_gsm8k (model=Tie)"].status == "pass"  # 63.75 vs 63.00: settled
    code, out, _ = verify(tmp_path, tie, capsys=capsys)
    assert got["cmm_first_base_last (first=CMM)"].status == "undetermined"
    assert code == 0 and "2 undetermined by rounding" in out
    assert verify(tmp_path, tie, "--strict", capsys=capsys)[0] == 1


def test_any_string_names_a_row_and_prints_as_written(tmp_path, capsys):
    text = """\
        tables:
          grid:
            columns: [0.50, "ARC-C", Avg]
            decimals: 1
            rows:
              [0.4,0.7]: "1.0 3.0 2.0"
              0.50:      "2.0 4.0 3.0"
            derived:
              Avg: {expr: "(`0.50` + `ARC-C`) / 2"}
        claims:
          - id: best_avg
            says: the 0.50 row has the best Avg
            argmax: {table: grid, col: Avg}
            is: 0.50
          - id: above
            says: each row's ARC-C is above 2
            for_each: {r: {rows: grid}}
            left: {table: grid, row: "{r}", col: ARC-C}
            op: ">"
            right: 2
          - id: low_row
            says: the [0.4,0.7] row is lowest at 0.50
            left: {table: grid, row: [0.4,0.7], col: 0.50}
            op: "<"
            right: {table: grid, row: 0.50, col: 0.50}
        """
    code, out, _ = verify(tmp_path, textwrap.dedent(text), "--strict", capsys=capsys)
    assert code == 0, out
    assert "grid / [0.4,0.7] / Avg" in out and "above (r=[0.4,0.7])" in out and "3.0 (0.50)" in out
    assert "[[" not in out


def test_a_duplicated_row_is_an_error_naming_both_lines(tmp_path, capsys):
    doubled = add_row(doc_spec(), "CMM", 'TA:   "52.3  0.30 71.05 62.10 51.07"')
    code, _, err = verify(tmp_path, doubled, capsys=capsys)
    lines = doc_spec().splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("TA:"))
    second = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("CMM:")) + 1
    assert code == 2 and err == (
        f"mergeval: error: {tmp_path}/my_paper.yaml:{second}: key 'TA' is given twice "
        f"(lines {first} and {second}); keep one of them (YAML would silently keep only "
        "the last)\n"
    )


def test_specs_are_found_by_name_on_the_search_path(tmp_path, monkeypatch, capsys):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    (ours / "my_paper.yaml").write_text(doc_spec())
    (theirs / "other.yaml").write_text(doc_spec().replace("name: my_paper", "name: other"))
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[tool.mergeval.specs]\npath = ["../theirs"]\n')
    monkeypatch.chdir(project / "sub")
    monkeypatch.setenv("MERGEVAL_SPECS_PATH", str(ours))
    assert main(["my_paper"]) == 0 and main(["other.yaml"]) == 0
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "my_paper" in listed and "other" in listed and "cmm_chem" in listed
    assert main(["--all", "--strict"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^my_paper: 6/6 derived cells agree.* -> ok", out, re.M)


@pytest.mark.parametrize(
    "text,problem",
    [
        ("a ** 2", "'a ** 2' is not allowed"),
        ("__import__('os')", "is not allowed"),
        ("a.real", "'a.real' is not allowed"),
        ("max(a, key=b)", "is not allowed"),
        ("a if b else c", "is not allowed"),
        ("'a' + b", "is not allowed"),
        ("a +", "is not an arithmetic expression"),
        ("`a + b", "unbalanced backquote"),
    ],
)
def test_expressions_outside_the_whitelist_are_refused(text, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_expr(text)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-10, 10), st.floats(-50, 50), st.floats(0, 2)), min_size=1, max_size=6),
    st.floats(0.5, 20),
    st.floats(0, 1),
)
def test_interval_arithmetic_is_the_exact_range_when_each_name_occurs_once(terms, d_value, d_width):
    """f = (sum c_i x_i) / d with each name once: the interval result equals the min/max over the box's corners
    (f is monotone in each input), and the point value lies inside it."""
    names = [f"x{i}" for i in range(len(terms))]
    text = "(" + " + ".join(f"{c!r} * {n}" for (c, _, _), n in zip(terms, names)) + ") / d"
    expr = parse_expr(text)
    boxes = {n: (v - w, v + w) for (_, v, w), n in zip(terms, names)} | {"d": (d_value, d_value + d_width)}
    lo, hi = evaluate(expr, boxes)
    corners = []
    for mask in range(2 ** (len(terms) + 1)):
        point = {n: boxes[n][(mask >> i) & 1] for i, n in enumerate([*names, "d"])}
        corners.append(math.fsum(c * point[n] for (c, _, _), n in zip(terms, names)) / point["d"])
    assert lo == pytest.approx(min(corners), abs=1e-9) and hi == pytest.approx(max(corners), abs=1e-9)


def test_a_formula_binding_an_unused_name_is_one_line(tmp_path, capsys):
    text = doc_spec().replace(
        'Overall: {expr: "(9*ChemBench + 200*MolInst + DROP + GSM8K) / 13"}',
        'Overall: {expr: "(9*ChemBench + 200*MolInst + DROP + GSM8K) / 13", with: {z: [CMM, DROP]}}',
    )
    code, _, err = verify(tmp_path, text, capsys=capsys)
    assert code == 2 and err.startswith(
        f"mergeval: error: {tmp_path}/my_paper.yaml:tables.main.derived.Overall.expr.with: binds ['z']"
    )


def test_derived_rows_extremes_column_quantifiers_exact_cells_and_lower_is_better(tmp_path, capsys):
    text = """\
        tables:
          ppl:
            columns: [wiki, c4, n_tasks]
            formats: {n_tasks: {exact: true}}
            tolerance: 0.2  # a mean printed to 0.01 of scores printed to 0.1: its window is 0.11
            rows:
              base:   "12.5 15.0 3"
              merged: "11.0 14.0 3"
              Mean:   "11.75 14.5 3"
            derived_rows:
              Mean: {mean: [base, merged]}
          sums:
            columns: [a, b, total]
            rows:
              r: "0.14 0.22 0.4"
            derived_cells:
              - {at: [r, total], expr: "a + b"}
        claims:
          - id: merged_lowest
            says: merged has the lowest perplexity on wiki
            rank: {table: ppl, col: wiki, except: [Mean]}
            first: merged
            best: low
          - id: merged_better_everywhere
            says: merged is below the base on every corpus
            for_each: {corpus: {columns: ppl, except: [n_tasks]}}
            left: {table: ppl, row: merged, col: "{corpus}"}
            op: "<"
            right: {table: ppl, row: base, col: "{corpus}"}
          - id: worst_wiki
            says: the worst wiki perplexity is the base's 12.5
            left: {max: {table: ppl, col: wiki}}
            op: ">"
            right: 12.4
        """
    code, out, _ = verify(tmp_path, textwrap.dedent(text), "--strict", capsys=capsys)
    assert code == 0, out
    for cell in ("ppl / Mean / wiki", "ppl / Mean / c4", "ppl / Mean / n_tasks", "sums / r / total"):
        assert re.search(rf"^  {re.escape(cell)} .* agree$", out, re.M), cell
    assert re.search(r"^  ppl / Mean / n_tasks\s+row Mean: mean\s+3\s+3\s+\[3, 3\]\s+agree$", out, re.M)  # exact
    assert "merged_better_everywhere (corpus=c4)" in out and "corpus=n_tasks" not in out
    # 0.14 + 0.22 is 0.35 .. 0.37: a printed 0.4 (0.35 .. 0.45) agrees, an exact 0.4 does not
    code, out, _ = verify(tmp_path, textwrap.dedent(text).replace('0.22 0.4"', '0.22 0.4!"'), capsys=capsys)
    assert code == 1 and re.search(r"^  sums / r / total .* disagree", out, re.M), out


# ---------------------------------------------------------------- review of issue 14: rough edges

# a 0-1 column (chabsa) rescaled x100 into Overall; nothing declared: Broken merge's '0' is [0, 0.5], 50 points
RESCALED = """\
    tables:
      main:
        columns: [chabsa, qa, Overall]
        range: [0, 100]
        formats: {chabsa: {range: [0, 1]}}
        rows:
          Base:   "0.81 42.11 61.56"
          Broken: "0    2.63  1.32"
        derived:
          Overall: {expr: "(100*chabsa + qa) / 2"}
    """


def test_without_a_tolerance_a_window_too_wide_for_the_cells_own_precision_is_not_checkable(tmp_path, capsys):
    """The default tolerance is 10 units of the derived cell's last printed digit (0.1 for '1.32'): Broken's window
    is ~25 points, so a planted +0.3 ('1.62') is "not checkable", not "agree". Declaring the paper's decimals makes
    it fail; the x50 rescale still leaves windows of 0.26 and 0.52, which a stated tolerance of 0.6 accepts."""
    planted = textwrap.dedent(RESCALED).replace('2.63  1.32"', '2.63  1.62"')
    code, out, _ = verify(tmp_path, planted, capsys=capsys)
    assert code == 0 and re.search(
        r"^  main / Broken / Overall .* not checkable: rounding lets it move by 25.*"
        r"more than the default tolerance 0.1 \(10 units of its last printed digit\)",
        out,
        re.M,
    ), out
    assert verify(tmp_path, planted, "--strict", capsys=capsys)[0] == 1
    declared = planted.replace("    range: [0, 100]\n", "    range: [0, 100]\n    decimals: 2\n")
    code, out, _ = verify(tmp_path, declared, capsys=capsys)  # 0.00 is [0, 0.005]: the planted error is caught
    assert code == 1 and re.search(r"^  main / Broken / Overall .* disagree", out, re.M), out
    correct = declared.replace('1.62"', '1.32"')
    code, out, _ = verify(tmp_path, correct, capsys=capsys)
    assert code == 0 and "0/2 derived cells agree, 2 not checkable" in out, out  # w = 0.26, 0.515 > 0.1
    stated = correct.replace("    decimals: 2\n", "    decimals: 2\n    tolerance: 0.6\n")
    assert verify(tmp_path, stated, "--strict", capsys=capsys)[0] == 0  # a stated tolerance replaces the default
    assert verify(tmp_path, stated.replace('1.32"', '1.62"'), capsys=capsys)[0] == 1


def test_the_default_tolerance_scales_with_the_derived_cells_precision(tmp_path, capsys):
    # a plain mean of inputs printed like it: w = 2 units, whatever the scale
    for row in ('"0.412 0.388 0.400"', '"41.2 38.8 40.0"', '"41 39 40"'):
        text = f"tables: {{t: {{columns: [a, b, m], rows: {{r: {row}}}, derived: {{m: {{mean: [a, b]}}}}}}}}\n"
        code, out, _ = verify(tmp_path, text, "--strict", capsys=capsys)
        assert code == 0 and "1/1 derived cells agree" in out, out
    # a sum of 12 such inputs: w = 13 units > 10
    text = (
        'tables: {t: {columns: [a, s], rows: {r: "1.0 12.0"}, derived_cells: '
        '[{at: [r, s], expr: "a+a+a+a+a+a+a+a+a+a+a+a"}]}}\n'
    )
    code, out, _ = verify(tmp_path, text, capsys=capsys)
    assert "not checkable: rounding lets it move by 1.3, more than the default tolerance 1 " in out, out


def test_a_cell_under_a_derived_column_and_a_derived_row_is_checked_once_by_each_labelled(tmp_path, capsys):
    text = """\
        tables:
          t:
            columns: [x, y, Avg]
            decimals: 1
            rows:
              A:    "1.0 2.0 1.5"
              B:    "3.0 4.0 3.5"
              Mean: "2.0 3.0 2.5"
            derived: {Avg: {mean: [x, y]}}
            derived_rows: {Mean: {mean: [A, B]}}
        """
    code, out, _ = verify(tmp_path, textwrap.dedent(text), "--strict", capsys=capsys)
    assert code == 0, out
    both = [line.split(None, 5)[5] for line in out.splitlines() if line.startswith("  t / Mean / Avg ")]
    assert [b.split()[:3] for b in both] == [["column", "Avg:", "mean"], ["row", "Mean:", "mean"]], out
    spec = load_spec(str(_write(tmp_path, textwrap.dedent(text))))
    assert sorted(c.origin for c in spec.check_tables() if c.at == ("t", "Mean", "Avg")) == ["column Avg", "row Mean"]


def test_intervals_print_with_enough_digits():
    from mergeval.verify.numbers import show_interval

    assert show_interval(0.7415 - 0.742, 0.7425 - 0.742) == "[-0.0005, 0.0005]"
    assert show_interval(12345.675, 12345.685) == "[12345.675, 12345.685]"
    assert show_interval(61.425000000000004, 61.435) == "[61.425, 61.435]"
    assert show_interval(3.0, 3.0) == "[3, 3]"


def test_a_missing_name_is_located_at_the_formulas_key(tmp_path, capsys):
    text = doc_spec().replace("(9*ChemBench + 200*MolInst", "(9*ChemBench + 200*MolInstr")
    code, _, err = verify(tmp_path, text, capsys=capsys)
    assert code == 2 and err.startswith(
        f"mergeval: error: {tmp_path}/my_paper.yaml:tables.main.derived.Overall.expr: "
        "refers to column MolInstr, which table 'main' does not have"
    ), err
    text = doc_spec().replace(
        'Mean: {expr: "mean(`Step 1`, `Step 2`, `Step 3`)"}',
        'Mean: {expr: "mean(`Step 1`, s2, `Step 3`)", with: {s2: [C, Step 2]}}',
    )
    code, _, err = verify(tmp_path, text, capsys=capsys)
    assert code == 2 and "my_paper.yaml:tables.steps.derived.Mean.expr.with.s2: refers to row C," in err, err


def test_a_derived_cell_at_a_blank_cell_is_one_line(tmp_path, capsys):
    # derived columns and rows skip blank cells; a derived_cells entry at one was a traceback (AttributeError)
    text = 'tables: {t: {columns: [a, s], rows: {r: "1.0 -"}, derived_cells: [{at: [r, s], expr: "a+a"}]}}\n'
    code, _, err = verify(tmp_path, text, capsys=capsys)
    assert code == 2 and err == (
        f"mergeval: error: {tmp_path}/my_paper.yaml:tables.t.derived_cells[0].at: [r, s] is a blank cell; "
        "derive a printed cell\n"
    ), err


def test_with_binds_a_fixed_cell_in_derived_and_derived_rows(tmp_path, capsys):
    text = """\
        tables:
          t:
            columns: [x, y, Average, Gain]
            decimals: 2
            rows:
              GPT-4:        "50.00 60.00 55.00 -"
              CMM:          "60.00 62.00 61.00 10.91"
              CMM vs GPT-4: "10.00 2.00 6.00 -"
            derived:
              Gain: {expr: "100 * (Average - b) / b", with: {b: [GPT-4, Average]}}
            derived_rows:
              CMM vs GPT-4: {expr: "CMM - g", with: {g: [GPT-4, x]}}
        """
    code, out, _ = verify(tmp_path, textwrap.dedent(text), capsys=capsys)
    # Gain: 100 * (61 - 55) / 55 = 10.909; CMM vs GPT-4 on y: 62 - 50 = 12, printed 2.00: disagrees, named
    assert code == 1, out
    assert re.search(r"^  t / CMM / Gain .*column Gain: 100 \* \(Average - b\) / b .* agree$", out, re.M), out
    assert re.search(r"^  t / CMM vs GPT-4 / x .*row CMM vs GPT-4: CMM - g .* agree$", out, re.M), out
    assert re.search(r"^  t / CMM vs GPT-4 / y .* disagree", out, re.M), out


def test_quantifiers_leave_derived_summary_rows_and_columns_out(tmp_path):
    text = """\
        tables:
          t:
            columns: [x, y, Best]
            decimals: 1
            rows:
              A:      "5.0 1.0 5.0"
              B:      "3.0 4.0 4.0"
              Oracle: "5.0 4.0 5.0"
            derived: {Best: {expr: "max(x, y)"}}
            derived_rows: {Oracle: {expr: "max(A, B)"}}
        claims:
          - {id: a_best_x, says: A is best on x, argmax: {table: t, col: x}, is: A}
          - {id: a_top, says: A's top cell, left: {max: {table: t, row: A}}, op: "==", right: 5}
          - id: every_row
            says: every row prints x
            for_each: {r: {rows: t}}
            left: {table: t, row: "{r}", col: x}
            op: ">"
            right: 0
          - id: every_column
            says: A's cells are positive
            for_each: {c: {columns: t, except: [Best]}}
            left: {table: t, row: A, col: "{c}"}
            op: ">"
            right: 0
        """
    got = _results(tmp_path, textwrap.dedent(text))
    # the Oracle row (max of A and B) would tie A on x: left out, A is first
    assert got["a_best_x"].status == "pass" and "Oracle" not in got["a_best_x"].detail
    assert sorted(k for k in got if k.startswith("every_row")) == ["every_row (r=A)", "every_row (r=B)"]
    assert sorted(k for k in got if k.startswith("every_column")) == ["every_column (c=x)", "every_column (c=y)"]
    with pytest.raises(UserError, match=r"claims.c.is: 'Oracle' is not in t column x.*summaries, not ranked"):
        load_spec(
            str(
                _write(
                    tmp_path, textwrap.dedent(text) + "  - {id: c, says: s, argmax: {table: t, col: x}, is: Oracle}\n"
                )
            )
        )


@pytest.mark.parametrize("declared,status", [("decimals: 2", "pass"), ("", "undetermined")])
def test_the_docs_tie_example_depends_on_declared_decimals(tmp_path, declared, status):
    text = f"""\
        tables:
          t:
            columns: [v]
            {declared}
            rows: {{TA: "72.33", TIES: "72", CMM: "72.33"}}
        claims:
          - {{id: ge, says: s, left: {{table: t, row: TA, col: v}}, op: ">=", right: {{table: t, row: TIES, col: v}}}}
          - {{id: tie, says: s, left: {{table: t, row: CMM, col: v}}, op: ">", right: {{table: t, row: TA, col: v}}}}
        """
    got = _results(tmp_path, textwrap.dedent(text))
    assert got["ge"].status == status and got["tie"].status == "undetermined"
