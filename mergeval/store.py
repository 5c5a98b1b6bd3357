"""The SQLite results store: runs, models, merges and evaluations, shared by every run and sweep.

One database file in WAL mode, so several sweep workers (the joblib launcher's
processes, Slurm jobs on one node) read and write at once. Every write is one
``BEGIN IMMEDIATE`` transaction: a process killed at any point leaves either
the whole write or none of it, and concurrent writers wait for each other
(busy timeout) instead of failing or losing rows.

Tables (schema v5; v1-v4 databases are migrated in place on open):

- ``runs``: one row per run. ``start_run`` inserts it as ``running`` with its
  process (host, pid, start time); ``finish_run`` completes it exactly once
  (``finished``, with result path, aggregates, scores and timings);
  ``fail_run`` marks it ``failed``, ``interrupt_run`` ``interrupted`` (SIGTERM,
  Ctrl-C). A run killed without a chance to say so (SIGKILL, power loss) stays
  ``running`` until the next process on its host opens the store and proves its
  process gone: then it becomes ``interrupted`` with a note. Never half finished.
  ``config_hash`` (v5, nullable, indexed) identifies the run's configuration, so
  a resumed sweep finds the configurations already finished (``finished_run``).
- ``models``: content fingerprint -> source and architecture (from config.json).
- ``evaluations``: (model fingerprint, task digest, settings hash) -> every
  metric the task reported (``{"acc_norm,none": [value, stderr], ...}``; a
  run reads the one it reports, so changing ``benchmark.metrics`` needs no
  re-evaluation and a stored number is never read under another metric's
  name), n, and the path of logged samples if any. The settings are
  everything besides model and task data that can change a score (limit,
  few-shot, precision, batch size, device, lm-eval version); a change to any
  key field is a miss. lm-eval's own request cache is not involved.
- ``merges``: ``merge_key`` (ordered input fingerprints, method config, seed)
  -> the merged model's fingerprint, so a merge whose output was already
  evaluated need not be redone.
- ``claims``: which process is evaluating a model right now, so parallel
  sweep jobs that share a constituent evaluate it once (``claim_or_scores``).

Faults: opening checks that the file is a database, passes ``PRAGMA
quick_check`` and can be written (once per process and path); an SQLite error
later (a page corrupted mid-run, a full disk, a file made read-only) becomes a
one-line ``UserError`` naming the file, raised after the transaction rolled
back, so the store is never left half-written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from pathlib import Path

from mergeval import proc
from mergeval.errors import UserError
from mergeval.paths import make_dirs

SCHEMA_VERSION = 5
DEFAULT_METRIC = "acc,none"  # what v2 stored (generated tasks report only acc)
CLAIM_TTL_S = 6 * 3600  # a claim from another host older than this is presumed dead (its evaluation never came)
BUSY_TIMEOUT_S = 120  # a writer waits this long for another process's transaction before giving up
STATUSES = ("running", "finished", "failed", "interrupted")

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
_RUNS = "CREATE TABLE {name} (" + _RUNS_COLUMNS.format(
    statuses="'running', 'finished', 'failed', 'interrupted'",
    owner="\n    host TEXT,\n    pid INTEGER,\n    pid_start INTEGER,") + ")"
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
_JSON_COLUMNS = ("config", "versions", "git", "timings", "aggregates", "models", "scores")


class StoreError(RuntimeError):
    """A write the store's state forbids: starting a run id twice, finishing a run that is not running."""


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _dump(value) -> str:
    """JSON for a stored column: key order kept (tasks and config read as the run wrote them)."""
    return json.dumps(value, separators=(",", ":"), default=str)


def settings_hash(settings: Mapping) -> str:
    """sha256 of the settings as canonical JSON (sorted keys), first 16 hex digits."""
    return hashlib.sha256(_canonical(settings).encode()).hexdigest()[:16]


def merge_key(input_fingerprints: Sequence[str], method_config, seed: int | None,
              options: Mapping | None = None) -> str:
    """Identity of a merge: sha256 of canonical JSON {inputs, method, seed, options}, first 32 hex digits.

    The inputs stay in the order given (base first, then the experts in modelset
    order): per-expert weights and slerp's target depend on it. The method
    config includes its name; the seed is always part of the key, even for
    deterministic methods (a needless miss is cheap, a wrong hit is not);
    ``options`` holds run settings outside the method that change the output
    (e.g. vocab_policy).
    """
    payload = {"inputs": list(input_fingerprints), "method": _as_mapping(method_config), "seed": seed,
               "options": dict(options or {})}
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()[:32]


def _as_mapping(config) -> dict:
    """A method config as a plain dict: its typed dataclass (as the app holds it) or a mapping."""
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)


ARCHITECTURE_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings",
                     "tie_word_embeddings", "torch_dtype")


def architecture_of(hf_config: Mapping) -> dict:
    """The fields of a Hugging Face config.json that describe the architecture (those present)."""
    return {k: hf_config[k] for k in ARCHITECTURE_KEYS if k in hf_config}


class Store:
    """The results store at ``path`` (created, or migrated to the current schema, on open).

    Every method opens its own short-lived connection, so a Store may be shared
    across threads and survives ``fork``; each write is one transaction.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            make_dirs(self.path.parent)
        except OSError as err:
            raise UserError("store.path", f"cannot create {self.path} ({err.strerror}: {err.filename})",
                            "point store.path at a writable location") from err
        self._ensure_schema()
        if self.path.resolve() not in _CHECKED:  # once per process: quick_check reads every page
            self._check_health()
            _CHECKED.add(self.path.resolve())
        self.reap_dead_runs()

    def _check_health(self) -> None:
        """The file passes ``PRAGMA quick_check`` and accepts a write (a rolled-back one)."""
        with self._read() as db:
            found = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
        if found != ["ok"]:
            raise UserError("store.path", f"{self.path} is damaged ({'; '.join(found[:2])})", _DAMAGED_FIX)
        with self._faults(), closing(self._connect()) as db:  # a read-only file fails here, not mid-run
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("UPDATE meta SET value=value WHERE key='schema_version'")
            finally:
                db.execute("ROLLBACK")

    # connections and transactions

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)  # we issue BEGIN ourselves
        db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
        db.execute("PRAGMA journal_mode=WAL")
        return db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; IMMEDIATE takes the write lock up front, so two writers never deadlock."""
        with self._faults(), closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                if db.in_transaction:
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error:  # the failure already ended it (SQLite rolls back on some errors)
                        pass
                raise
            db.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._faults(), closing(self._connect()) as db:
            yield db

    @contextmanager
    def _faults(self) -> Iterator[None]:
        """An SQLite error the environment caused becomes one line naming the store; IntegrityError (a write
        the schema forbids) and anything else stay as they are."""
        try:
            yield
        except sqlite3.IntegrityError:
            raise
        except sqlite3.DatabaseError as err:
            line = _store_fault(self.path, err)
            if line is None:
                raise
            raise line from err

    def _ensure_schema(self) -> None:
        with self._read() as db:
            if self._version(db) == SCHEMA_VERSION:
                return
        with self._write() as db:  # re-read under the lock: another process may have just migrated
            version = self._version(db)
            if version == 0:
                for statement in _CURRENT + _NEW_IN_V2 + _NEW_IN_V5:
                    db.execute(statement)
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif version in (1, 2, 3, 4):
                if version == 1:
                    _migrate_v1_to_v2(db)
                if version <= 2:
                    _migrate_v2_to_v3(db)
                if version <= 3:
                    _migrate_v3_to_v4(db)
                _migrate_v4_to_v5(db)
            elif version > SCHEMA_VERSION:
                raise UserError("store.path", f"{self.path} has schema v{version}, newer than this mergeval "
                                f"(v{SCHEMA_VERSION})", "upgrade mergeval or use another store.path")

    @staticmethod
    def _version(db: sqlite3.Connection) -> int:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone():
            return 0
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0]) if row else 0

    def schema_version(self) -> int:
        with self._read() as db:
            return self._version(db)

    # evaluations

    def get_scores(self, fingerprint: str, digests: Mapping[str, str], settings: Mapping,
                   metrics: Mapping[str, str] | None = None) -> dict[str, dict] | None:
        """{task: {metric, value, stderr, n}} if every task is stored for this model and settings, else None.
        ``metrics`` (task -> ``"metric,filter"``) picks what each task reports; default ``acc,none``."""
        with self._read() as db:
            return _scores(db, fingerprint, digests, settings_hash(settings), metrics)

    def claim_or_scores(self, fingerprint: str, digests: Mapping[str, str], settings: Mapping,
                        on_wait: Callable[[], None] | None = None, poll_s: float = 2.0,
                        metrics: Mapping[str, str] | None = None) -> dict[str, dict]:
        """{task: scores} of the tasks already stored for this model and settings; when that is not every
        task of ``digests``, this process has claimed the evaluation of the missing ones.

        A task is evaluated once per model, task digest and settings, whatever other tasks a run has.
        Parallel sweep workers share constituents: the first to ask claims the missing tasks; the others
        wait (``on_wait`` is called once) until their scores arrive, then reuse them. The claim ends with
        ``put_scores`` of those tasks or ``release_claims``; a claim whose process is gone (same host, pid
        not running) or that is older than CLAIM_TTL_S (another host) is taken over.
        """
        key = settings_hash(settings)
        waited = False
        while True:
            with self._write() as db:
                got = _stored(db, fingerprint, digests, key, metrics)
                missing = {task: digest for task, digest in digests.items() if task not in got}
                if not missing:
                    return got
                tasks = _tasks_key(missing)
                holder = db.execute("SELECT host, pid, since FROM claims WHERE model_fingerprint=? AND "
                                    "settings_hash=? AND tasks_key=?", (fingerprint, key, tasks)).fetchone()
                if holder is None or not _claim_alive(*holder):
                    now = time.time()
                    db.execute("INSERT OR REPLACE INTO claims (model_fingerprint, settings_hash, tasks_key, host, "
                               "pid, since, renewed) VALUES (?,?,?,?,?,?,?)",
                               (fingerprint, key, tasks, socket.gethostname(), os.getpid(), now, now))
                    return got
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            time.sleep(poll_s)

    def release_claims(self) -> None:
        """Drop every evaluation claim of this process (its run failed before scoring)."""
        with self._write() as db:
            db.execute("DELETE FROM claims WHERE host=? AND pid=?", (socket.gethostname(), os.getpid()))

    def samples_paths(self, fingerprint: str, digests: Mapping[str, str], settings: Mapping) -> dict[str, str | None]:
        """task -> the file its per-item samples were written to (None: stored without samples). Tasks
        evaluated in different runs have different files."""
        with self._read() as db:
            rows = db.execute(
                "SELECT task, samples_path FROM evaluations WHERE model_fingerprint=? AND settings_hash=? "
                f"AND task_digest IN ({','.join('?' * len(digests))})",
                (fingerprint, settings_hash(settings), *digests.values())).fetchall()
        return {task: path for task, path in rows}

    def all_metrics(self, fingerprint: str, digests: Mapping[str, str], settings: Mapping) -> dict[str, dict]:
        """task -> every metric stored for it (``{"acc,none": [value, stderr], ...}``), for the tasks stored."""
        with self._read() as db:
            rows = db.execute(
                "SELECT task, metrics FROM evaluations WHERE model_fingerprint=? AND settings_hash=? "
                f"AND task_digest IN ({','.join('?' * len(digests))})",
                (fingerprint, settings_hash(settings), *digests.values())).fetchall()
        return {task: json.loads(metrics) for task, metrics in rows if task in digests}

    def put_scores(self, fingerprint: str, digests: Mapping[str, str], settings: Mapping,
                   scores: Mapping[str, Mapping], samples_path: str | None = None) -> None:
        """Store one model's scores on several tasks: all tasks or none (one transaction); a re-evaluation replaces.
        Each score is ``{metric, value, stderr, n}``, with ``metrics`` (every key -> [value, stderr]) when the
        task reported more than the one shown."""
        key, now = settings_hash(settings), time.time()
        with self._write() as db:
            db.executemany(
                "INSERT OR REPLACE INTO evaluations (model_fingerprint, task_digest, settings_hash, task, settings, "
                "metrics, n, created, samples_path) VALUES (?,?,?,?,?,?,?,?,?)",
                [(fingerprint, digests[task], key, task, _canonical(settings), _canonical(_all_metrics(s)), s["n"],
                  now, samples_path) for task, s in scores.items()])
            # this process's claims on the model end here (it may have evaluated more tasks than it claimed: a
            # group is evaluated whole when one of its members is missing)
            db.execute("DELETE FROM claims WHERE model_fingerprint=? AND settings_hash=? AND (tasks_key=? OR "
                       "(host=? AND pid=?))", (fingerprint, key, _tasks_key(digests), socket.gethostname(), os.getpid()))

    # models and merges

    def put_model(self, fingerprint: str, source: str, architecture: Mapping | None = None,
                  path: str | None = None) -> None:
        """Record a model the first time its fingerprint is seen (a copy elsewhere keeps the first row)."""
        with self._write() as db:
            db.execute("INSERT INTO models VALUES (?,?,?,?,?) ON CONFLICT (fingerprint) DO NOTHING",
                       (fingerprint, source, None if architecture is None else _canonical(architecture), path,
                        time.time()))

    def model(self, fingerprint: str) -> dict | None:
        with self._read() as db:
            row = db.execute("SELECT source, architecture, path FROM models WHERE fingerprint=?",
                             (fingerprint,)).fetchone()
        if row is None:
            return None
        return {"fingerprint": fingerprint, "source": row[0], "architecture": row[1] and json.loads(row[1]),
                "path": row[2]}

    def get_merge(self, key: str) -> str | None:
        """The output fingerprint of the merge with this ``merge_key``, if it was ever done."""
        with self._read() as db:
            row = db.execute("SELECT output_fingerprint FROM merges WHERE merge_key=?", (key,)).fetchone()
        return row[0] if row else None

    def evaluated_merge(self, key: str, digests: Mapping[str, str], settings: Mapping,
                        metrics: Mapping[str, str] | None = None) -> str | None:
        """The output fingerprint of merge ``key`` if it was done and its output scored on all these tasks and
        settings (then neither the merge nor its evaluation needs redoing), else None."""
        output = self.get_merge(key)
        done = output is not None and self.get_scores(output, digests, settings, metrics) is not None
        return output if done else None

    def put_merge(self, key: str, inputs: Sequence[str], method_config, seed: int | None,
                  output_fingerprint: str, options: Mapping | None = None) -> None:
        """Record a merge's output; the first record of a key is kept (merges are deterministic)."""
        with self._write() as db:
            db.execute("INSERT INTO merges VALUES (?,?,?,?,?,?,?) ON CONFLICT (merge_key) DO NOTHING",
                       (key, _canonical(list(inputs)), _canonical(_as_mapping(method_config)), seed,
                        _canonical(dict(options or {})), output_fingerprint, time.time()))

    # runs

    def start_run(self, run_id: str, *, experiment: str, method: str, config: Mapping, versions: Mapping,
                  git: Mapping, job_dir: str | None = None, config_hash: str | None = None) -> None:
        """Insert the run as ``running``. Raises StoreError if the run id is already in the store.
        ``config_hash`` identifies the configuration for ``finished_run`` (resumable sweeps)."""
        try:
            with self._write() as db:
                db.execute("INSERT INTO runs (run_id, created, status, experiment, method, config, versions, git, "
                           "job_dir, host, pid, pid_start, config_hash) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                           (run_id, time.time(), "running", experiment, method, _dump(config),
                            _dump(versions), _dump(git), job_dir, *proc.me(), config_hash))
        except sqlite3.IntegrityError as err:
            raise StoreError(f"run {run_id} is already in the store") from err

    def finish_run(self, run_id: str, *, result_path: str, aggregates: Mapping, timings: Mapping,
                   models: Sequence[Mapping], scores: Mapping) -> None:
        """Mark a running run finished with its results, exactly once.

        Raises StoreError (and changes nothing) if the run is unknown or not
        ``running``: finishing twice, or finishing a failed run, is a bug.
        """
        with self._write() as db:
            changed = db.execute(
                "UPDATE runs SET status='finished', finished=?, result_path=?, aggregates=?, timings=?, models=?, "
                "scores=? WHERE run_id=? AND status='running'",
                (time.time(), str(result_path), _dump(aggregates), _dump(timings), _dump(list(models)),
                 _dump(scores), run_id)).rowcount
        if changed != 1:
            state = self._status(run_id)
            raise StoreError(f"run {run_id} cannot be finished: it is {state or 'not in the store'}")

    def fail_run(self, run_id: str, error: str, timings: Mapping | None = None) -> bool:
        """Mark a running run failed; False (and no change) if it is not running. Never raises on state,
        so it is safe in an error handler."""
        with self._write() as db:
            return db.execute("UPDATE runs SET status='failed', finished=?, error=?, timings=? "
                              "WHERE run_id=? AND status='running'",
                              (time.time(), error, None if timings is None else _dump(timings),
                               run_id)).rowcount == 1

    def interrupt_run(self, run_id: str, note: str, timings: Mapping | None = None) -> bool:
        """Mark a running run interrupted (SIGTERM, Ctrl-C); like ``fail_run``, never raises on state."""
        with self._write() as db:
            return db.execute("UPDATE runs SET status='interrupted', finished=?, error=?, timings=? "
                              "WHERE run_id=? AND status='running'",
                              (time.time(), note, None if timings is None else _dump(timings),
                               run_id)).rowcount == 1

    def reap_dead_runs(self) -> list[str]:
        """Runs left ``running`` by a process of this host that is provably gone (killed) become ``interrupted``
        with a note, and that process's evaluation claims are dropped; returns their run ids. Runs of other
        hosts, and runs from before schema v4 (no process recorded), are left as they are."""
        with self._read() as db:
            rows = db.execute("SELECT run_id, host, pid, pid_start FROM runs WHERE status='running' AND host=?",
                              (socket.gethostname(),)).fetchall()
            claims = db.execute("SELECT DISTINCT pid FROM claims WHERE host=?", (socket.gethostname(),)).fetchall()
        dead = [r for r in rows if proc.gone(r[1], r[2], r[3])]
        dead_claims = [pid for (pid,) in claims if pid != os.getpid() and proc.gone(socket.gethostname(), pid)]
        if not dead and not dead_claims:
            return []
        with self._write() as db:
            for run_id, host, pid, _ in dead:
                db.execute("UPDATE runs SET status='interrupted', finished=?, error=? WHERE run_id=? AND "
                           "status='running'", (time.time(), f"process {pid} on {host} ended without finishing "
                                                "(killed?); found by a later run", run_id))
            for pid in dead_claims:
                db.execute("DELETE FROM claims WHERE host=? AND pid=?", (socket.gethostname(), pid))
        return [r[0] for r in dead]

    def _status(self, run_id: str) -> str | None:
        with self._read() as db:
            row = db.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return row[0] if row else None

    def runs(self, experiment: str | None = None, method: str | None = None, status: str | None = None,
             since: float | None = None) -> list[dict]:
        """Runs, oldest first, filtered by modelset (experiment), method, status and start time (epoch s)."""
        filters = [(f"{col}=?", val) for col, val in (("experiment", experiment), ("method", method),
                                                      ("status", status)) if val is not None]
        if since is not None:
            filters.append(("created>=?", since))
        return self._select(filters)

    def run(self, run_id: str) -> dict | None:
        found = self._select([("run_id=?", run_id)])
        return found[0] if found else None

    def finished_run(self, config_hash: str) -> dict | None:
        """The newest finished run with this configuration hash (as ``run`` returns it), or None: a resumed
        sweep skips a configuration that has one."""
        found = self._select([("config_hash=?", config_hash), ("status=?", "finished")])
        return found[-1] if found else None

    def _select(self, filters: list[tuple[str, object]]) -> list[dict]:
        where = " WHERE " + " AND ".join(f for f, _ in filters) if filters else ""
        with self._read() as db:
            cursor = db.execute(f"SELECT * FROM runs{where} ORDER BY created, run_id", [v for _, v in filters])
            names = [d[0] for d in cursor.description]
            rows = cursor.fetchall()
        return [{k: (json.loads(v) if k in _JSON_COLUMNS and v is not None else v) for k, v in zip(names, row)}
                for row in rows]

def _migrate_v1_to_v2(db: sqlite3.Connection) -> None:
    """v1 -> v2 inside the caller's transaction: runs gain status/provenance/results columns, evaluations gain
    samples_path, models and merges are new. v1 recorded only finished runs; their versions, commit, timings,
    models and scores are taken from their result.json where it still exists, else left empty."""
    old = db.execute("SELECT run_id, created, result_path, experiment, method, config, aggregates FROM runs")
    rows = []
    for run_id, created, result_path, experiment, method, config, aggregates in old.fetchall():
        result = _read_json(Path(result_path))
        rows.append((run_id, created, "finished", experiment, method, config,
                     _dump(result.get("versions", {})), _dump(result.get("git", {})),
                     str(Path(result_path).parent), _dump(result.get("timings_s", {})), aggregates,
                     _dump(result.get("models", [])), _dump(result.get("scores", {})), result_path,
                     created, None))
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
    rows = db.execute("SELECT model_fingerprint, task_digest, settings_hash, task, settings, acc, stderr, n, "
                      "created, samples_path FROM evaluations").fetchall()
    db.execute(_EVALUATIONS.format(name="evaluations_v3"))
    db.executemany("INSERT INTO evaluations_v3 VALUES (?,?,?,?,?,?,?,?,?)",
                   [(*r[:5], _canonical({DEFAULT_METRIC: [r[5], r[6]]}), *r[7:]) for r in rows])
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


_CHECKED: set[Path] = set()  # stores this process has health-checked
_DAMAGED_FIX = ("move the file aside and rerun (evaluations are then recomputed), or recover what it holds "
                "with `sqlite3 FILE .recover | sqlite3 NEW`")


def _store_fault(path: Path, err: sqlite3.DatabaseError) -> UserError | None:
    """The one-line error for an SQLite failure the environment caused, or None for any other."""
    code = getattr(err, "sqlite_errorname", "") or ""
    if code.startswith("SQLITE_READONLY") or "readonly database" in str(err):
        return UserError("store.path", f"{path} is read-only ({err})",
                         "make the file and its directory writable, or point store.path elsewhere")
    if code in ("SQLITE_FULL",) or "disk is full" in str(err):
        return UserError("store.path", f"no space left for {path} ({err})",
                         "free some space there, or point store.path at another file system")
    if code in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or code.startswith("SQLITE_CORRUPT") or \
            "malformed" in str(err) or "not a database" in str(err):
        return UserError("store.path", f"{path} is damaged or not a results store ({err})", _DAMAGED_FIX)
    if code.startswith("SQLITE_CANTOPEN") or code.startswith("SQLITE_IOERR") or code.startswith("SQLITE_PERM"):
        return UserError("store.path", f"cannot read or write {path} ({err})",
                         "check the file's permissions and the device, or point store.path elsewhere")
    if code.startswith("SQLITE_BUSY") or "database is locked" in str(err):
        return UserError("store.path", f"{path} stayed locked by another process for over {BUSY_TIMEOUT_S} s",
                         "wait for that process, or use another store.path (a network file system cannot "
                         "hold an SQLite store safely)")
    return None


def _all_metrics(score: Mapping) -> dict:
    return dict(score.get("metrics") or {score["metric"]: [score["value"], score["stderr"]]})


def _stored(db: sqlite3.Connection, fingerprint: str, digests: Mapping[str, str], key: str,
            metrics: Mapping[str, str] | None = None) -> dict[str, dict]:
    """{task: {metric, value, stderr, n}} of the tasks of ``digests`` stored for this model and settings (any
    subset); a task stored without the metric asked for counts as not stored."""
    rows = db.execute("SELECT task, metrics, n FROM evaluations WHERE model_fingerprint=? AND settings_hash=? "
                      f"AND task_digest IN ({','.join('?' * len(digests))})", (fingerprint, key, *digests.values()))
    out = {}
    for task, stored, n in rows:
        metric = (metrics or {}).get(task, DEFAULT_METRIC)
        values = json.loads(stored)
        if task in digests and metric in values:
            out[task] = {"metric": metric, "value": values[metric][0], "stderr": values[metric][1], "n": n}
    return out


def _scores(db: sqlite3.Connection, fingerprint: str, digests: Mapping[str, str], key: str,
            metrics: Mapping[str, str] | None = None) -> dict | None:
    got = _stored(db, fingerprint, digests, key, metrics)
    return got if set(got) == set(digests) else None


def _tasks_key(digests: Mapping[str, str]) -> str:
    return hashlib.sha256(_canonical(sorted(digests.values())).encode()).hexdigest()[:16]


def _claim_alive(host: str, pid: int, since: float) -> bool:
    """Whether a claim's process may still be evaluating: on this host, unless its process is gone (this very
    process's stale claims never block it); elsewhere, whether the claim is younger than CLAIM_TTL_S."""
    if host != socket.gethostname():
        return time.time() - since < CLAIM_TTL_S
    return pid != os.getpid() and not proc.gone(host, pid)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def open_store(cfg, cache: Path) -> Store:
    """The results store at ``store.path``, default ``<cache>/results.sqlite``."""
    return Store(Path(cfg.store.path).expanduser() if cfg.store.path else cache / "results.sqlite")


def record_models(store: Store, models) -> None:
    """Each constituent's fingerprint, source and architecture (from its config.json) in the models table;
    ``models`` are ModelInfo rows, the first one the base."""
    for info in models:
        try:  # the in-memory merge has the base's architecture
            source_dir = Path(info.path or models[0].path)
            arch = architecture_of(json.loads((source_dir / "config.json").read_text()))
        except (OSError, TypeError, ValueError):  # no path or no readable config.json: the row keeps no architecture
            arch = None
        store.put_model(info.fingerprint, info.source, arch, info.path)
