"""Schema v5 of the SQLite results store: runs found by their configuration hash (resumable sweeps), and the
migration of a v4 store in place."""

from __future__ import annotations

import sqlite3

from mergeval.results.store import _CURRENT, _NEW_IN_V2, SCHEMA_VERSION, Store
from tests.test_store import FINISH, integrity, start


def test_the_newest_finished_run_of_a_config_hash_is_found(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    for run_id, config_hash in (("r1", "h1"), ("r2", "h1"), ("r3", "h1"), ("r4", "h2"), ("r5", None)):
        start(store, run_id)
        if config_hash:  # start() has no hash: set it as a sweep's run does, through start_run
            with sqlite3.connect(store.path) as db:
                db.execute("UPDATE runs SET config_hash=? WHERE run_id=?", (config_hash, run_id))
    assert store.finished_run("h1") is None  # running runs do not count
    store.finish_run("r1", **FINISH)
    store.finish_run("r2", **FINISH)
    store.fail_run("r3", "boom")  # newer, but failed: the sweep must not skip it for this
    found = store.finished_run("h1")
    assert found["run_id"] == "r2" and found["config_hash"] == "h1" and found["aggregates"] == {"macro_gain": 1.0}
    assert store.finished_run("h2") is None and store.finished_run("nope") is None


def test_start_run_stores_the_config_hash(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    store.start_run("r", experiment="e", method="m", config={}, versions={}, git={}, config_hash="abc")
    store.finish_run("r", **FINISH)
    assert store.run("r")["config_hash"] == "abc" and store.finished_run("abc")["run_id"] == "r"


def test_a_v4_store_gains_config_hash_and_keeps_its_rows(tmp_path):
    path = tmp_path / "v4.sqlite"
    with sqlite3.connect(path) as db:
        for statement in _CURRENT + _NEW_IN_V2:
            db.execute(statement)
        db.execute("INSERT INTO meta VALUES ('schema_version', '4')")
        db.execute(
            "INSERT INTO runs (run_id, created, status, experiment, method, config, versions, git, timings, "
            "aggregates, models, scores, result_path, finished) VALUES ('old', 2.0, 'finished', 'e', 'm', "
            "'{}', '{}', '{}', '{}', '{\"macro_gain\": 1.5}', '[]', '{}', '/r.json', 3.0)"
        )
        db.execute("INSERT INTO claims VALUES ('fp', 's', 't', 'elsewhere', 1, 5.0)")
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION == 7 and integrity(path) == "ok"
    assert store.run("old")["aggregates"] == {"macro_gain": 1.5} and store.run("old")["config_hash"] is None
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT since, renewed FROM claims").fetchall() == [(5.0, None)]
        plan = db.execute("EXPLAIN QUERY PLAN SELECT * FROM runs WHERE config_hash='x'").fetchall()
    assert "runs_by_config_hash" in str(plan)
