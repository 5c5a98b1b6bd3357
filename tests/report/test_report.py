"""Sweep reports: the data behind each plot, and the files ``python -m mergeval.report`` writes."""

from __future__ import annotations

import copy
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from mergeval.core.errors import UserError
from mergeval.metrics.tradeoff import synergy_area
from mergeval.report import data
from mergeval.report.__main__ import main as report_main

CHEM, UNITS, FACTS = "mergeval_chem_count", "mergeval_unit_convert", "mergeval_general_facts"
TASKS = [CHEM, UNITS, FACTS]
# base, chem expert, units expert: accuracies on (chem, units, facts), as in a real quickstart run
CONSTITUENTS = {"base": (0.595, 0.085, 0.815), "chem": (0.975, 0.085, 0.775), "units": (0.435, 0.995, 0.855)}


def stderr(acc: float, n: int = 200) -> float:
    return (acc * (1 - acc) / (n - 1)) ** 0.5


def result(run_id: str, method: str, merged: tuple[float, float, float], minute: int = 0, **params) -> dict:
    """A result.json as a real quickstart run writes it, with the merged scores and method config given."""
    from mergeval.core.outcome import ModelInfo
    from mergeval.run.summary import aggregate

    models = [
        {"role": "base", "source": "smollm2", "fingerprint": "b" * 32, "path": "/m/base", "task": None},
        {"role": "chem", "source": "finetune:chem_count", "fingerprint": "c" * 32, "path": "/m/chem", "task": CHEM},
        {
            "role": "units",
            "source": "finetune:unit_convert",
            "fingerprint": "u" * 32,
            "path": "/m/units",
            "task": UNITS,
        },
        {"role": "merged", "source": method, "fingerprint": run_id.ljust(32, "0"), "path": None, "task": None},
    ]
    accs = {**CONSTITUENTS, "merged": merged}
    scores = {
        t: {
            role: {"metric": "acc,none", "value": accs[role][i], "stderr": stderr(accs[role][i]), "n": 200}
            for role in accs
        }
        for i, t in enumerate(TASKS)
    }
    return {
        "run_id": run_id,
        "created": f"2026-11-30T08:{minute:02d}:00+00:00",
        "config": {
            "method": {"name": method, **params},
            "modelset": {"name": "quickstart"},
            "benchmark": {"name": "quickstart", "tasks": TASKS},
        },
        "seeds": {"run": 0},
        "models": models,
        "tasks": TASKS,
        "task_digests": {t: t[:16] for t in TASKS},
        "scores": scores,
        "aggregates": aggregate(scores, TASKS, [ModelInfo(**m) for m in models], "percent"),
        "timings_s": {"merge": 1.0},
        "versions": {"lm_eval": "0.4.13"},
        "git": {"commit": None, "dirty": None},
    }


def sweep() -> list[dict]:
    """Task arithmetic over lambda, TIES over lambda at two densities, and one linear average."""
    return [
        result("ta03", "task_arithmetic", (0.80, 0.50, 0.82), 1, lambda_=0.3, weights=None),
        result("ta06", "task_arithmetic", (0.90, 0.80, 0.80), 2, lambda_=0.6, weights=None),
        result("ta10", "task_arithmetic", (0.975, 0.98, 0.76), 3, lambda_=1.0, weights=None),
        result("ti03", "ties", (0.70, 0.40, 0.83), 4, lambda_=0.3, density=0.5),
        result("ti10", "ties", (0.97, 0.69, 0.835), 5, lambda_=1.0, density=0.5),
        result("ti10b", "ties", (0.96, 0.70, 0.83), 6, lambda_=1.0, density=0.3),
        result("lin", "linear", (0.93, 0.675, 0.865), 7, normalize=True, weights=None),
    ]


def test_pareto_front_and_synergy_area_of_the_merged_points():
    runs = sweep()
    assert data.pareto_tasks(runs, None) == (CHEM, UNITS)  # the experts' own tasks
    p = data.pareto(runs, CHEM, UNITS, [r["run_id"] for r in runs])
    assert [p.labels[i] for i in p.front] == ["ta10"]  # (0.975, 0.98) dominates every other merge
    assert p.diagonal == ("chem", "units") and p.references["chem"] == (0.975, 0.085)
    assert p.area == pytest.approx(synergy_area(p.points, (0.975, 0.085), (0.435, 0.995))) and p.area > 0
    without_best = [r for r in runs if r["run_id"] != "ta10"]
    q = data.pareto(without_best, CHEM, UNITS, [r["run_id"] for r in without_best])
    assert [q.labels[i] for i in q.front] == ["ta06", "ti10b", "ti10"] and q.area < p.area  # sorted by x


def test_pareto_tasks_by_flag_or_a_reason_when_undefined():
    runs = sweep()
    assert data.pareto_tasks(runs, ["unit_convert", "general_facts"]) == (UNITS, FACTS)
    p = data.pareto(runs, UNITS, FACTS, ["x"] * len(runs))
    assert p.area is None and "no expert owns general_facts" in p.area_note and p.diagonal is None
    with pytest.raises(UserError, match="--tasks"):
        data.pareto_tasks(runs, ["nope", "chem_count"])
    with pytest.raises(UserError, match="same"):
        data.pareto_tasks(runs, ["chem_count", CHEM])
    one_expert = copy.deepcopy(runs)
    for r in one_expert:
        r["models"][2]["task"] = None
    assert "1 own task" in data.pareto_tasks(one_expert, None)


def test_experts_that_do_not_trade_off_leave_the_area_undefined():
    runs = copy.deepcopy(sweep())
    for r in runs:  # the units expert no longer beats the chem expert on units
        r["scores"][UNITS]["units"]["value"] = 0.05
    p = data.pareto(runs, CHEM, UNITS, ["x"] * len(runs))
    assert p.area is None and "do not trade off" in p.area_note


def test_runs_with_other_constituents_are_refused():
    runs = sweep()
    runs[1] = copy.deepcopy(runs[1])
    runs[1]["models"][1]["fingerprint"] = "d" * 32
    with pytest.raises(UserError, match="other base/expert"):
        data.constituents(runs)


def test_the_swept_parameter_and_its_series():
    runs = sweep()
    assert data.sweep_param(runs, None) == "lambda_"  # varies; preferred over density, which varies too
    assert data.sweep_param(runs, "density") == "density"
    with pytest.raises(UserError, match="--param"):
        data.sweep_param(runs, "gamma")
    series = data.param_series(runs, "lambda_", TASKS)
    assert set(series) == {"task_arithmetic", "ties density=0.3", "ties density=0.5"}  # linear sets no lambda_
    assert series["task_arithmetic"][CHEM] == [
        (0.3, 0.80, stderr(0.80)),
        (0.6, 0.90, stderr(0.90)),
        (1.0, 0.975, stderr(0.975)),
    ]
    assert [x for x, _, _ in series["ties density=0.5"][UNITS]] == [0.3, 1.0]
    only_linear = [r for r in runs if r["run_id"] == "lin"]
    assert data.sweep_param(only_linear, None) is None  # normalize is a bool, weights unset: nothing numeric
    at_one_lambda = [r for r in runs if r["run_id"] in ("ta10", "ti10", "lin")]
    assert data.sweep_param(at_one_lambda, None) is None  # a sweep over methods at lambda_ 1: once a plot at one x


def test_normalized_scores_take_each_methods_best_run():
    tasks, table = data.normalized_by_method(sweep())
    assert tasks == [CHEM, UNITS]
    assert set(table) == {"task_arithmetic lambda_=1.0", "ties density=0.5 lambda_=1.0", "linear"}
    assert table["task_arithmetic lambda_=1.0"][CHEM] == pytest.approx(1.0)
    assert table["task_arithmetic lambda_=1.0"][UNITS] == pytest.approx((0.98 - 0.085) / (0.995 - 0.085))


def test_filters_and_labels():
    runs = sweep()
    assert [r["run_id"] for r in data.filter_results(runs, method="ties")] == ["ti03", "ti10", "ti10b"]
    assert data.filter_results(runs, experiment="other") == []
    since = datetime(2026, 11, 30, 8, 5, tzinfo=UTC).timestamp()
    assert [r["run_id"] for r in data.filter_results(runs, since=since)] == ["ti10", "ti10b", "lin"]
    varying = data.varying_params(runs)
    assert varying == {"task_arithmetic": ["lambda_"], "ties": ["density", "lambda_"], "linear": []}
    rows = data.run_rows(runs, TASKS)
    assert rows[0]["label"] == "task_arithmetic lambda_=0.3" and rows[0]["chem_count"] == "0.800 ± 0.028"


def write_sweep(root: Path, runs: list[dict]) -> Path:
    """Like a Hydra multirun: multirun/<date>/<time>/<job>/result.json."""
    sweep_dir = root / "multirun" / "2026-11-30" / "08-00-00-000000"
    for i, r in enumerate(runs):
        (sweep_dir / str(i)).mkdir(parents=True)
        (sweep_dir / str(i) / "result.json").write_text(json.dumps(r, indent=2))
    return sweep_dir


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_report_of_a_sweep_directory_writes_the_table_markdown_and_plots(tmp_path, capsys):
    sweep_dir = write_sweep(tmp_path, sweep())
    out = tmp_path / "report"
    assert report_main([str(sweep_dir), "--out", str(out)]) == 0
    for name in ("pareto.png", "score_vs_param.png", "normalized.png"):
        assert is_png(out / name), name
    text = (out / "report.md").read_text()
    assert "7 run(s) from" in text and "| ta10 | task_arithmetic lambda_=1.0 | 0.975 ± 0.011 |" in text
    assert "Pareto front (merged runs): task_arithmetic lambda_=1.0 (0.975, 0.980)" in text
    assert "Synergy area: +" in text and "![Pareto front](pareto.png)" in text
    assert "![score versus lambda_](score_vs_param.png)" in text and "| linear | 0.88 | 0.65 |" in text
    shown = capsys.readouterr().out
    assert "7 run(s)" in shown and "ti10b" in shown and f"wrote {out / 'report.md'}" in shown


def fill_store(store) -> None:
    """The sweep's runs, finished, in ``store``, plus one run still running (which reports leave out)."""
    for r in sweep():
        store.start_run(
            r["run_id"],
            experiment="quickstart",
            method=r["config"]["method"]["name"],
            config=r["config"],
            versions=r["versions"],
            git=r["git"],
        )
        store.finish_run(
            r["run_id"],
            result_path="/x/result.json",
            aggregates=r["aggregates"],
            timings=r["timings_s"],
            models=r["models"],
            scores=r["scores"],
        )
    store.start_run(
        "running", experiment="quickstart", method="ties", config={"method": {"name": "ties"}}, versions={}, git={}
    )


def test_report_from_the_store_and_with_filters(tmp_path, capsys):
    from mergeval.results.store import Store

    store = Store(tmp_path / "r.sqlite")
    fill_store(store)  # the running one: not reported
    out = tmp_path / "ties"
    assert report_main(["--store", str(store.path), "--method", "ties", "--param", "density", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "3 finished run(s) from the results store" in text and "## Score versus density" in text
    assert is_png(out / "score_vs_param.png")
    assert "ta10" not in text and "running" not in capsys.readouterr().out


def test_a_report_of_a_whole_store_keeps_the_runs_comparable_with_the_newest(tmp_path, capsys):
    """A store that also holds runs under other evaluation settings (a sweep with benchmark.limit) once made
    `report --store` refuse every run, and --experiment could not help."""
    from mergeval.results.store import Store

    store = Store(tmp_path / "r.sqlite")
    limited = copy.deepcopy(sweep()[0])
    limited["run_id"] = "limited0"
    limited["scores"][CHEM]["base"]["value"] = 0.5  # the same base scored on fewer items
    for r in [limited, *sweep()]:  # the limited run first: the newest is one of the sweep's
        store.start_run(
            r["run_id"],
            experiment="quickstart",
            method=r["config"]["method"]["name"],
            config=r["config"],
            versions=r["versions"],
            git=r["git"],
        )
        store.finish_run(
            r["run_id"],
            result_path="/x/result.json",
            aggregates=r["aggregates"],
            timings=r["timings_s"],
            models=r["models"],
            scores=r["scores"],
        )
        time.sleep(0.01)
    out = tmp_path / "report"
    assert report_main(["--store", str(store.path), "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "7 finished run(s) from the results store" in shown and "1 other run(s) with other base/expert" in shown
    assert "limited0" not in (out / "report.md").read_text()


def test_a_plot_the_runs_cannot_support_is_skipped_with_its_reason(tmp_path):
    only_linear = [r for r in sweep() if r["run_id"] == "lin"]
    out = tmp_path / "report"
    assert report_main([str(write_sweep(tmp_path / "all", sweep())), "--out", str(out)]) == 0
    assert is_png(out / "score_vs_param.png")  # an earlier report into the same --out: its plot must not stay
    assert report_main([str(write_sweep(tmp_path, only_linear)), "--out", str(out)]) == 0
    assert not (out / "score_vs_param.png").exists() and is_png(out / "pareto.png")
    assert "score_vs_param.png skipped: no numeric hyperparameter varies" in (out / "report.md").read_text()


def test_report_input_mistakes_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"run_id": "x"}')
    for args, field in (
        (["nope"], "nope: no such file"),
        ([str(tmp_path / "empty")], "runs: no finished runs"),
        ([str(tmp_path / "bad.json")], "is not a mergeval result.json"),
        ([str(tmp_path / "empty"), "--store"], "--store: give result.json paths or --store"),
        (["--store", str(tmp_path / "none.sqlite")], "--store: no results store"),
    ):
        assert report_main([*args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mergeval: error: ") and field in err and err.count("\n") == 1, err


def test_runs_or_arguments_the_report_refuses_leave_no_output_directory(tmp_path, capsys):
    """Each refusal once left an empty --out, or a pareto.png beside no report.md (a bad --param)."""
    mixed = sweep()
    mixed[1] = copy.deepcopy(mixed[1])
    mixed[1]["models"][1]["fingerprint"] = "d" * 32
    good = str(write_sweep(tmp_path / "good", sweep()))
    for args, field in (
        ([str(write_sweep(tmp_path / "mixed", mixed))], "runs:"),
        ([good, "--tasks", CHEM, "mergeval_nope"], "--tasks:"),
        ([good, "--param", "lambda"], "--param:"),
    ):
        out = tmp_path / "out" / "report"
        assert report_main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mergeval: error: {field}") and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists(), list((tmp_path / "out").rglob("*"))


def test_the_pareto_plot_of_many_runs_numbers_them_and_keys_every_label(tmp_path):
    """16 runs, two of them at the same point: each point carries only its run number(s), the key lists every
    label once with the front marked, and the axes name each task's metric."""
    from mergeval.report.plots import plot_pareto

    runs = [
        result(f"r{i:02d}", "task_arithmetic", (0.6 + 0.02 * i, 0.9 - 0.03 * i, 0.8), i, lambda_=0.1 * i)
        for i in range(15)
    ] + [result("dup", "ties", (0.6, 0.9, 0.8), 15, lambda_=9.0)]
    labels = [data.run_label(r, data.varying_params(runs)) for r in runs]
    trade = data.pareto(runs, CHEM, UNITS, labels)
    captured = {}

    def keep(fig, path):
        captured["fig"] = fig
        return path

    import mergeval.report.plots as plots

    original, plots._save = plots._save, keep
    try:
        plot_pareto(trade, tmp_path / "p.png")
    finally:
        plots._save = original
    fig = captured["fig"]
    ax = fig.axes[0]
    numbers = [t.get_text() for t in ax.texts if t.get_text() not in ("base", "chem", "units")]
    assert all(n.replace(",", "").isdigit() for n in numbers)
    assert "1,16" in numbers and len(numbers) == 15  # the duplicate point shares one label
    key = "\n".join(t.get_text() for t in fig.texts)
    assert all(label in key for label in labels)
    assert sum(line.startswith("*") for line in key.splitlines()) == len(trade.front)
    assert ax.get_xlabel().endswith("(acc,none)") and ax.get_ylabel().endswith("(acc,none)")


def test_the_tables_legend_names_the_own_task_cells_where_bold_does_not_show():
    """Without a terminal (a log, a pipe, the README's blocks) rich prints no bold, and the legend said
    "bold: each expert on its own task" all the same."""
    from rich.console import Console

    from mergeval.core.outcome import ModelInfo, Outcome
    from mergeval.report.table import render

    scores = {
        t: {r: {"metric": "acc,none", "value": 0.5, "stderr": 0.1, "n": 8} for r in ("base", "chem", "merged")}
        for t in ("mergeval_chem_count", "mergeval_general_facts")
    }
    outcome = Outcome(
        [
            ModelInfo("base", "zoo", "f0"),
            ModelInfo("chem", "zoo", "f1", task="mergeval_chem_count"),
            ModelInfo("merged", "ta", "f2"),
        ],
        list(scores),
        scores,
        {
            "normalized": {},
            "normalized_mean": None,
            "normalized_band": "undefined",
            "scale": "percent",
            "macro_gain": 0.0,
            "macro_og": 0.0,
        },
        {},
    )
    for styled, says in (
        (None, "each expert's own task: chem on chem_count; normalized ="),
        ("truecolor", "bold: each expert on its own task; normalized ="),
    ):
        console = Console(record=True, width=160, color_system=styled, force_terminal=styled is not None)
        render(outcome, "t", console)
        assert says in console.export_text()
