"""Paper specs and ``python -m mergeval.verify``: published tables recompute, claims on synthetic
result.json files pass / fail / are not run, rounding propagation, CLI exit codes and errors."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
from hydra import compose, initialize_config_module
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.metrics.groups import group_mean
from mergeval.run.config import register_configs
from mergeval.verify import available, check_tables, compare, evaluate_claim, load_runs, load_spec
from mergeval.verify.__main__ import main
from mergeval.verify.numbers import Printed, corner_range, interval, meets, parse_printed
from mergeval.verify.runs import Measured
from mergeval.verify.tables import parse_tables
from tests.child import run_module

SETTINGS = settings(max_examples=60, deadline=None)
SHIPPED = ["cmm_chem", "cpt_finance", "medical_hier", "mergebench", "quickstart"]


# ---------------------------------------------------------------- the shipped specs


def test_the_five_specs_ship_under_their_names():
    assert available() == SHIPPED
    for name in SHIPPED:
        assert load_spec(name).name == name


@pytest.mark.parametrize("name", SHIPPED)
def test_every_published_table_recomputes_and_published_claims_hold(name):
    spec = load_spec(name)
    checks = check_tables(spec.tables)
    assert all(c.status == "agree" for c in checks), [(c.at, c.detail) for c in checks if not c.ok]
    for claim in spec.claims:
        for result in evaluate_claim(claim, None, spec.tables, spec.metrics):
            expected = "not run" if claim.uses_runs else "pass"
            assert result.status == expected, (result.id, result.detail)


def test_verify_all_checks_every_shipped_spec_strictly(tmp_path, monkeypatch, capsys):
    """What CI runs through the README's test command: every shipped spec's tables agree and its published claims
    pass, none undetermined by rounding or not checkable (run claims are listed as not checked)."""
    monkeypatch.delenv("MERGEVAL_SPECS_PATH", raising=False)
    monkeypatch.chdir(tmp_path)  # no pyproject.toml search path: the shipped specs only
    code = main(["--all", "--strict"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")] == SHIPPED
    assert out.count("-> ok") == len(SHIPPED)


def test_verify_all_fails_when_a_spec_on_the_path_fails(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.yaml").write_text(
        'tables: {t: {columns: [a, b, avg], rows: {r: "1.00 2.00 1.60"}, derived: {avg: {mean: [a, b]}}}}\n'
    )
    (tmp_path / "broken.yaml").write_text("tables: [\n")
    monkeypatch.setenv("MERGEVAL_SPECS_PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["--all"])
    out = capsys.readouterr().out
    assert code == 2  # an invalid spec outranks a failing one; both are reported, and the shipped ones still run
    assert "bad: 0/1 derived cells agree, 1 disagree" in out and "cell bad.yaml" not in out
    assert "  cell t / r / avg (column avg): disagree" in out
    assert f"broken: mergeval: error: {tmp_path}/broken.yaml: is not valid YAML" in out  # the path it was found at
    assert "cmm_chem: 10/10 derived cells agree" in out


def test_the_cmm_spec_holds_the_tables_the_issue_asks_for():
    spec = load_spec("cmm_chem")
    checks = {c.at: c for c in check_tables(spec.tables)}
    assert len(spec.tables["chembench_gpt4_vs_cmm"].columns) == 10  # 9 tasks + Average
    assert len(spec.tables["general_domain"].columns) == 8  # 7 benchmarks + Avg
    overall = checks["overall_without_weak_experts", "Merged model (without GeLLMO and Meerkat)", "Overall Average"]
    # (9 * 61.41 + 2 * 100 * 0.35) / 11, with Mol-Instructions' +-0.005 rescaled to +-0.5
    assert overall.recomputed == pytest.approx((9 * 61.41 + 200 * 0.35) / 11)
    assert overall.hi - overall.lo == pytest.approx(2 * (9 * 0.005 + 2 * 100 * 0.005) / 11)
    gpt4 = checks["chembench_gpt4_vs_cmm", "GPT-4", "Average"]
    assert gpt4.hi - gpt4.lo == pytest.approx(1.0)  # integers are known to +-0.5, so is their mean


def test_the_cmm_overall_metric_on_a_run_matches_the_published_derivation(tmp_path):
    spec = load_spec("cmm_chem")
    tasks = [t for g in spec.metrics["overall"].body["groups"].values() for t in g]
    scores = {t: 0.6141 if t.startswith("chembench") else 0.35 for t in tasks}
    path = write_run(
        tmp_path, "r", scores={t: {"merged": (s, 0.01)} for t, s in scores.items()}, modelset="cmm_chem", experts={}
    )
    measured = spec.metrics["overall"].measure(load_runs([str(path)])[0], "merged")
    assert measured.value == pytest.approx((9 * 61.41 + 2 * 35) / 11)
    assert measured.stderr == pytest.approx(100 * 0.01 * math.sqrt(11) / 11)  # 11 equal weights 100/11


@pytest.mark.parametrize("name", SHIPPED)
def test_every_setup_composes_with_hydra(name):
    register_configs()
    spec = load_spec(name)
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        for setup in spec.setups.values():
            cfg = compose("config", overrides=[f"+experiment={setup['experiment']}"])
            assert cfg.modelset.name and cfg.benchmark.name and cfg.method.name


def test_the_general_cmm_setup_names_real_models_and_lm_eval_tasks():
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=cmm_general"])
    assert cfg.modelset.base == "hf:meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.modelset.experts.storm.source == "hf:akjindal53244/Llama-3.1-Storm-8B"
    assert list(cfg.benchmark.tasks) == ["mmlu", "ifeval", "arc_challenge", "drop", "bbh", "gsm8k"]


# ---------------------------------------------------------------- printed numbers and rounding


def test_parse_printed():
    assert parse_printed("46.00") == Printed("46.00", 46.0, 2)
    assert parse_printed("55").half_width == 0.5
    assert parse_printed("+21.83").value == 21.83 and parse_printed("\u22128.33").value == -8.33
    assert parse_printed("0.650").half_width == pytest.approx(0.0005)
    assert parse_printed("-") is None
    assert parse_printed("100!") == Printed("100", 100.0, 0, exact=True) and parse_printed("100!").half_width == 0
    for bad in ("1e3", "12%", "abc", "1.2.3", "", "!", "1!!"):
        with pytest.raises(ValueError):
            parse_printed(bad)


def _print(x: float, d: int) -> str:
    return f"{x:.{d}f}"


@SETTINGS
@given(
    st.lists(st.tuples(st.floats(0, 100), st.integers(0, 3)), min_size=1, max_size=8),
    st.integers(0, 3),
    st.sampled_from([1.0, 100.0]),
)
def test_a_correctly_rounded_table_always_recomputes(cells, out_decimals, scale):
    """Print true inputs with their decimals, print the true derived value: verify must agree."""
    columns = [f"c{i}" for i in range(len(cells))]
    true_inputs = [x for x, _ in cells]
    n_scaled = len(cells) // 2  # a rescaled group, as in CMM's overall score
    groups = {"a": columns[n_scaled:], **({"b": columns[:n_scaled]} if n_scaled else {})}
    truth = group_mean(dict(zip(columns, true_inputs)), groups, {"b": scale} if n_scaled else None)
    row = " ".join(_print(x, d) for x, d in cells) + " " + _print(truth, out_decimals)
    raw = {
        "t": {
            "columns": columns + ["out"],
            "rows": {"r": row},
            "tolerance": 1e6,  # agreement, not its width
            "derived": {"out": {"group_mean": {"groups": groups, **({"scale": {"b": scale}} if n_scaled else {})}}},
        }
    }
    (check,) = check_tables(parse_tables(raw, "tables"))
    assert check.status == "agree", check


@SETTINGS
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-50, 50), st.integers(0, 3)), min_size=1, max_size=8))
def test_a_linear_derivation_carries_the_weighted_sum_of_half_widths(terms):
    """For f = sum c_i x_i the corners give exactly  hi - lo = 2 * sum |c_i| h_i."""
    coeffs = [c for c, _, _ in terms]
    values = [v for _, v, _ in terms]
    widths = [0.5 * 10.0**-d for _, _, d in terms]
    lo, hi = corner_range(
        lambda xs: math.fsum(c * x for c, x in zip(coeffs, xs)), [(v - h, v + h) for v, h in zip(values, widths)]
    )
    assert hi - lo == pytest.approx(2 * math.fsum(abs(c) * h for c, h in zip(coeffs, widths)), abs=1e-9)


@SETTINGS
@given(st.floats(-100, 100), st.integers(0, 3), st.floats(0, 10))
def test_agreement_is_exactly_interval_overlap(p, decimals, gap):
    printed = parse_printed(_print(p, decimals))
    h = printed.half_width
    box = interval(printed)
    assert box == pytest.approx((printed.value - h, printed.value + h))
    lo = printed.value + h + gap + 1e-6  # strictly above the printed value's rounding interval
    assert not meets(box, (lo, lo + 1.0))
    assert meets(box, (printed.value + h - 1e-12, lo + 1.0))


def test_a_wrong_derived_value_is_reported_with_the_difference():
    raw = {
        "t": {"columns": ["a", "b", "avg"], "rows": {"r": "1.00 2.00 1.60"}, "derived": {"avg": {"mean": ["a", "b"]}}}
    }
    (check,) = check_tables(parse_tables(raw, "tables"))
    assert check.status == "disagree" and not check.ok and "+0.1" in check.detail


@pytest.mark.parametrize("by,status", [(0.1, "recorded"), ("0.10", "recorded"), (0.3, "record-wrong")])
def test_a_recorded_discrepancy_passes_only_when_it_matches(by, status):
    raw = {
        "t": {
            "columns": ["a", "b", "avg"],
            "rows": {"r": "1.00 2.00 1.60"},
            "derived": {"avg": {"mean": ["a", "b"]}},
            "discrepancies": [{"at": ["r", "avg"], "by": by, "note": "typo in the paper"}],
        }
    }
    (check,) = check_tables(parse_tables(raw, "tables"))
    assert check.status == status and check.ok == (status == "recorded")


def test_a_discrepancy_record_on_a_cell_that_recomputes_fails():
    raw = {
        "t": {
            "columns": ["a", "b", "avg"],
            "rows": {"r": "1.00 2.00 1.50"},
            "derived": {"avg": {"mean": ["a", "b"]}},
            "discrepancies": [{"at": ["r", "avg"], "by": 0.1, "note": "stale"}],
        }
    }
    (check,) = check_tables(parse_tables(raw, "tables"))
    assert check.status == "record-wrong" and not check.ok


def test_cross_table_normalized_and_macro_derivations():
    raw = {
        "run": {
            "columns": ["base", "e1", "e2", "merged", "norm"],
            "rows": {"t1": "0.50 0.90 0.40 0.80 0.75", "t2": "0.20 0.20 0.60 0.50 -"},
        },
        "agg": {
            "columns": ["gain"],
            "rows": {"x": "+12.50"},
            "tolerance": 2.5,  # 0.01-wide fractions, in points
            "derived_cells": [
                {
                    "at": ["x", "gain"],
                    "macro_gain": {
                        "merged": [["run", "t1", "merged"], ["run", "t2", "merged"]],
                        "constituents": [
                            [["run", "t1", "e1"], ["run", "t2", "e1"]],
                            [["run", "t1", "e2"], ["run", "t2", "e2"]],
                        ],
                        "scale": "percent",
                    },
                }
            ],
        },
    }
    raw["run"]["derived_cells"] = [
        {
            "at": ["t1", "norm"],
            "normalized": {"merged": ["t1", "merged"], "base": ["t1", "base"], "expert": ["t1", "e1"]},
        }
    ]
    checks = {c.at: c for c in check_tables(parse_tables(raw, "tables"))}
    assert checks["run", "t1", "norm"].recomputed == pytest.approx(0.75)
    assert checks["agg", "x", "gain"].recomputed == pytest.approx(100 * (0.65 - (0.55 + 0.5) / 2))
    assert all(c.ok for c in checks.values())


# ---------------------------------------------------------------- the claim language


@pytest.mark.parametrize(
    "left,op,right,tol,k,ok",
    [
        ((1.0, 0), ">", (0.9, 0), 0, 0, True),
        ((0.9, 0), ">", (0.9, 0), 0, 0, False),
        ((0.9, 0), ">=", (0.9, 0), 0, 0, True),
        ((0.85, 0), ">", (0.9, 0), 0.1, 0, True),  # tolerance is lenient
        ((1.0, 0.03), ">", (0.9, 0.04), 0, 1.9, True),  # gap 0.1 > 1.9 x se 0.05
        ((1.0, 0.03), ">", (0.9, 0.04), 0, 2.1, False),  # stderr margin is strict
        ((0.1, 0), "<", (0.2, 0), 0, 0, True),
        ((0.3, 0), "<=", (0.2, 0), 0, 0, False),
        ((0.50, 0.03), "==", (0.55, 0.04), 0, 1.1, True),  # |diff| 0.05 <= 1.1 x se 0.05
        ((0.50, 0), "==", (0.55, 0), 0.04, 0, False),
    ],
)
def test_compare(left, op, right, tol, k, ok):
    got, _ = compare(Measured(*left), op, Measured(*right), tol, k)
    assert got == ("pass" if ok else "fail")


@pytest.mark.parametrize(
    "left,op,right,tol,status",
    [
        ((72.33, 72.325, 72.335), ">=", (72.0, 71.5, 72.5), 0, "undetermined"),  # 72.33 vs 72 +- 0.5
        ((72.33, 72.325, 72.335), ">=", (72.0, 71.5, 72.5), 0.9, "pass"),  # lenient enough to cover the tie
        ((70.0, 69.95, 70.05), ">", (70.0, 69.95, 70.05), 0, "undetermined"),  # equal printed values
        ((70.2, 70.15, 70.25), ">", (70.0, 69.95, 70.05), 0, "pass"),
        ((70.0, 69.95, 70.05), ">", (70.2, 70.15, 70.25), 0, "fail"),
        ((1.0, 0.95, 1.05), "==", (1.0, 1.0, 1.0), 0.05, "pass"),
        ((1.0, 0.95, 1.05), "==", (1.0, 1.0, 1.0), 0.01, "undetermined"),
        ((1.2, 1.15, 1.25), "==", (1.0, 1.0, 1.0), 0.1, "fail"),
        ((0.5, 0.45, 0.55), "<", (0.5, 0.5, 0.5), 0, "undetermined"),
    ],
)
def test_compare_on_rounding_intervals_is_three_valued(left, op, right, tol, status):
    """pass when the relation holds for every value in the intervals, fail when for none, else undetermined."""
    value, lo, hi = left
    r_value, r_lo, r_hi = right
    got, detail = compare(Measured(value, lo=lo, hi=hi), op, Measured(r_value, lo=r_lo, hi=r_hi), tol)
    assert got == status, detail


@SETTINGS
@given(
    st.floats(-1, 1),
    st.floats(-1, 1),
    st.floats(0, 0.1),
    st.floats(0, 0.1),
    st.sampled_from([">", ">=", "<", "<="]),
    st.floats(0, 0.5),
    st.floats(0, 0.5),
    st.floats(0, 3),
    st.floats(0, 3),
)
def test_tolerance_is_lenient_and_stderr_margin_strict(lv, rv, ls, rs, op, t1, t2, k1, k2):
    left, right = Measured(lv, ls), Measured(rv, rs)
    t_lo, t_hi = sorted((t1, t2))
    k_lo, k_hi = sorted((k1, k2))
    if compare(left, op, right, t_lo, 0)[0] == "pass":
        assert compare(left, op, right, t_hi, 0)[0] == "pass"
    if compare(left, op, right, 0, k_hi)[0] == "pass":
        assert compare(left, op, right, 0, k_lo)[0] == "pass"


def write_run(
    tmp_path, name, scores, method="task_arithmetic", modelset="demo", params=None, experts=None, aggregates=None
):
    """A result.json as python -m mergeval writes it (only the fields verify reads)."""
    experts = {"a": "task_a", "b": "task_b"} if experts is None else experts
    config = {
        "method": {"name": method, **(params or {})},
        "modelset": {"name": modelset, "experts": {e: {"task": t} for e, t in experts.items()}},
        "benchmark": {"name": "demo", "n_items": 16},
    }
    models = [
        {"role": "base", "task": None},
        *({"role": e, "task": t} for e, t in experts.items()),
        {"role": "merged", "task": None},
    ]
    result = {
        "config": config,
        "models": models,
        "scores": {
            t: {r: {"acc": a, "stderr": s, "n": 16} for r, (a, s) in by_role.items()} for t, by_role in scores.items()
        },
        "aggregates": aggregates
        or {"macro_gain": 5.0, "macro_og": -1.0, "normalized": {"task_a": 0.9, "task_b": None}},
    }
    path = tmp_path / name / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return path


SCORES = {
    "task_a": {"base": (0.5, 0.05), "a": (0.9, 0.03), "b": (0.5, 0.05), "merged": (0.8, 0.04)},
    "task_b": {"base": (0.3, 0.05), "a": (0.3, 0.05), "b": (0.35, 0.05), "merged": (0.32, 0.05)},
    "general": {"base": (0.7, 0.05), "a": (0.6, 0.05), "b": (0.7, 0.05), "merged": (0.65, 0.05)},
}


def spec_file(tmp_path, claims: str, extra: str = "") -> str:
    path = tmp_path / "demo.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: demo
        title: a synthetic spec
        citation: {authors: nobody}
        setups: {default: {experiment: tiny}}
        metrics:
          avg: {mean: {tasks: null, scale: 100}}
          forgetting: {forgetting: {tasks: null}}
        """)
        + textwrap.dedent(extra)
        + "claims:\n"
        + textwrap.indent(textwrap.dedent(claims), "  ")
    )
    return str(path)


EXPERT_CLAIM = """\
- id: expert_beats_base
  says: each expert beats the base on its own task
  for_each: expert
  left: {score: {task: "{task}", role: "{expert}"}}
  op: ">"
  right: {score: {task: "{task}", role: base}}
  stderr_margin: 2
"""


def outcomes(spec_path, run_paths):
    spec = load_spec(spec_path)
    runs = load_runs([str(p) for p in run_paths]) if run_paths is not None else None
    return {r.id: r for c in spec.claims for r in evaluate_claim(c, runs, spec.tables, spec.metrics)}


def test_expert_claim_passes_fails_per_expert(tmp_path):
    run = write_run(tmp_path, "r", SCORES)
    got = outcomes(spec_file(tmp_path, EXPERT_CLAIM), [run])
    assert got["expert_beats_base (expert=a)"].status == "pass"  # 0.9 vs 0.5, 6.9 se
    assert got["expert_beats_base (expert=b)"].status == "fail"  # 0.35 vs 0.3, 0.7 se < 2
    assert got["expert_beats_base (expert=b)"].left == Measured(0.35, 0.05)


def test_sweep_spread_over_runs(tmp_path):
    runs = [
        write_run(tmp_path, f"ta{lam}", SCORES, params={"lambda_": lam}, aggregates={"macro_gain": g, "macro_og": 0})
        for lam, g in ((0.5, 1.0), (1.0, 9.0))
    ]
    runs += [
        write_run(
            tmp_path, f"ties{lam}", SCORES, "ties", params={"lambda_": lam}, aggregates={"macro_gain": g, "macro_og": 0}
        )
        for lam, g in ((0.5, 4.0), (1.0, 5.5))
    ]
    claim = """\
        - id: ties_robust
          says: TIES varies less than TA across lambda
          left: {where: {method: ties}, metric: macro_gain, over_runs: range}
          op: "<"
          right: {where: {method: task_arithmetic}, metric: macro_gain, over_runs: range}
        - id: ta_best_at_one
          says: TA's best lambda is 1
          left: {where: {method: task_arithmetic, method.lambda_: 1.0}, metric: macro_gain}
          op: "=="
          right: {where: {method: task_arithmetic}, metric: macro_gain, over_runs: max}
        - id: ta_gains_at_each_lambda
          says: TA gains at every lambda (a numeric variable stays a number in where)
          for_each: {lam: [0.5, 1.0]}
          left: {where: {method: task_arithmetic, method.lambda_: "{lam}"}, metric: macro_gain}
          op: ">"
          right: 0
        """
    got = outcomes(spec_file(tmp_path, claim), runs)
    assert got["ta_gains_at_each_lambda (lam=0.5)"].left.value == 1.0
    assert got["ta_gains_at_each_lambda (lam=1.0)"].status == "pass"
    assert got["ties_robust"].status == "pass" and got["ties_robust"].left.value == 1.5
    assert got["ties_robust"].right.value == 8.0
    assert got["ta_best_at_one"].status == "pass"
    only_one_ties = outcomes(spec_file(tmp_path, claim), runs[:3])
    assert only_one_ties["ties_robust"].status == "not run" and "needs 2+" in only_one_ties["ties_robust"].detail


def test_three_expert_merge_against_two_expert_merges(tmp_path):
    three = {t: dict(r, c=(0.2, 0.02)) for t, r in SCORES.items()}
    three["task_c"] = {"base": (0.1, 0.02), "a": (0.1, 0.02), "b": (0.1, 0.02), "c": (0.6, 0.05), "merged": (0.1, 0.02)}
    runs = [
        write_run(tmp_path, "two", SCORES),
        write_run(tmp_path, "three", three, experts={"a": "task_a", "b": "task_b", "c": "task_c"}),
    ]
    claim = """\
        - id: three_below_two
          says: a three-expert merge scores below the best two-expert merge
          left: {where: {n_experts: 3}, metric: avg, over_runs: max}
          op: "<"
          right: {where: {n_experts: 2}, metric: avg, over_runs: max}
        """
    got = outcomes(spec_file(tmp_path, claim), runs)["three_below_two"]
    assert got.status == "pass"
    assert got.right.value == pytest.approx(100 * (0.8 + 0.32 + 0.65) / 3)


def test_spec_metrics_propagate_stderr(tmp_path):
    run = load_runs([str(write_run(tmp_path, "r", SCORES))])[0]
    spec = load_spec(spec_file(tmp_path, EXPERT_CLAIM))
    avg = spec.metrics["avg"].measure(run, "merged")
    assert avg.value == pytest.approx(100 * (0.8 + 0.32 + 0.65) / 3)
    assert avg.stderr == pytest.approx(100 * math.sqrt(0.04**2 + 0.05**2 + 0.05**2) / 3)
    forget = spec.metrics["forgetting"].measure(run, "merged")  # general = the task no expert owns
    assert forget.value == pytest.approx(0.05) and forget.stderr == pytest.approx(math.sqrt(0.05**2 * 2))


@pytest.mark.parametrize(
    "claim,reason",
    [
        (
            """- {id: c, says: s, left: {where: {method: cmm}, metric: macro_gain}, op: ">", right: 0}""",
            "no run matches",
        ),
        ("""- {id: c, says: s, left: {score: {task: nope, role: merged}}, op: ">", right: 0}""", "no score for role"),
        ("""- {id: c, says: s, left: {metric: normalized.task_b}, op: ">", right: 0}""", "undefined"),
        ("""- {id: c, says: s, left: {metric: avg, role: ghost}, op: ">", right: 0}""", "no score for role 'ghost'"),
        (
            """- {id: c, says: s, left: {where: {method: ties}, metric: macro_gain}, op: ">",
           right: {where: {method: task_arithmetic}, metric: macro_gain}}""",
            "runs match",
        ),
    ],
)
def test_claims_the_runs_cannot_evaluate_are_not_run(tmp_path, claim, reason):
    runs = [
        write_run(tmp_path, "ta1", SCORES),
        write_run(tmp_path, "ta2", SCORES, params={"lambda_": 0.5}),
        write_run(tmp_path, "ties", SCORES, "ties"),
    ]
    got = list(outcomes(spec_file(tmp_path, claim), runs).values())
    assert got and all(r.status == "not run" and reason in r.detail for r in got), [r.detail for r in got]


def test_without_runs_run_claims_are_not_run(tmp_path):
    got = outcomes(spec_file(tmp_path, EXPERT_CLAIM), None)
    assert [r.status for r in got.values()] == ["not run"]


@pytest.mark.parametrize(
    "claim,field",
    [
        ("""- {id: c, says: s, left: 1, op: "=>", right: 0}""", "claims.c.op"),
        ("""- {id: c, says: s, left: {metric: nope}, op: ">", right: 0}""", "claims.c.left.metric"),
        ("""- {id: c, says: s, left: {score: {task: "{oops}", role: base}}, op: ">", right: 0}""", "claims.c"),
        (
            """- {id: c, says: s, for_each: expert, left: {metric: macro_gain, over_runs: max}, op: ">", right: 0}""",
            "claims.c.for_each",
        ),
        ("""- {id: c, says: s, left: {table: t, row: r, col: nope}, op: ">", right: 0}""", "claims.c.left"),
        ("""- {id: c, says: s, left: 1, op: ">", right: 0, tolerance: -1}""", "claims.c.tolerance"),
        (
            """- {id: c, says: s, left: 1, op: ">", right: 0}\n- {id: c, says: s, left: 1, op: ">", right: 0}""",
            "claims.c.id",
        ),
        ("""- {id: c, says: s, argmax: {table: t, col: a}, is: nobody}""", "claims.c.is"),
        ("""- {id: c, says: s, argmax: {table: t, col: a, except: [ghost]}, is: r}""", "claims.c.argmax.except"),
        ("""- {id: c, says: s, argmax: {table: t, col: zz}, is: r}""", "claims.c.argmax"),
        ("""- {id: c, says: s, argmax: {table: t, col: a}, is: r, op: ">"}""", "claims.c"),
        ("""- {id: c, says: s, rank: {table: t, col: a}}""", "claims.c"),
        ("""- {id: c, says: s, for_each: {x: {rows: nope}}, left: 1, op: ">", right: 0}""", "claims.c.for_each.x.rows"),
        (
            """- {id: c, says: s, for_each: {x: {rows: t, except: [ghost]}}, left: 1, op: ">", right: 0}""",
            "claims.c.for_each.x.except",
        ),
        ("""- {id: c, says: s, left: {max: {table: t, col: a, row: r}}, op: ">", right: 0}""", "claims.c.left.max"),
        (
            """- {id: c, says: s, left: {metric: macro_gain, over_runs: median}, op: ">", right: 0}""",
            "claims.c.left.over_runs",
        ),
    ],
)
def test_invalid_claims_fail_at_load_naming_the_field(tmp_path, claim, field):
    tables = 'tables: {t: {columns: [a], rows: {r: "1.0", q: "2.0"}}}\n'
    path = spec_file(tmp_path, claim, tables)
    with pytest.raises(UserError) as err:
        load_spec(path)
    assert err.value.field == f"{path}:{field}", err.value  # the spec as given: here, a path


# ---------------------------------------------------------------- the command line


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", SHIPPED)
def test_cli_published_checks_exit_0(capsys, name):
    code, out, _ = run_cli(capsys, name)
    assert code == 0 and "-> exit 0" in out


def test_cli_exit_codes_with_runs(tmp_path, capsys):
    run = write_run(tmp_path, "r", SCORES)
    passing = "- {id: ok, says: s, tags: [t], left: {score: {task: task_a, role: a}}, op: '>', right: 0.5}\n"
    failing = "- {id: bad, says: s, tags: [t], left: {score: {task: task_b, role: b}}, op: '>', right: 0.5}\n"
    missing = "- {id: gone, says: s, tags: [u], left: {where: {method: cmm}, metric: macro_gain}, op: '>', right: 0}\n"
    assert run_cli(capsys, spec_file(tmp_path, passing), "--run", str(run))[0] == 0
    assert run_cli(capsys, spec_file(tmp_path, passing + failing), "--run", str(run))[0] == 1
    spec = spec_file(tmp_path, passing + missing)
    assert run_cli(capsys, spec)[0] == 0  # no --run: run claims are listed, not counted
    code, out, _ = run_cli(capsys, spec, "--run", str(run))  # a claim the runs cannot evaluate does not count
    assert code == 0 and "not counted; --strict fails on them" in out
    assert run_cli(capsys, spec, "--run", str(run), "--strict")[0] == 1  # unless asked: then it is not a pass
    code, out, _ = run_cli(capsys, spec, "--run", str(tmp_path), "--tag", "t")  # a directory of runs, one tag
    assert code == 0 and "gone" not in out
    assert run_cli(capsys, spec, "--run", str(run), "--claim", "ok")[0] == 0


def test_runs_that_evaluate_none_of_the_run_claims_are_one_line_exit_2(tmp_path, capsys):
    """Another spec's runs once gave exit 0, every run claim "not run" (a pass unless --strict)."""
    run = write_run(tmp_path, "r", SCORES)
    missing = "- {id: gone, says: s, left: {where: {method: cmm}, metric: macro_gain}, op: '>', right: 0}\n"
    code, out, err = run_cli(capsys, spec_file(tmp_path, missing), "--run", str(run))
    assert code == 2 and out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("mergeval: error: --run: the 1 run(s) given evaluate none of spec demo's 1 run claim checks")
    assert run_cli(capsys, spec_file(tmp_path, missing))[0] == 0  # without --run they are listed, as before


def test_cli_fails_on_a_table_that_does_not_recompute(tmp_path, capsys):
    extra = 'tables: {t: {columns: [a, b, avg], rows: {r: "1.00 2.00 1.60"}, derived: {avg: {mean: [a, b]}}}}\n'
    code, out, _ = run_cli(capsys, spec_file(tmp_path, "[]\n", extra))
    assert code == 1 and "disagree" in out


@pytest.mark.parametrize(
    "content,field",
    [
        ("name: x\n  bad: [", "demo.yaml: is not valid YAML at line"),
        (
            "name: x\ntitle: t\ncitation: {}\nsetups: {d: {experiment: tiny}}\ncolour: red\n",
            "demo.yaml: unknown keys ['colour']",
        ),
        ("name: x\ntitle: t\n", "demo.yaml: has neither tables nor claims"),
        (
            "tables:\n  t:\n    columns: [a]\n    rows:\n      r: '1.0'\n      r: '2.0'\n",
            "demo.yaml:6: key 'r' is given twice (lines 5 and 6)",
        ),
        (
            "tables: {t: {columns: [a], range: [0, 1], rows: {r: '1.5'}}}\n",
            "demo.yaml:tables.t.rows.r: column a: 1.5 is outside",
        ),
        (
            "tables: {t: {columns: [a], formats: {b: {decimals: 2}}, rows: {r: '1.5'}}}\n",
            "demo.yaml:tables.t.formats.b",
        ),
        ("tables: {t: {columns: [a], decimals: -1, rows: {r: '1.5'}}}\n", "demo.yaml:tables.t.decimals"),
        (
            "tables: {t: {columns: [a, b], rows: {r: '1.5 2'}, derived: {b: {expr: 'a ** 2'}}}}\n",
            "demo.yaml:tables.t.derived.b.expr: 'a ** 2' is not allowed",
        ),
        (
            "tables: {t: {columns: [a, b], rows: {r: '1.5 2'}, derived: {b: {expr: 'open(a)'}}}}\n",
            "demo.yaml:tables.t.derived.b.expr: 'open(a)' is not allowed",
        ),
        (
            "tables: {t: {columns: [a, b], rows: {r: '1.5 2'}, derived: {b: {expr: 'a + c'}}}}\n",
            "demo.yaml:tables.t.derived.b.expr: refers to column c, which table 't' does not have",
        ),
        (
            "tables: {t: {columns: [a, b], rows: {r: '1.5 2'}, derived: {b: {mean: [a, c]}}}}\n",
            "demo.yaml:tables.t.derived.b.mean[1]: refers to column c, which table 't' does not have",
        ),
        ("tables: {t: {columns: [a, a], rows: {r: '1.5 2'}}}\n", "demo.yaml:tables.t.columns: lists column a twice"),
        (
            "tables: {t: {columns: [a, b], rows: {r: '0 2'}, derived: {b: {expr: '1 / a'}}}}\n",
            "demo.yaml:tables.t.derived.b.expr: at [r, b]: 'a' can be 0 within its inputs' rounding ([-0.5, 0.5])",
        ),
        (
            "tables: {t: {columns: [a, b], decimals: 3, rows: {r: '0.742 2'}, derived: {b: {expr: '1 / (a - 0.742)'}}}}\n",
            "demo.yaml:tables.t.derived.b.expr: at [r, b]: 'a - 0.742' can be 0 within its inputs' rounding "
            "([-0.0005, 0.0005])",
        ),
        (
            "name: x\ntitle: t\ncitation: {}\nsetups: {d: {experiment: nope}}\nclaims: []\n",
            "demo.yaml:setups.d.experiment",
        ),
        (
            "name: x\ntitle: t\ncitation: {}\nsetups: {d: {experiment: tiny}}\ntables: {t: {columns: [a, b], rows: {r: '1.0'}}}\n",
            "demo.yaml:tables.t.rows.r: has 1 cells for 2 columns",
        ),
        (
            "name: x\ntitle: t\ncitation: {}\nsetups: {d: {experiment: tiny}}\ntables: {t: {columns: [a], rows: {r: '1,0'}}}\n",
            "demo.yaml:tables.t.rows.r",
        ),
    ],
)
def test_cli_invalid_spec_is_one_line_exit_2(tmp_path, monkeypatch, capsys, content, field):
    (tmp_path / "demo.yaml").write_text(content)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "demo.yaml")  # errors name the spec as given
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"mergeval: error: {field}"), err
    code, _, err = run_cli(capsys, str(tmp_path / "demo.yaml"))
    assert err.startswith(f"mergeval: error: {tmp_path}/{field}"), err


@pytest.mark.parametrize(
    "args,field",
    [
        (["--tag", "nope"], "--tag"),
        (["--claim", "nope"], "--claim"),
        (["--run", "/no/such/result.json"], "--run"),
    ],
)
def test_cli_bad_selection_or_run_is_one_line_exit_2(capsys, args, field):
    code, _, err = run_cli(capsys, "quickstart", *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"mergeval: error: {field}:"), err


def test_cli_unreadable_result_json_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "result.json"
    bad.write_text("{not json")
    code, _, err = run_cli(capsys, "quickstart", "--run", str(bad))
    assert code == 2 and "is not readable JSON" in err and err.count("\n") == 1


def test_python_m_verify_missing_spec_one_line_no_traceback(tmp_path):
    out = run_module("mergeval.verify", "no_such_spec", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "mergeval: error: spec: no spec file or spec named 'no_such_spec'; give a path to a spec YAML or one of: "
        + ", ".join(SHIPPED)
        + " (search path: $MERGEVAL_SPECS_PATH, [tool.mergeval.specs] path, the shipped specs)"
    ]


def test_no_spec_calls_a_registered_method_missing():
    """One truth: a spec method mapped to mergeval names a registered method, and one marked missing (null) is
    not one mergeval has under that name."""
    from mergeval.methods import METHODS
    from mergeval.verify import available, load_spec

    for name in available():
        for setup in load_spec(name).setups.values():
            methods = setup.get("methods") or {}
            for label, entry in methods.items():
                if not isinstance(entry, dict) or "mergeval" not in entry:
                    continue
                key = label.lower().replace("-", "_").replace(" ", "_")
                if entry["mergeval"] is None:
                    assert key not in METHODS, f"{name}: {label} is marked missing but mergeval has {key}"
                else:
                    assert entry["mergeval"] in METHODS, f"{name}: {label} -> {entry['mergeval']} is not registered"


def test_every_preset_a_spec_names_is_a_method_option_of_that_method_in_the_papers_folder():
    """A spec's ``preset:`` is the ``method=`` option a sweep chooses: a file of ``conf/method/<spec>/`` (the
    paper's hyperparameters live with its experiments) whose method is the entry's ``mergeval``."""
    from hydra import compose, initialize_config_module

    from mergeval.run.config import register_configs
    from mergeval.verify import available, load_spec

    register_configs()
    seen = 0
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        for name in available():
            for setup in load_spec(name).setups.values():
                for label, entry in (setup.get("methods") or {}).items():
                    if isinstance(entry, dict) and entry.get("preset"):
                        assert entry["preset"].startswith(f"{name}/"), (name, label, entry["preset"])
                        method = compose("config", overrides=[f"method={entry['preset']}"]).method
                        assert method.name == entry["mergeval"], (name, label)
                        seen += 1
    assert seen >= 10


def test_verify_lists_each_papers_baselines_as_mergeval_runs_them(capsys):
    code, out, _ = run_cli(capsys, "medical_hier")
    assert code == 0
    for shown in (
        "hierarchical -> hierarchical",
        "Linear -> linear",
        "TA -> task_arithmetic",
        "DARE-TIES -> medical_hier/dare_ties",
        "DELLA -> medical_hier/della",
        "Breadcrumbs -> medical_hier/breadcrumbs",
    ):
        assert shown in out, shown
    _, out, _ = run_cli(capsys, "cpt_finance")
    assert "DARE-TIES -> dare_ties" in out and "setup stage1 (+experiment=cpt_finance_stage1)" in out


@pytest.mark.parametrize(
    "by,status", [("0.110", "recorded"), ("0.090", "recorded"), ("0.111", "record-wrong"), ("0.089", "record-wrong")]
)
def test_the_discrepancy_tolerance_on_both_sides(by, status):
    """printed 1.60 vs mean(1.00, 2.00) = 1.5: off = +0.1. The record may differ from it by the rounding of all
    involved: printed +-0.005, the recomputed interval's half-width 0.005, the record's own +-0.0005 = 0.0105.
    So 0.110 and 0.090 (0.010 away) are the paper's discrepancy; 0.111 and 0.089 (0.011 away) are not."""
    raw = {
        "t": {
            "columns": ["a", "b", "avg"],
            "rows": {"r": "1.00 2.00 1.60"},
            "derived": {"avg": {"mean": ["a", "b"]}},
            "discrepancies": [{"at": ["r", "avg"], "by": by, "note": "typo in the paper"}],
        }
    }
    (check,) = check_tables(parse_tables(raw, "tables"))
    assert check.status == status


def test_a_sweeps_runs_are_numbered_in_job_order(tmp_path):
    """Run indices (the per-run claims' labels, "run 10: ...") follow the sweep's job numbers, not their
    string order: with 12 jobs, job 10 is run 10, not run 2."""
    sweep = tmp_path / "sweep"
    for job in range(12):
        write_run(sweep, str(job), SCORES, params={"lambda_": job / 10})
    runs = load_runs([str(sweep)])
    assert [run.index for run in runs] == list(range(12))
    assert [run.config["method"]["lambda_"] for run in runs] == [job / 10 for job in range(12)]
