"""The results store: cache keys, merge reuse, run states, concurrency, crash consistency, migration, export."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.results.store import _CURRENT, _NEW_IN_V2, SCHEMA_VERSION, Store, StoreError, merge_key
from tests.run.test_cli import mergeval

SCORES = {
    "a": {"metric": "acc,none", "value": 0.5, "stderr": 0.1, "n": 10},
    "b": {"metric": "acc,none", "value": 0.25, "stderr": 0.05, "n": 20},
}
DIGESTS = {"a": "d1", "b": "d2"}
SETTINGS = {"limit": None, "dtype": "bfloat16"}
FINISH = {
    "result_path": "/job/result.json",
    "aggregates": {"macro_gain": 1.0},
    "timings": {"merge": 0.1},
    "models": [{"role": "base", "fingerprint": "fp"}],
    "scores": {"a": {"merged": SCORES["a"]}},
}


def start(store: Store, run_id: str, method: str = "ties", experiment: str = "tiny", **method_cfg) -> None:
    store.start_run(
        run_id,
        experiment=experiment,
        method=method,
        config={"method": {"name": method, **method_cfg}},
        versions={"lm_eval": "0.4.13"},
        git={"commit": "abc", "dirty": False},
    )


def integrity(path: Path) -> str:
    with sqlite3.connect(path) as db:
        return db.execute("PRAGMA integrity_check").fetchone()[0]


# evaluation cache


def test_hits_only_for_the_same_model_tasks_and_settings(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    assert store.get_scores("fp", DIGESTS, SETTINGS) is None
    store.put_scores("fp", DIGESTS, SETTINGS, SCORES)
    assert store.get_scores("fp", DIGESTS, SETTINGS) == SCORES
    assert store.get_scores("other", DIGESTS, SETTINGS) is None
    assert store.get_scores("fp", {"a": "d1", "b": "changed"}, SETTINGS) is None
    assert store.get_scores("fp", {**DIGESTS, "c": "d3"}, SETTINGS) is None  # one task never evaluated
    assert Store(tmp_path / "r.sqlite").get_scores("fp", DIGESTS, SETTINGS) == SCORES  # persisted
    mode = sqlite3.connect(tmp_path / "r.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def composed(*overrides: str):
    from hydra import compose, initialize_config_module

    from mergeval.run.config import register_configs

    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        return compose("config", overrides=["+experiment=tiny", *overrides])


@pytest.mark.parametrize(
    "override,key",
    [("benchmark.limit=5", "limit"), ("benchmark.num_fewshot=2", "num_fewshot"), ("eval.dtype=bfloat16", "dtype")],
)
def test_each_setting_of_the_run_is_a_cache_key(override, key, tmp_path):
    from mergeval.eval.settings import eval_settings

    store = Store(tmp_path / "r.sqlite")
    settings = eval_settings(composed())
    store.put_scores("fp", DIGESTS, settings, SCORES)
    assert store.get_scores("fp", DIGESTS, eval_settings(composed())) == SCORES  # same config: hit
    changed = eval_settings(composed(override))
    assert changed[key] != settings[key]
    assert store.get_scores("fp", DIGESTS, changed) is None


def test_the_lm_eval_version_is_a_cache_key(tmp_path, monkeypatch):
    import importlib.metadata

    from mergeval.eval.settings import eval_settings

    store = Store(tmp_path / "r.sqlite")
    cfg = composed()
    store.put_scores("fp", DIGESTS, eval_settings(cfg), SCORES)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0" if name == "lm_eval" else real(name))
    assert eval_settings(cfg)["lm_eval"] == "99.0"
    assert store.get_scores("fp", DIGESTS, eval_settings(cfg)) is None


def test_a_new_version_of_the_shared_prefix_scorer_is_a_cache_miss(tmp_path, monkeypatch):
    import mergeval.eval.settings as settings_module
    from mergeval.eval.settings import eval_settings

    store = Store(tmp_path / "r.sqlite")
    cfg = composed("eval.backend=shared_prefix")
    stored = eval_settings(cfg)
    assert "scorer_version" not in stored  # version 1: the keys scores were stored under before versions existed
    store.put_scores("fp", DIGESTS, stored, SCORES)
    monkeypatch.setattr(settings_module, "SHARED_PREFIX_VERSION", 2)
    assert eval_settings(cfg)["scorer_version"] == 2
    assert store.get_scores("fp", DIGESTS, eval_settings(cfg)) is None
    assert "scorer_version" not in eval_settings(composed("eval.backend=hflm"))  # lm-eval's: its version keys it


def test_changed_task_data_is_a_cache_miss(tmp_path):
    from mergeval.eval.tasks import task_digest, write_tasks

    tasks = ["mergeval_chem_count", "mergeval_unit_convert"]
    digests = {n: {t: task_digest(write_tasks(tasks, n, tmp_path), t) for t in tasks} for n in (16, 24)}
    again = {t: task_digest(write_tasks(tasks, 16, tmp_path), t) for t in tasks}
    assert again == digests[16]  # the same data written again has the same digest
    store = Store(tmp_path / "r.sqlite")
    scores = {t: SCORES["a"] for t in tasks}
    store.put_scores("fp", digests[16], SETTINGS, scores)
    assert store.get_scores("fp", again, SETTINGS) == scores
    assert store.get_scores("fp", digests[24], SETTINGS) is None


# merges


@dataclass
class TiesLike:
    name: str = "ties"
    density: float = 0.5
    lambda_: float = 1.0


@given(
    st.lists(st.text(min_size=1, max_size=6), min_size=2, max_size=4, unique=True),
    st.floats(0.01, 1, allow_nan=False),
    st.integers(0, 5),
)
def test_merge_key_changes_with_every_input(fps, density, seed):
    key = merge_key(fps, TiesLike(density=density), seed)
    assert key == merge_key(list(fps), {"lambda_": 1.0, "density": density, "name": "ties"}, seed)  # dataclass = dict
    assert key != merge_key(fps[::-1], TiesLike(density=density), seed)  # expert order matters (weights, slerp)
    assert key != merge_key([*fps[:-1], fps[-1] + "x"], TiesLike(density=density), seed)
    assert key != merge_key(fps, TiesLike(density=density / 2), seed)
    assert key != merge_key(fps, TiesLike(density=density, name="dare_ties"), seed)
    assert key != merge_key(fps, TiesLike(density=density), seed + 1)
    assert key != merge_key(fps, TiesLike(density=density), seed, {"vocab_policy": "union"})


def test_a_merge_is_reused_only_when_its_output_is_scored_with_these_settings(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    key = merge_key(["b", "e1", "e2"], TiesLike(), 0)
    assert store.get_merge(key) is None and store.evaluated_merge(key, DIGESTS, SETTINGS) is None
    store.put_merge(key, ["b", "e1", "e2"], TiesLike(), 0, "out")
    assert store.get_merge(key) == "out"
    assert store.evaluated_merge(key, DIGESTS, SETTINGS) is None  # merged but not scored yet
    store.put_scores("out", DIGESTS, SETTINGS, SCORES)
    assert store.evaluated_merge(key, DIGESTS, SETTINGS) == "out"
    assert store.evaluated_merge(key, DIGESTS, dict(SETTINGS, limit=5)) is None
    assert store.evaluated_merge(key, {**DIGESTS, "c": "d3"}, SETTINGS) is None
    store.put_merge(key, ["b", "e1", "e2"], TiesLike(), 0, "other")  # the first record of a merge stays
    assert store.get_merge(key) == "out"


def test_models_keep_source_and_architecture(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    store.put_model("fp", "zoo:tiny", {"hidden_size": 32}, "/models/tiny", weights="w")
    store.put_model("fp", "a copy", None, "/elsewhere")
    assert store.model("fp") == {
        "fingerprint": "fp",
        "source": "zoo:tiny",
        "architecture": {"hidden_size": 32},
        "path": "/models/tiny",
        "weights": "w",
    }
    assert store.model("unknown") is None


CLAIMER = textwrap.dedent("""
    import sys
    from mergeval.results.store import Store
    from tests.results.test_store import DIGESTS, SETTINGS

    store = Store(sys.argv[1])
    assert store.claim_or_scores("fp", DIGESTS, SETTINGS) == {}
    assert store.claim_or_scores("fp2", DIGESTS, SETTINGS) == {}
    print("claimed", flush=True)
    sys.stdin.read()  # evaluating... until the test lets it go (it exits without releasing its claims)
""")


def test_parallel_jobs_evaluate_a_model_once(tmp_path):
    root = Path(__file__).resolve().parents[2]
    store = Store(tmp_path / "r.sqlite")
    other = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, str(store.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert other.stdout.readline() == "claimed\n"
    waits = []

    def other_job_delivers() -> None:  # called once, when this job starts waiting
        waits.append("fp")
        Store(store.path).put_scores("fp", DIGESTS, SETTINGS, SCORES)

    assert store.claim_or_scores("fp", DIGESTS, SETTINGS, other_job_delivers, poll_s=0.01) == SCORES
    assert waits == ["fp"]  # it waited for the other job instead of evaluating
    other.stdin.close()
    assert other.wait() == 0  # gone without releasing fp2
    assert store.claim_or_scores("fp2", DIGESTS, SETTINGS, lambda: waits.append("fp2")) == {}  # taken over
    assert store.claim_or_scores("fp2", DIGESTS, SETTINGS, lambda: waits.append("fp2")) == {}  # own: no wait
    assert waits == ["fp"] and store.claim_or_scores("fp3", DIGESTS, SETTINGS) == {}
    store.put_scores("fp3", DIGESTS, SETTINGS, SCORES)  # scoring ends a claim
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT model_fingerprint FROM claims").fetchall() == [("fp2",)]
        store.release_claims()  # a failed run ends the rest
        assert db.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0


# run states


def test_a_run_is_finished_exactly_once(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    start(store, "r1")
    assert store.run("r1")["status"] == "running" and store.run("r1")["aggregates"] is None
    with pytest.raises(StoreError, match="already"):
        start(store, "r1")
    store.finish_run("r1", **FINISH)
    row = store.run("r1")
    assert row["status"] == "finished" and row["aggregates"] == {"macro_gain": 1.0}
    assert row["finished"] >= row["created"]
    with pytest.raises(StoreError, match="it is finished"):
        store.finish_run("r1", **dict(FINISH, aggregates={"macro_gain": -1.0}))
    assert store.fail_run("r1", "late error") is False
    assert store.run("r1") == row  # neither the second finish nor the late failure changed it
    with pytest.raises(StoreError, match="not in the store"):
        store.finish_run("nope", **FINISH)


def test_a_failed_run_keeps_its_error_and_cannot_be_finished(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    start(store, "r1")
    assert store.fail_run("r1", "UserError: benchmark.limit: must be positive", {"resolve_models": 1.0})
    row = store.run("r1")
    assert row["status"] == "failed" and "benchmark.limit" in row["error"] and row["timings"] == {"resolve_models": 1.0}
    with pytest.raises(StoreError, match="it is failed"):
        store.finish_run("r1", **FINISH)


def test_the_schema_refuses_a_half_finished_run(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    start(store, "r1")
    with sqlite3.connect(tmp_path / "r.sqlite") as db, pytest.raises(sqlite3.IntegrityError):
        db.execute("UPDATE runs SET status='finished', finished=1 WHERE run_id='r1'")  # no results
    assert store.run("r1")["status"] == "running"


# concurrency and crashes


def _write_runs(path: str, worker: int, n_runs: int, go) -> None:
    """One sweep worker: per run, start, evaluations (its own and a key every worker rewrites), model, merge, finish."""
    go.wait()
    store = Store(Path(path))  # all workers open (and create) the store at once
    for i in range(n_runs):
        run_id, fp = f"w{worker}-{i}", f"fp-{worker}-{i}"
        start(store, run_id, lambda_=i / n_runs)
        store.put_scores(fp, DIGESTS, SETTINGS, SCORES)
        store.put_scores("shared-base", DIGESTS, SETTINGS, SCORES)
        store.put_model(fp, "merged", {"hidden_size": 32})
        key = merge_key(["shared-base", fp], {"name": "ties", "i": i}, worker)
        store.put_merge(key, ["shared-base", fp], {"name": "ties", "i": i}, worker, fp)
        store.finish_run(run_id, **dict(FINISH, aggregates={"worker": worker, "i": i}))


def _open_fresh_stores(folder: str, rounds: int, barrier, failures) -> None:
    """One process of the race below: per round, open a store file no process has opened yet, at once with the
    others (a sweep's workers starting on a new store)."""
    from mergeval.results.backends.sqlite import SqliteBackend

    for r in range(rounds):
        barrier.wait()
        try:
            with SqliteBackend(Path(folder) / f"r{r}.sqlite", "store.path").read() as db:
                db.execute("CREATE TABLE IF NOT EXISTS t(x)")
        except Exception as err:  # noqa: BLE001  counted, and the first reported
            failures.put(repr(err))


def test_processes_opening_a_new_store_at_once_all_get_in(tmp_path):
    """Switching a new file to WAL takes an exclusive lock; two processes doing it at once can each hold the
    shared lock the other waits for, and SQLite answers "database is locked" at once instead of waiting (it
    failed 58 of 1200 opens in 300 rounds of four processes before connect() retried). Every open gets in."""
    processes, rounds = 4, 150
    ctx = multiprocessing.get_context("spawn")
    barrier, failures = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=_open_fresh_stores, args=(str(tmp_path), rounds, barrier, failures))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    found = []
    while not failures.empty():
        found.append(failures.get())
    assert [p.exitcode for p in procs] == [0] * processes
    assert found == [], f"{len(found)} of {processes * rounds} opens failed, e.g. {found[0]}"


def test_four_parallel_writers_lose_no_row(tmp_path):
    path, workers, n_runs = tmp_path / "r.sqlite", 4, 25
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter per worker, as joblib's loky launcher uses
    go = ctx.Event()
    procs = [ctx.Process(target=_write_runs, args=(str(path), w, n_runs, go)) for w in range(workers)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * workers
    assert integrity(path) == "ok"
    store = Store(path)
    runs = store.runs(status="finished")
    assert len(runs) == workers * n_runs == len(store.runs())
    assert {(r["aggregates"]["worker"], r["aggregates"]["i"]) for r in runs} == {
        (w, i) for w in range(workers) for i in range(n_runs)
    }
    with sqlite3.connect(path) as db:
        count = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("evaluations", "models", "merges")}
    assert count == {
        "evaluations": (workers * n_runs + 1) * len(DIGESTS),
        "models": workers * n_runs,
        "merges": workers * n_runs,
    }


WRITER = textwrap.dedent("""
    import sys
    from mergeval.results.store import Store
    from tests.results.test_store import DIGESTS, FINISH, SCORES, SETTINGS, start

    store, first = Store(sys.argv[1]), int(sys.argv[2])
    for i in range(first, first + 10**6):  # each step says when it is done: the killer aims at the next one
        start(store, f"r{i}")
        print(i, "started", flush=True)
        store.put_scores(f"fp{i}", {**DIGESTS, "big": "d9"}, SETTINGS,
                         {**SCORES, "big": dict(SCORES["a"], n=i)}, samples_path="x" * 20000)
        print(i, "scored", flush=True)
        store.finish_run(f"r{i}", **dict(FINISH, scores={"pad": "y" * 20000}))
        print(i, "finished", flush=True)
""")


def test_a_writer_killed_mid_loop_leaves_a_consistent_store(tmp_path):
    path = tmp_path / "r.sqlite"
    root = Path(__file__).resolve().parents[2]
    finished_before = 0
    # killed while scoring, while finishing, while starting the next run
    crashes = ((0, 5, "started"), (1000, 12, "scored"), (2000, 20, "finished"))
    for n_crashes, (first, kill_after, step) in enumerate(crashes, 1):
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(first)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
            env=dict(os.environ, PYTHONPATH=str(root)),
        )
        for line in child.stdout:
            if line.split() == [str(first + kill_after), step]:
                break
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        assert integrity(path) == "ok"
        store = Store(path)
        runs = store.runs()
        finished = [r for r in runs if r["status"] == "finished"]
        # opening the store found the killed writers' runs: interrupted, with a note; none is left running
        assert {r["status"] for r in runs} <= {"interrupted", "finished"}
        interrupted = [r for r in runs if r["status"] == "interrupted"]
        assert len(interrupted) <= n_crashes and all("ended without finishing" in r["error"] for r in interrupted)
        assert len(finished) >= finished_before + kill_after + (step == "finished")
        for r in finished:  # a finished row is whole, and so are the evaluations it was finished after
            assert all(r[k] is not None for k in ("aggregates", "timings", "models", "scores", "result_path"))
            assert store.get_scores("fp" + r["run_id"][1:], {**DIGESTS, "big": "d9"}, SETTINGS) is not None
        with sqlite3.connect(path) as db:  # an evaluation is all of a model's tasks or none of them
            per_model = db.execute("SELECT COUNT(*) FROM evaluations GROUP BY model_fingerprint").fetchall()
        assert {n for (n,) in per_model} == {3}
        finished_before = len(finished)
    start(store, "after")  # and the store still takes writes
    store.finish_run("after", **FINISH)
    assert store.run("after")["status"] == "finished"


# schema


V1_DDL = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE evaluations (model_fingerprint TEXT NOT NULL, task_digest TEXT NOT NULL, settings_hash TEXT NOT NULL,
    task TEXT NOT NULL, settings TEXT NOT NULL, acc REAL NOT NULL, stderr REAL NOT NULL, n INTEGER NOT NULL,
    created REAL NOT NULL, PRIMARY KEY (model_fingerprint, task_digest, settings_hash));
CREATE TABLE runs (run_id TEXT PRIMARY KEY, created REAL NOT NULL, result_path TEXT NOT NULL,
    experiment TEXT NOT NULL, method TEXT NOT NULL, config TEXT NOT NULL, aggregates TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
"""


def test_a_v1_store_is_migrated_in_place(tmp_path):
    from mergeval.results.store import settings_hash

    path = tmp_path / "v1.sqlite"
    result = {
        "versions": {"lm_eval": "0.4.13"},
        "git": {"commit": "abc", "dirty": False},
        "timings_s": {"merge": 2.0},
        "models": [{"role": "base", "fingerprint": "fp"}],
        "scores": {"a": {"base": SCORES["a"]}},
    }
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "result.json").write_text(json.dumps(result))
    with sqlite3.connect(path) as db:
        db.executescript(V1_DDL)
        db.execute(
            "INSERT INTO evaluations VALUES ('fp','d1',?,'a',?,0.5,0.1,10,1.0)",
            (settings_hash(SETTINGS), json.dumps(SETTINGS)),
        )
        db.execute(
            "INSERT INTO evaluations VALUES ('fp','d2',?,'b',?,0.25,0.05,20,1.0)",
            (settings_hash(SETTINGS), json.dumps(SETTINGS)),
        )
        for run_id, result_path in (("kept", tmp_path / "job" / "result.json"), ("gone", tmp_path / "gone.json")):
            db.execute(
                "INSERT INTO runs VALUES (?,100.0,?,'quickstart','ties',?,?)",
                (run_id, str(result_path), json.dumps({"method": {"name": "ties"}}), json.dumps({"macro_gain": 2.5})),
            )
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION == 7
    assert store.get_scores("fp", DIGESTS, SETTINGS) == SCORES  # evaluations survive
    kept, gone = store.run("kept"), store.run("gone")
    assert kept["status"] == gone["status"] == "finished" and kept["finished"] == 100.0
    assert kept["aggregates"] == {"macro_gain": 2.5} and kept["config"] == {"method": {"name": "ties"}}
    assert (kept["versions"], kept["git"], kept["timings"]) == (result["versions"], result["git"], result["timings_s"])
    assert kept["scores"] == result["scores"] and kept["models"] == result["models"]
    assert (gone["versions"], gone["scores"], gone["models"]) == ({}, {}, [])  # result.json no longer there
    store.put_scores("fp2", DIGESTS, SETTINGS, SCORES, samples_path="/samples.jsonl")  # new columns and tables work
    store.put_merge("k", ["fp"], {"name": "ties"}, 0, "fp2")
    start(store, "new")
    assert Store(path).run("new")["status"] == "running" and integrity(path) == "ok"  # reopening does not re-migrate


def test_a_v2_store_keeps_its_evaluations_as_acc(tmp_path):
    """v2 stored one accuracy per evaluation (generated tasks only): after migration it reads as ``acc,none``,
    and a run asking for another metric of that task does not mistake it for one."""
    from mergeval.results.store import _NEW_IN_V2, _RUNS_V2, settings_hash

    path = tmp_path / "v2.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('schema_version', '2')")
        db.execute(
            "CREATE TABLE evaluations (model_fingerprint TEXT NOT NULL, task_digest TEXT NOT NULL, "
            "settings_hash TEXT NOT NULL, task TEXT NOT NULL, settings TEXT NOT NULL, acc REAL NOT NULL, "
            "stderr REAL NOT NULL, n INTEGER NOT NULL, created REAL NOT NULL, samples_path TEXT, "
            "PRIMARY KEY (model_fingerprint, task_digest, settings_hash))"
        )
        db.execute(_RUNS_V2.format(name="runs"))
        for statement in _NEW_IN_V2:
            db.execute(statement)
        for task, digest in DIGESTS.items():
            s = SCORES[task]
            db.execute(
                "INSERT INTO evaluations VALUES ('fp',?,?,?,?,?,?,?,1.0,'/s.jsonl')",
                (digest, settings_hash(SETTINGS), task, json.dumps(SETTINGS), s["value"], s["stderr"], s["n"]),
            )
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION and integrity(path) == "ok"
    assert store.get_scores("fp", DIGESTS, SETTINGS) == SCORES
    assert store.samples_paths("fp", DIGESTS, SETTINGS) == {"a": "/s.jsonl", "b": "/s.jsonl"}
    assert store.get_scores("fp", DIGESTS, SETTINGS, metrics={"a": "acc_norm,none", "b": "acc,none"}) is None


def test_a_v3_store_keeps_its_runs_and_gains_interrupted(tmp_path):
    """v3 -> v4: every run row is kept as it was; a run left running by a v3 process has no process recorded,
    so it is never reaped by guesswork; new runs record theirs and can be interrupted."""
    from mergeval.results.store import _EVALUATIONS, _NEW_IN_V2, _RUNS_V2

    path = tmp_path / "v3.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('schema_version', '3')")
        db.execute(_EVALUATIONS.format(name="evaluations"))
        db.execute(_RUNS_V2.format(name="runs"))
        for statement in _NEW_IN_V2:
            db.execute(statement)
        db.execute(
            "INSERT INTO runs (run_id, created, status, experiment, method, config, versions, git) "
            "VALUES ('old-running', 1.0, 'running', 'e', 'm', '{}', '{}', '{}')"
        )
        db.execute(
            "INSERT INTO runs (run_id, created, status, experiment, method, config, versions, git, timings, "
            "aggregates, models, scores, result_path, finished) VALUES ('old-done', 2.0, 'finished', 'e', "
            "'m', '{}', '{}', '{}', '{}', '{\"macro_gain\": 1.5}', '[]', '{}', '/r.json', 3.0)"
        )
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION and integrity(path) == "ok"
    assert store.run("old-running")["status"] == "running" and store.run("old-running")["pid"] is None
    assert store.run("old-done")["aggregates"] == {"macro_gain": 1.5} and store.run("old-done")["finished"] == 3.0
    start(store, "new")
    assert store.run("new")["pid"] == os.getpid()
    assert store.interrupt_run("new", "interrupted by SIGTERM") and store.run("new")["status"] == "interrupted"
    assert not store.interrupt_run("new", "again")  # only a running run can be interrupted


def test_every_metric_is_kept_and_read_by_name(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    full = {"a": {**SCORES["a"], "metrics": {"acc,none": [0.5, 0.1], "acc_norm,none": [0.7, 0.09]}}}
    store.put_scores("fp", {"a": "d1"}, SETTINGS, full)
    norm = store.get_scores("fp", {"a": "d1"}, SETTINGS, metrics={"a": "acc_norm,none"})
    assert norm == {"a": {"metric": "acc_norm,none", "value": 0.7, "stderr": 0.09, "n": 10}}
    assert store.get_scores("fp", {"a": "d1"}, SETTINGS)["a"]["value"] == 0.5
    assert store.get_scores("fp", {"a": "d1"}, SETTINGS, metrics={"a": "exact_match,none"}) is None


def test_a_newer_or_foreign_file_is_a_user_error(tmp_path):
    newer = tmp_path / "newer.sqlite"
    Store(newer)
    with sqlite3.connect(newer) as db:
        db.execute("UPDATE meta SET value='9' WHERE key='schema_version'")
    with pytest.raises(UserError, match="schema v9, newer"):
        Store(newer)
    (tmp_path / "notes.txt").write_text("not a database " * 100)
    with pytest.raises(UserError, match="store.path"):
        Store(tmp_path / "notes.txt")


# the app and the results command


def test_a_rerun_reuses_the_merge_and_every_evaluation(tmp_path, cache):
    store = tmp_path / "store.sqlite"

    def merged(out) -> dict:
        path = out.stdout.split("result: ")[-1].strip()
        return json.loads(Path(path).read_text())["models"][-1]

    first = mergeval("+experiment=tiny", f"store.path={store}", cwd=tmp_path)
    assert first.returncode == 0 and first.stdout.count(": evaluating on ") == 4, first.stderr[-2000:]
    assert merged(first)["merge"] == "this run"
    again = mergeval("+experiment=tiny", f"store.path={store}", cwd=tmp_path)
    assert again.returncode == 0 and ": evaluating on " not in again.stdout
    assert merged(again)["merge"] == merged(again)["evaluated"] == "reused from the results store"
    assert merged(again)["fingerprint"] == merged(first)["fingerprint"]
    saved = mergeval("+experiment=tiny", f"store.path={store}", "save_merged=true", cwd=tmp_path)
    assert merged(saved)["merge"] == "this run" and ": evaluating on " not in saved.stdout  # a file needs a merge
    forced = mergeval("+experiment=tiny", f"store.path={store}", "eval.force=true", cwd=tmp_path)
    assert forced.stdout.count(": evaluating on ") == 4
    bad = mergeval("+experiment=tiny", f"store.path={store}", "benchmark.limit=0", cwd=tmp_path)
    assert bad.returncode == 2
    runs = Store(store).runs()
    assert [r["status"] for r in runs] == ["finished"] * 4 + ["failed"]
    assert "benchmark.limit" in runs[-1]["error"] and runs[-1]["result_path"] is None
    assert runs[0]["result_path"].endswith("result.json") and runs[0]["git"] and runs[0]["versions"]["lm_eval"]
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM models").fetchone()[0] == 4
        assert db.execute("SELECT COUNT(*) FROM merges").fetchone()[0] == 1


def test_a_run_reuses_the_evaluations_of_tasks_its_other_settings_cannot_change(tmp_path, cache):
    """tiny's generated tasks are 0-shot log-likelihood tasks: after a run with benchmark.num_fewshot=0, one
    with num_fewshot null and generation kwargs evaluates nothing; one with 2 shots evaluates every model."""
    from mergeval.results.store import settings_hash

    store = tmp_path / "store.sqlite"
    first = mergeval("+experiment=tiny", f"store.path={store}", "benchmark.num_fewshot=0", cwd=tmp_path)
    assert first.returncode == 0 and first.stdout.count(": evaluating on ") == 4, first.stderr[-2000:]
    other = mergeval(
        "+experiment=tiny",
        f"store.path={store}",
        "benchmark.num_fewshot=null",
        "eval.gen_kwargs={max_gen_toks:8}",
        "hydra.run.dir=other",
        cwd=tmp_path,
    )
    assert other.returncode == 0 and ": evaluating on " not in other.stdout, other.stdout[-2000:]
    result = json.loads(Path(other.stdout.split("result: ")[-1].strip()).read_text())
    assert {t: s["num_fewshot"] for t, s in result["task_settings"].items()} == dict.fromkeys(result["tasks"], 0)
    shots = mergeval(
        "+experiment=tiny", f"store.path={store}", "benchmark.num_fewshot=2", "hydra.run.dir=shots", cwd=tmp_path
    )
    assert shots.returncode == 0 and shots.stdout.count(": evaluating on ") == 4
    with sqlite3.connect(store) as db:  # a 0-shot run without kwargs keeps the key a task always had
        keys = {k for (k,) in db.execute("SELECT DISTINCT settings_hash FROM evaluations")}
    run_settings = json.loads(Path(first.stdout.split("result: ")[-1].strip()).read_text())
    assert len(keys) == 2 and settings_hash(_settings_of(run_settings)) in keys


def test_the_results_table_shows_what_tells_a_methods_runs_apart(tmp_path, capsys):
    """A sweep's rows showed every hyperparameter of every run (defaults too), so the table wrapped and the swept
    value was hard to find: a method listed more than once shows the values that differ between its runs, the
    shared ones once below the table; a method listed once shows all of its values; the CSV keeps them all."""
    import csv

    import mergeval.results.__main__ as results

    store = Store(tmp_path / "r.sqlite")
    for i, lam in enumerate((0.5, 1.0, 1.5)):
        start(store, f"ties{i}", "ties", lambda_=lam, density=0.5, sign_rule="sum")
    start(store, "lin", "linear", weights=[0.5, 0.5], normalize=True)
    runs = store.runs(None, None, None, None)
    cells, footer = results.shown_params(runs)
    assert cells == ["lambda_=0.5", "lambda_=1.0", "lambda_=1.5", "weights=[0.5, 0.5] normalize=True"]
    assert footer == ["ties (all 3 runs): density=0.5 sign_rule=sum"]
    args = ["--store", str(tmp_path / "r.sqlite")]
    assert results.main([*args, "--csv", str(tmp_path / "all.csv")]) == 0
    out = capsys.readouterr().out
    assert "lambda_=1.5" in out and "density=0.5" not in out.split("left out above")[0]
    assert "\n  ties (all 3 runs): density=0.5 sign_rule=sum\nwrote 4 row(s)" in out
    assert next(csv.DictReader((tmp_path / "all.csv").open()))["params"] == "lambda_=0.5 density=0.5 sign_rule=sum"
    # the values that differ, in the config's order (as a run listed once shows its own)
    swept = [
        {"method": "dare_ties", "config": {"method": {"name": "dare_ties", "lambda_": lam, "density": d}}}
        for lam, d in ((0.5, 0.3), (1.0, 0.7))
    ]
    assert results.shown_params(swept) == (["lambda_=0.5 density=0.3", "lambda_=1.0 density=0.7"], [])
    assert results.main([*args, "--method", "ties", "--since", "2999-01-01"]) == 0  # nothing listed: no footer
    assert "left out" not in capsys.readouterr().out


def _settings_of(result: dict) -> dict:
    from omegaconf import OmegaConf

    from mergeval.eval.settings import eval_settings

    return eval_settings(OmegaConf.create(result["config"]))


def test_results_command_lists_filters_and_exports(tmp_path, capsys):
    import csv

    import pyarrow.parquet as pq

    import mergeval.results.__main__ as results

    store = Store(tmp_path / "r.sqlite")
    for i, method in enumerate(["ties", "linear", "ties"]):
        start(store, f"run{i}", method, **({"density": 0.5} if method == "ties" else {}))
        if i < 2:
            store.finish_run(
                f"run{i}", **dict(FINISH, aggregates={"macro_gain": 1.5 + i, "macro_og": -0.5, "normalized_mean": None})
            )
    args = ["--store", str(tmp_path / "r.sqlite")]
    assert (
        results.main(
            [
                *args,
                "--method",
                "ties",
                "--status",
                "finished",
                "--csv",
                str(tmp_path / "t.csv"),
                "--parquet",
                str(tmp_path / "t.parquet"),
            ]
        )
        == 0
    )
    (row,) = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert row["run_id"] == "run0" and row["params"] == "density=0.5" and float(row["macro_gain"]) == 1.5
    assert row["commit"] == "abc" and row["merged:a"] == "0.5"
    table = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert [(r["run_id"], r["macro_gain"], r["merged:a"]) for r in table] == [("run0", 1.5, 0.5)]
    assert results.main([*args, "--status", "running", "--csv", str(tmp_path / "r.csv")]) == 0
    assert [r["run_id"] for r in csv.DictReader((tmp_path / "r.csv").open())] == ["run2"]
    assert results.main([*args, "--since", "2999-01-01", "--parquet", str(tmp_path / "none.parquet")]) == 0
    assert pq.read_table(tmp_path / "none.parquet").num_rows == 0
    capsys.readouterr()
    assert results.main(args) == 0 and "3 run(s)" in capsys.readouterr().out
    assert results.main([*args, "--since", "yesterday"]) == 2
    assert capsys.readouterr().err.startswith("mergeval: error: --since:")
    assert results.main(["--store", str(tmp_path / "missing.sqlite")]) == 2
    # --experiment is the modelset: runs of quickstart_registry are told apart by their benchmark
    store.start_run(
        "reg",
        experiment="quickstart",
        method="ties",
        versions={},
        git={},
        config={"method": {"name": "ties"}, "benchmark": {"name": "quickstart_registry"}},
    )
    assert results.main([*args, "--benchmark", "quickstart_registry", "--csv", str(tmp_path / "b.csv")]) == 0
    assert [(r["run_id"], r["benchmark"]) for r in csv.DictReader((tmp_path / "b.csv").open())] == [
        ("reg", "quickstart_registry")
    ]


def test_each_task_is_keyed_by_the_settings_it_can_tell_apart(tmp_path):
    """A task is stored under its own part of the run's settings (eval/settings.py): a run that differs only
    where the task cannot tell (num_fewshot null against 0 where its count is 0; gen_kwargs for a task that
    does not generate) finds it; one that changes its count or, for a generating task, its kwargs does not."""
    from mergeval.eval.settings import PerTask

    zero_shot, gen = {"num_fewshot": 0, "generates": False}, {"num_fewshot": 0, "generates": True}
    quickstart = PerTask({**SETTINGS, "num_fewshot": 0}, {"a": zero_shot, "b": gen})
    registry = PerTask({**SETTINGS, "num_fewshot": None, "gen_kwargs": {"max_gen_toks": 8}}, {"a": zero_shot, "b": gen})
    store = Store(tmp_path / "r.sqlite")
    store.put_scores("fp", DIGESTS, quickstart, SCORES)
    assert store.get_scores("fp", DIGESTS, quickstart) == SCORES
    assert store.get_scores("fp", {"a": "d1"}, registry) == {"a": SCORES["a"]}  # a: nothing it can tell
    assert store.get_scores("fp", DIGESTS, registry) is None  # b generates: its kwargs count
    assert store.claim_or_scores("fp", DIGESTS, registry) == {"a": SCORES["a"]}
    store.put_scores("fp", {"b": "d2"}, registry, {"b": SCORES["b"]})
    assert store.get_scores("fp", DIGESTS, registry) == SCORES
    five_shot = PerTask({**quickstart.run, "fewshot": {"a": 5}}, {"a": {"num_fewshot": 5, "generates": False}})
    assert store.get_scores("fp", {"a": "d1"}, five_shot) is None
    with sqlite3.connect(store.path) as db:
        stored = dict(db.execute("SELECT task || settings_hash, settings FROM evaluations WHERE task='a'"))
    assert list(map(json.loads, stored.values())) == [{**SETTINGS, "num_fewshot": 0}]  # one row, no gen_kwargs


_SETTING_VALUES = st.one_of(st.none(), st.integers(0, 8), st.text(max_size=3))


@given(
    run=st.dictionaries(
        st.sampled_from(["limit", "dtype", "num_fewshot", "fewshot", "gen_kwargs", "backend"]), _SETTING_VALUES
    ),
    count=st.integers(0, 8),
    generates=st.booleans(),
)
def test_a_tasks_settings_replace_only_what_the_task_can_tell(run, count, generates):
    """task_settings: the run's settings with the task's count, without per-entry counts, with generation
    kwargs only for a generating task; equal to the run's (the key every task had before) where nothing
    differs."""
    from mergeval.eval.settings import task_settings

    own = task_settings(run, count, generates)
    assert own["num_fewshot"] == count and "fewshot" not in own
    assert ("gen_kwargs" in own) == (generates and bool(run.get("gen_kwargs")))
    assert {k: v for k, v in own.items() if k not in ("num_fewshot", "gen_kwargs")} == {
        k: v for k, v in run.items() if k not in ("num_fewshot", "gen_kwargs", "fewshot")
    }
    same_count = "num_fewshot" in run and run["num_fewshot"] == count
    kwargs_kept = "gen_kwargs" not in run or (generates and bool(run["gen_kwargs"]))
    if same_count and "fewshot" not in run and kwargs_kept:
        assert own == run


def test_evaluations_stored_under_the_runs_settings_are_still_found(tmp_path):
    """Before per-task keys every task was stored under the run's settings: a run with those very settings
    reuses them; a row under the task's own settings is preferred when both exist."""
    from mergeval.eval.settings import PerTask

    run = {**SETTINGS, "num_fewshot": None, "fewshot": {"a": 3}}
    store = Store(tmp_path / "r.sqlite")
    store.put_scores("fp", DIGESTS, run, SCORES)  # a plain mapping: the old key of every task
    per_task = PerTask(run, {"a": {"num_fewshot": 3, "generates": False}, "b": {"num_fewshot": 0, "generates": False}})
    assert store.get_scores("fp", DIGESTS, per_task) == SCORES
    assert store.samples_paths("fp", DIGESTS, per_task) == {"a": None, "b": None}
    assert store.get_scores("fp", DIGESTS, PerTask({**run, "fewshot": {"a": 4}}, per_task.tasks)) is None
    newer = {**SCORES["a"], "value": 0.75}
    store.put_scores("fp", {"a": "d1"}, per_task, {"a": newer})
    assert store.get_scores("fp", DIGESTS, per_task) == {"a": newer, "b": SCORES["b"]}
    assert store.all_metrics("fp", DIGESTS, per_task)["a"] == {"acc,none": [0.75, 0.1]}


def test_a_task_is_evaluated_once_whatever_the_other_tasks_of_the_run(tmp_path):
    """A run with tasks {a, b} after one with {a}: a is reused, only b is claimed (then stored)."""
    store = Store(tmp_path / "r.sqlite")
    store.put_scores("fp", {"a": "d1"}, SETTINGS, {"a": SCORES["a"]}, samples_path="/s/run1.jsonl")
    assert store.get_scores("fp", DIGESTS, SETTINGS) is None  # not every task: no full hit
    assert store.claim_or_scores("fp", DIGESTS, SETTINGS) == {"a": SCORES["a"]}  # and b is now claimed
    with sqlite3.connect(store.path) as db:
        (claimed,) = db.execute("SELECT tasks_key FROM claims").fetchone()
    from mergeval.results.store import _tasks_key

    assert claimed == _tasks_key({"b": "d2"})
    store.put_scores("fp", {"b": "d2"}, SETTINGS, {"b": SCORES["b"]}, samples_path="/s/run2.jsonl")
    assert store.claim_or_scores("fp", DIGESTS, SETTINGS) == SCORES
    assert store.samples_paths("fp", DIGESTS, SETTINGS) == {"a": "/s/run1.jsonl", "b": "/s/run2.jsonl"}
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT COUNT(*) FROM claims").fetchone() == (0,)


def test_a_merge_key_changes_with_the_methods_implementation_version(monkeypatch):
    """A merge stored by an earlier implementation of a method is never reused for a later one; methods still
    at version 1 keep the keys they always had (no stored merge is orphaned by adding the field)."""
    import dataclasses

    from mergeval.methods import METHODS
    from mergeval.results.store import merge_key

    ties, linear = METHODS["ties"], METHODS["linear"]
    cfg_ties, cfg_linear = ties.config(), linear.config()
    before = merge_key(["b", "e"], cfg_ties, 0)
    unchanged = merge_key(["b", "e"], cfg_linear, 0)
    monkeypatch.setitem(METHODS, "ties", dataclasses.replace(ties, version=ties.version + 1))
    monkeypatch.setitem(METHODS, "linear", dataclasses.replace(linear, version=1))
    assert merge_key(["b", "e"], cfg_ties, 0) != before
    assert merge_key(["b", "e"], cfg_linear, 0) == unchanged
    payload = {"inputs": ["b", "e"], "method": dataclasses.asdict(cfg_linear), "seed": 0, "options": {}}
    import hashlib
    import json

    assert (
        unchanged
        == hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()[
            :32
        ]
    )


def test_a_model_whose_scores_all_come_from_the_store_costs_no_memory_release(tmp_path, cache, monkeypatch):
    """release_memory (a full gc.collect: about 0.3 s per call in a MergeBench mini sweep) runs for a model built
    and evaluated, and for the merge, not for each constituent a later sweep job finds in the store; the tokenizer
    (2-3 s of imports) is loaded once by a run that merges or evaluates, never by one that does neither."""
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    calls, tokenizers = [], []
    monkeypatch.setattr(app, "release_memory", lambda: calls.append(1))
    load_tokenizer = app.load_tokenizer
    monkeypatch.setattr(app, "load_tokenizer", lambda *a, **k: tokenizers.append(1) or load_tokenizer(*a, **k))
    settings = [
        "+experiment=tiny",
        "benchmark.n_items=8",
        "modelset.train.steps=1",
        "eval.dtype=float32",
        f"store.path={tmp_path / 'store.sqlite'}",
    ]
    first = app.run(compose_run_config(settings), tmp_path / "first")
    assert [m.evaluated for m in first.models] == ["this run"] * 4 and len(calls) == 4
    calls.clear()
    again = app.run(compose_run_config(settings + ["method.lambda_=0.5"]), tmp_path / "again")
    assert [m.evaluated for m in again.models] == ["reused from the results store"] * 3 + ["this run"]
    assert len(calls) == 1  # the merge only
    assert len(tokenizers) == 2
    reused = app.run(compose_run_config(settings + ["method.lambda_=0.5"]), tmp_path / "reused")
    assert [m.evaluated for m in reused.models] == ["reused from the results store"] * 4
    assert len(tokenizers) == 2 and reused.models[-1].merge == "reused from the results store"


@pytest.mark.parametrize(
    "url,ok",
    [
        ("postgres//localhost/db", False),
        ("postgresql:/host/db", False),
        ("sqlite:/tmp/r.sqlite", False),
        ("runs//r.sqlite", False),
        ("runs/r.sqlite", True),
        ("sqlite:///r.sqlite", True),
        ("postgres_runs.sqlite", True),
    ],
)
def test_a_store_url_that_misses_its_scheme_separator_is_refused(url, ok, tmp_path, monkeypatch):
    """``postgres//localhost/db`` once made a new SQLite file at that relative path and the run went there."""
    from omegaconf import OmegaConf

    from mergeval.results.store import open_store

    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"store": {"url": url, "path": None}})
    if ok:
        assert open_store(cfg, tmp_path).path == Path(url.removeprefix("sqlite:///"))
    else:
        with pytest.raises(UserError, match="store.url: .* reads as a URL without its '://'"):
            open_store(cfg, tmp_path)
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("field", ["store.url", "--store"])
def test_a_server_faults_fix_names_the_setting_the_location_came_from(field):
    """`results --store postgresql://...` once got "correct the host and port in store.url"."""
    pytest.importorskip("psycopg")
    from mergeval.results.backends.postgres import connect_fault

    line = connect_fault("postgresql://me@h/db", Exception("connection refused"), field).line()
    assert line.startswith(f"mergeval: error: {field}: ") and f"correct the host and port in {field} " in line


def test_a_damaged_row_that_passes_the_integrity_check_is_reported_once_and_skipped(tmp_path, capsys):
    """Undecodable text in a run and invalid JSON in an evaluation's payload: PRAGMA integrity_check passes, and
    the store once failed with a traceback on either. Now each is one line, and the rest of the store is read."""
    path = tmp_path / "s.sqlite"
    store = Store(path)
    for run_id in ("good", "bad"):
        store.start_run(run_id, experiment="e", method="m", config={"seed": 0}, versions={}, git={})
    store.put_scores("fp", DIGESTS, SETTINGS, SCORES)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs SET config=CAST(X'7B80FF7D' AS TEXT) WHERE run_id='bad'")
        db.execute("UPDATE evaluations SET metrics='{not json' WHERE task='a'")
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert [r["run_id"] for r in store.runs()] == ["good"]
    assert [r["run_id"] for r in store.runs()] == ["good"]
    got = store.stored_scores("fp", DIGESTS, SETTINGS)
    assert "a" not in got and "b" in got  # the damaged task counts as not stored: it is evaluated again
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        f"mergeval: results store {path}: run bad is damaged (config: not UTF-8 text); left out",
        f"mergeval: results store {path}: the evaluation of a by model fp is damaged (metrics: not "
        "valid JSON); it is evaluated again and the row replaced",
    ]
    store.put_scores("fp", {"a": DIGESTS["a"]}, SETTINGS, {"a": SCORES["a"]})  # the re-evaluation replaces it
    assert store.stored_scores("fp", DIGESTS, SETTINGS) == store.get_scores("fp", DIGESTS, SETTINGS)
    assert set(store.get_scores("fp", DIGESTS, SETTINGS)) == set(DIGESTS)


def test_the_results_command_lists_the_rest_of_a_store_with_a_damaged_run(tmp_path):
    path = tmp_path / "s.sqlite"
    store = Store(path)
    for run_id in ("good", "bad"):
        store.start_run(run_id, experiment="e", method="m", config={"seed": 0}, versions={}, git={})
    with sqlite3.connect(path) as db:
        db.execute("UPDATE runs SET experiment=CAST(X'80' AS TEXT) WHERE run_id='bad'")
    out = subprocess.run(
        [sys.executable, "-m", "mergeval.results", "--store", str(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"mergeval: results store {path}: run bad is damaged (experiment: not UTF-8 text); left out"
    ]
    assert "good"[:8] in out.stdout or "running" in out.stdout


# ---------------------------------------------------------------- schema v5: runs found by their configuration
# hash (resumable sweeps), and the migration of a v4 store in place


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
