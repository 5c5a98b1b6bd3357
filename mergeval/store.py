"""The SQLite results store: evaluations reused across runs, and every finished run.

One database file (WAL mode, so several sweep workers can write at once). An
evaluation is keyed by what determines its outcome: the model's content
fingerprint, the task's digest (its YAML and data), and the settings (limit,
few-shot, precision, batch size, lm-eval version). A constituent evaluated once
is never evaluated again for the same key, in any run or sweep; a change to any
key field is a miss. lm-eval's own request cache is not involved.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from contextlib import closing
from pathlib import Path

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS evaluations (
    model_fingerprint TEXT NOT NULL,
    task_digest TEXT NOT NULL,
    settings_hash TEXT NOT NULL,
    task TEXT NOT NULL,
    settings TEXT NOT NULL,
    acc REAL NOT NULL,
    stderr REAL NOT NULL,
    n INTEGER NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (model_fingerprint, task_digest, settings_hash)
);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    result_path TEXT NOT NULL,
    experiment TEXT NOT NULL,
    method TEXT NOT NULL,
    config TEXT NOT NULL,
    aggregates TEXT NOT NULL
);
"""


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


class Store:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db, db:
            db.executescript(_SCHEMA)
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=60)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA busy_timeout=60000")
        return db

    def get_scores(self, fingerprint: str, digests: dict[str, str], settings: dict) -> dict[str, dict] | None:
        """{task: {acc, stderr, n}} if every task is stored for this model and settings, else None."""
        key = settings_hash(settings)
        with closing(self._connect()) as db:
            rows = {task: (acc, stderr, n) for task, acc, stderr, n in db.execute(
                "SELECT task, acc, stderr, n FROM evaluations WHERE model_fingerprint=? AND settings_hash=? "
                f"AND task_digest IN ({','.join('?' * len(digests))})", (fingerprint, key, *digests.values()))}
        if set(rows) != set(digests):
            return None
        return {task: {"acc": a, "stderr": s, "n": n} for task, (a, s, n) in rows.items()}

    def put_scores(self, fingerprint: str, digests: dict[str, str], settings: dict, scores: dict[str, dict]) -> None:
        key, now = settings_hash(settings), time.time()
        with closing(self._connect()) as db, db:  # one transaction: all tasks or none
            db.executemany("INSERT OR REPLACE INTO evaluations VALUES (?,?,?,?,?,?,?,?,?)", [
                (fingerprint, digests[task], key, task, json.dumps(settings, sort_keys=True), s["acc"], s["stderr"],
                 s["n"], now) for task, s in scores.items()])

    def runs(self, experiment: str | None = None, method: str | None = None) -> list[dict]:
        """Finished runs, oldest first, optionally filtered by modelset (experiment) and method name."""
        query, args = "SELECT run_id, created, result_path, experiment, method, config, aggregates FROM runs", []
        filters = [(col, val) for col, val in (("experiment", experiment), ("method", method)) if val is not None]
        if filters:
            query += " WHERE " + " AND ".join(f"{col}=?" for col, _ in filters)
            args = [val for _, val in filters]
        with closing(self._connect()) as db:
            rows = db.execute(query + " ORDER BY created", args).fetchall()
        return [dict(run_id=r[0], created=r[1], result_path=r[2], experiment=r[3], method=r[4],
                     config=json.loads(r[5]), aggregates=json.loads(r[6])) for r in rows]

    def record_run(self, run_id: str, result_path: Path, experiment: str, method: str, config: dict,
                   aggregates: dict) -> None:
        with closing(self._connect()) as db, db:
            db.execute("INSERT OR IGNORE INTO runs VALUES (?,?,?,?,?,?,?)",
                       (run_id, time.time(), str(result_path), experiment, method, json.dumps(config),
                        json.dumps(aggregates)))
