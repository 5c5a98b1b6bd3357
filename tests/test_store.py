"""The results store: evaluations reused across runs, misses on any key change."""

from __future__ import annotations

import sqlite3

from mergeval.store import Store
from tests.test_cli import mergeval

SCORES = {"a": {"acc": 0.5, "stderr": 0.1, "n": 10}, "b": {"acc": 0.25, "stderr": 0.05, "n": 20}}
DIGESTS = {"a": "d1", "b": "d2"}
SETTINGS = {"limit": None, "dtype": "bfloat16"}


def test_hits_only_for_the_same_model_tasks_and_settings(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    assert store.get_scores("fp", DIGESTS, SETTINGS) is None
    store.put_scores("fp", DIGESTS, SETTINGS, SCORES)
    assert store.get_scores("fp", DIGESTS, SETTINGS) == SCORES
    assert store.get_scores("other", DIGESTS, SETTINGS) is None
    assert store.get_scores("fp", {"a": "d1", "b": "changed"}, SETTINGS) is None
    assert store.get_scores("fp", DIGESTS, dict(SETTINGS, limit=5)) is None
    assert Store(tmp_path / "r.sqlite").get_scores("fp", DIGESTS, SETTINGS) == SCORES  # persisted
    mode = sqlite3.connect(tmp_path / "r.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_a_rerun_reuses_every_evaluation_and_force_redoes_them(tmp_path, cache):
    store = tmp_path / "store.sqlite"
    first = mergeval("+experiment=tiny", f"store={store}", cwd=tmp_path)
    assert first.returncode == 0 and first.stdout.count("mergeval: evaluating") == 4, first.stderr[-2000:]
    again = mergeval("+experiment=tiny", f"store={store}", cwd=tmp_path)
    assert again.returncode == 0 and "mergeval: evaluating" not in again.stdout
    limited = mergeval("+experiment=tiny", f"store={store}", "benchmark.limit=5", cwd=tmp_path)
    assert limited.stdout.count("mergeval: evaluating") == 4
    forced = mergeval("+experiment=tiny", f"store={store}", "eval.force=true", cwd=tmp_path)
    assert forced.stdout.count("mergeval: evaluating") == 4
    runs = sqlite3.connect(store).execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert runs == 4


def test_results_command_lists_filters_and_exports(tmp_path, capsys):
    import csv

    from mergeval import results

    store = Store(tmp_path / "r.sqlite")
    for i, method in enumerate(["ties", "linear"]):
        store.record_run(f"run{i}", tmp_path / f"{i}/result.json", "tiny", method,
                         {"method": {"name": method, "density": 0.5 if method == "ties" else None}},
                         {"macro_gain": 1.5, "macro_og": -0.5, "normalized_mean": None})
    store.record_run("run0", tmp_path / "dup.json", "tiny", "ties", {"method": {"name": "ties"}},
                     {"macro_gain": 0, "macro_og": 0, "normalized_mean": 0})  # recorded exactly once
    out = tmp_path / "ties.csv"
    assert results.main(["--store", str(tmp_path / "r.sqlite"), "--method", "ties", "--csv", str(out)]) == 0
    (row,) = list(csv.DictReader(out.open()))
    assert row["run_id"] == "run0" and row["params"] == "density=0.5" and float(row["macro_gain"]) == 1.5
    assert "2 run(s)" not in capsys.readouterr().out
    assert results.main(["--store", str(tmp_path / "missing.sqlite")]) == 2
