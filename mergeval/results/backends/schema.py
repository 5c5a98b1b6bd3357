"""The results store's schema (v7) as SQL, and the in-place migrations of older SQLite stores.

The DDL is written once, in SQLite's types; a backend adapts it (``ddl``: PostgreSQL gets 8-byte numbers).
A PostgreSQL store is created at the current version; the v1 -> v4 migrations rebuild SQLite tables and only
ever meet SQLite files (PostgreSQL stores did not exist before v5). A later migration must be written for
both (plain ``ALTER TABLE``, as v4 -> v5).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

SCHEMA_VERSION = 7
DEFAULT_METRIC = "acc,none"  # what v2 stored (generated tasks report only acc)

_RUNS_COLUMNS = """
    run_id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ({statuses})),
    experiment TEXT NOT NULL,
    method TEXT NOT NULL,
    config TEXT NOT NULL,
    versions TEXT NOT NULL,
    git TEXT NOT NULL,
    job_dir TEXT,
    timings TEXT,
    aggregates TEXT,
    models TEXT,
    scores TEXT,
    result_path TEXT,
    finished REAL,
    error TEXT,{owner}
    CHECK (status = 'running' OR finished IS NOT NULL),
    CHECK (status <> 'finished' OR (timings IS NOT NULL AND aggregates IS NOT NULL AND models IS NOT NULL
                                    AND scores IS NOT NULL AND result_path IS NOT NULL))"""
# v4 adds the 'interrupted' status and the owning process (host, pid, its start time), so a run whose process
# was killed can be proven dead and marked interrupted by the next process that opens the store.
_RUNS = (
    "CREATE TABLE {name} ("
    + _RUNS_COLUMNS.format(
        statuses="'running', 'finished', 'failed', 'interrupted'",
        owner="\n    host TEXT,\n    pid INTEGER,\n    pid_start INTEGER,",
    )
    + ")"
)
_RUNS_V2 = "CREATE TABLE {name} (" + _RUNS_COLUMNS.format(statuses="'running', 'finished', 'failed'", owner="") + ")"
_EVALUATIONS = """
CREATE TABLE {name} (
    model_fingerprint TEXT NOT NULL,
    task_digest TEXT NOT NULL,
    settings_hash TEXT NOT NULL,
    task TEXT NOT NULL,
    settings TEXT NOT NULL,
    metrics TEXT NOT NULL,
    n INTEGER NOT NULL,
    created REAL NOT NULL,
    samples_path TEXT,
    PRIMARY KEY (model_fingerprint, task_digest, settings_hash))"""
_CURRENT = [
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    _EVALUATIONS.format(name="evaluations"),
    _RUNS.format(name="runs"),
]
_NEW_IN_V2 = [
    "CREATE INDEX runs_by_created ON runs (created)",
    """CREATE TABLE models (
        fingerprint TEXT PRIMARY KEY,
        source TEXT NOT NULL,
        architecture TEXT,
        path TEXT,
        created REAL NOT NULL)""",
    """CREATE TABLE claims (
        model_fingerprint TEXT NOT NULL,
        settings_hash TEXT NOT NULL,
        tasks_key TEXT NOT NULL,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        since REAL NOT NULL,
        PRIMARY KEY (model_fingerprint, settings_hash, tasks_key))""",
    """CREATE TABLE merges (
        merge_key TEXT PRIMARY KEY,
        inputs TEXT NOT NULL,
        method TEXT NOT NULL,
        seed INTEGER,
        options TEXT NOT NULL,
        output_fingerprint TEXT NOT NULL,
        created REAL NOT NULL)""",
]
# v5: a run's configuration hash (resumable sweeps look finished configurations up by it) and a claim's
# heartbeat (``renewed``: a claimant on another host is presumed dead once it stops renewing).
_NEW_IN_V5 = [
    "ALTER TABLE runs ADD COLUMN config_hash TEXT",
    "CREATE INDEX runs_by_config_hash ON runs (config_hash)",
    "ALTER TABLE claims ADD COLUMN renewed REAL",
]
# v6: models are keyed by their identity as evaluated (models/fingerprint.py: the weights with the config and
# tokenizer files), no longer by their tensors alone; ``weights`` keeps the tensors' fingerprint beside it.
# Rows written before are kept for the record but never match a v6 key (an identity is never a tensor
# fingerprint), so no score stored under the old key is served again: each model is evaluated once more.
_NEW_IN_V6 = [
    "ALTER TABLE models ADD COLUMN weights TEXT",
]
# v7: an evaluation keeps its per-item outcomes (``items``: metric key -> {"ids", "values"}, for the metrics
# that are means over items), which paired comparisons need (metrics/paired.py). NULL for rows before: their
# scores stand and are reused; a comparison that reads them takes them as independent.
_NEW_IN_V7 = [
    "ALTER TABLE evaluations ADD COLUMN items TEXT",
]


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _dump(value) -> str:
    """JSON for a stored column: key order kept (tasks and config read as the run wrote them)."""
    return json.dumps(value, separators=(",", ":"), default=str)


def _migrate_v1_to_v2(db: sqlite3.Connection) -> None:
    """v1 -> v2 inside the caller's transaction: runs gain status/provenance/results columns, evaluations gain
    samples_path, models and merges are new. v1 recorded only finished runs; their versions, commit, timings,
    models and scores are taken from their result.json where it still exists, else left empty."""
    old = db.execute("SELECT run_id, created, result_path, experiment, method, config, aggregates FROM runs")
    rows = []
    for run_id, created, result_path, experiment, method, config, aggregates in old.fetchall():
        result = _read_json(Path(result_path))
        rows.append(
            (
                run_id,
                created,
                "finished",
                experiment,
                method,
                config,
                _dump(result.get("versions", {})),
                _dump(result.get("git", {})),
                str(Path(result_path).parent),
                _dump(result.get("timings_s", {})),
                aggregates,
                _dump(result.get("models", [])),
                _dump(result.get("scores", {})),
                result_path,
                created,
                None,
            )
        )
    db.execute(_RUNS_V2.format(name="runs_v2"))
    db.executemany(f"INSERT INTO runs_v2 VALUES ({','.join('?' * 16)})", rows)
    db.execute("DROP TABLE runs")
    db.execute("ALTER TABLE runs_v2 RENAME TO runs")
    db.execute("ALTER TABLE evaluations ADD COLUMN samples_path TEXT")
    for statement in _NEW_IN_V2:
        db.execute(statement)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


def _migrate_v2_to_v3(db: sqlite3.Connection) -> None:
    """v2 -> v3 inside the caller's transaction: an evaluation keeps every metric by name. v2 stored the
    accuracy of generated tasks only, so each row becomes ``{"acc,none": [acc, stderr]}``."""
    rows = db.execute(
        "SELECT model_fingerprint, task_digest, settings_hash, task, settings, acc, stderr, n, "
        "created, samples_path FROM evaluations"
    ).fetchall()
    db.execute(_EVALUATIONS.format(name="evaluations_v3"))
    db.executemany(
        "INSERT INTO evaluations_v3 VALUES (?,?,?,?,?,?,?,?,?)",
        [(*r[:5], _canonical({DEFAULT_METRIC: [r[5], r[6]]}), *r[7:]) for r in rows],
    )
    db.execute("DROP TABLE evaluations")
    db.execute("ALTER TABLE evaluations_v3 RENAME TO evaluations")
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


def _migrate_v3_to_v4(db: sqlite3.Connection) -> None:
    """v3 -> v4 inside the caller's transaction: runs may be ``interrupted`` and record their process. Runs
    from before have no process, so a stale ``running`` one among them is never reaped automatically."""
    db.execute(_RUNS.format(name="runs_v4"))
    columns = [row[1] for row in db.execute("PRAGMA table_info(runs)").fetchall()]
    db.execute(f"INSERT INTO runs_v4 ({', '.join(columns)}) SELECT {', '.join(columns)} FROM runs")
    db.execute("DROP TABLE runs")
    db.execute("ALTER TABLE runs_v4 RENAME TO runs")
    db.execute("CREATE INDEX IF NOT EXISTS runs_by_created ON runs (created)")
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


def _migrate_v4_to_v5(db: sqlite3.Connection) -> None:
    """v4 -> v5 inside the caller's transaction: runs gain ``config_hash`` (NULL for the runs before: a resumed
    sweep reruns them once), claims gain their heartbeat ``renewed`` (NULL: the claim's ``since`` stands in)."""
    for statement in _NEW_IN_V5:
        db.execute(statement)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


def _migrate_v5_to_v6(db) -> None:
    """v5 -> v6 inside the caller's transaction (SQLite or PostgreSQL): models gain ``weights``. Rows under the
    old keys stay; no v6 key matches them."""
    for statement in _NEW_IN_V6:
        db.execute(statement)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


def _migrate_v6_to_v7(db) -> None:
    """v6 -> v7 inside the caller's transaction (SQLite or PostgreSQL): evaluations gain ``items``."""
    for statement in _NEW_IN_V7:
        db.execute(statement)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


def stale_rows(db) -> tuple[int, int]:
    """(evaluations, merges) a store holds: before a v5 -> v6 migration, all keyed by tensors alone."""
    return (
        db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0],
        db.execute("SELECT COUNT(*) FROM merges").fetchone()[0],
    )


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def create(db, ddl) -> None:
    """A new store at the current version, inside the caller's transaction; ``ddl`` adapts each statement."""
    for statement in _CURRENT + _NEW_IN_V2 + _NEW_IN_V5 + _NEW_IN_V6 + _NEW_IN_V7:
        db.execute(ddl(statement))
    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))


def migrate(db, version: int) -> None:
    """A store of schema ``version`` (1-6; below 5 only SQLite files exist) to the current one, inside the
    caller's transaction."""
    if version == 1:
        _migrate_v1_to_v2(db)
    if version <= 2:
        _migrate_v2_to_v3(db)
    if version <= 3:
        _migrate_v3_to_v4(db)
    if version <= 4:
        _migrate_v4_to_v5(db)
    if version <= 5:
        _migrate_v5_to_v6(db)
    _migrate_v6_to_v7(db)
