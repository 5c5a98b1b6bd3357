"""The results store: runs, models, merges and evaluations, shared by every run and sweep.

It lives in an SQLite file (the default, ``<cache_dir>/results.sqlite``: one
machine, no setup) or on a PostgreSQL server (``store.url=postgresql://...``:
many machines); ``mergeval.results.backends`` holds what differs between the
two, this module every query. Every write is one transaction, one writer at a
time: a process killed at any point leaves either the whole write or none of
it, and concurrent writers wait for each other instead of failing or losing
rows.

Tables (schema v7, ``results/backends/schema.py``; older stores are migrated in place on open):

- ``runs``: one row per run. ``start_run`` inserts it as ``running`` with its
  process (host, pid, start time); ``finish_run`` completes it exactly once
  (``finished``, with result path, aggregates, scores and timings);
  ``fail_run`` marks it ``failed``, ``interrupt_run`` ``interrupted`` (SIGTERM,
  Ctrl-C). A run killed without a chance to say so (SIGKILL, power loss) stays
  ``running`` until the next process on its host opens the store and proves its
  process gone: then it becomes ``interrupted`` with a note. Never half finished.
  ``config_hash`` (v5, nullable, indexed) identifies the run's configuration, so
  a resumed sweep finds the configurations already finished (``finished_run``).
- ``models``: model identity -> source, architecture (from config.json) and the
  weights' fingerprint. A model's identity (``models.fingerprint.model_identity``,
  called its fingerprint in the columns below) covers its tensors and every file
  that can change its outputs: config, generation config, the tokenizer it is
  evaluated with. Stores before v6 keyed by the tensors alone; their rows are
  never matched again (see schema.py).
- ``evaluations``: (model fingerprint, task digest, settings hash) -> every
  metric the task reported (``{"acc_norm,none": [value, stderr], ...}``; a
  run reads the one it reports, so changing ``benchmark.metrics`` needs no
  re-evaluation and a stored number is never read under another metric's
  name), n, the path of logged samples if any, and each item's outcome in
  every metric that is a mean over items (v7; for paired comparisons). The settings are
  everything besides model and task data that can change a score (limit,
  few-shot, precision, batch size, device, lm-eval version); a change to any
  key field is a miss. lm-eval's own request cache is not involved.
- ``merges``: ``merge_key`` (ordered input fingerprints, method config, seed)
  -> the merged model's fingerprint, so a merge whose output was already
  evaluated need not be redone.
- ``claims``: which process is evaluating a model right now, so parallel
  sweep jobs that share a constituent evaluate it once (``claim_or_scores``).
  The claimant renews its claims (``renewed``) from a background thread every
  ``claim_timeout_s / 4``; a claim of another host not renewed for
  ``claim_timeout_s`` is taken over (its machine died or lost the network), a
  claim of this host as soon as its process is gone.

Faults: opening checks that the database is a store and can be written (once
per process and location; an SQLite file also passes ``PRAGMA quick_check``);
a database error later (a damaged page, a full disk, a file made read-only, a
lost server) becomes a one-line ``UserError`` naming the store's field, raised
after the transaction rolled back, so the store is never left half-written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from mergeval.core import proc
from mergeval.core.errors import UserError
from mergeval.core.paths import cache_root
from mergeval.eval.settings import PerTask
from mergeval.results.backends import is_server_url, open_backend, sqlalchemy_url, sqlite_path
from mergeval.results.backends.schema import (  # noqa: F401 (tests)
    _CURRENT,
    _EVALUATIONS,
    _NEW_IN_V2,
    _RUNS_V2,
    DEFAULT_METRIC,
    SCHEMA_VERSION,
    _canonical,
    _dump,
    create,
    migrate,
    stale_rows,
)

CLAIM_TIMEOUT_S = 300.0  # default store.claim_timeout_s: another host's claim not renewed this long is dead
STATUSES = ("running", "finished", "failed", "interrupted")
_JSON_COLUMNS = ("config", "versions", "git", "timings", "aggregates", "models", "scores")


class StoreError(RuntimeError):
    """A write the store's state forbids: starting a run id twice, finishing a run that is not running."""


def settings_hash(settings: Mapping) -> str:
    """sha256 of the settings as canonical JSON (sorted keys), first 16 hex digits."""
    return hashlib.sha256(_canonical(settings).encode()).hexdigest()[:16]


def merge_key(
    input_fingerprints: Sequence[str], method_config, seed: int | None, options: Mapping | None = None
) -> str:
    """Identity of a merge: sha256 of canonical JSON {inputs, method, seed, options}, first 32 hex digits.

    The inputs stay in the order given (base first, then the experts in modelset
    order): per-expert weights and slerp's target depend on it. The method
    config includes its name; the seed is always part of the key, even for
    deterministic methods (a needless miss is cheap, a wrong hit is not);
    ``options`` holds run settings outside the method that change the output
    (e.g. vocab_policy). A method whose implementation version is above 1 adds
    it (``MergeMethod.version``, raised when its output for the same inputs
    changes), so a merge stored by an earlier implementation is never reused;
    version-1 methods keep the keys they always had.
    """
    method = _as_mapping(method_config)
    payload = {"inputs": list(input_fingerprints), "method": method, "seed": seed, "options": dict(options or {})}
    version = method_version(method.get("name"))
    if version > 1:
        payload["implementation"] = version
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()[:32]


def method_version(name: str | None) -> int:
    """The implementation version of the merge method ``name`` (1 for a name the registry does not know)."""
    from mergeval.methods import METHODS

    method = METHODS.get(name) if name else None
    return method.version if method is not None else 1


def _as_mapping(config) -> dict:
    """A method config as a plain dict: its typed dataclass (as the app holds it) or a mapping."""
    return (
        dataclasses.asdict(config)
        if dataclasses.is_dataclass(config) and not isinstance(config, type)
        else dict(config)
    )


ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "torch_dtype",
)


def architecture_of(hf_config: Mapping) -> dict:
    """The fields of a Hugging Face config.json that describe the architecture (those present)."""
    return {k: hf_config[k] for k in ARCHITECTURE_KEYS if k in hf_config}


class Store:
    """The results store at ``location`` (created, or migrated to the current schema, on open): an SQLite
    file's path, or a ``postgresql://`` URL. ``field`` is the config field errors name (``store.path``,
    ``store.url``, ``--store``); ``claim_timeout_s`` how long another host's claim lives without renewal.

    Every method opens its own short-lived connection, so a Store may be shared
    across threads and survives ``fork``; each write is one transaction.
    """

    def __init__(self, location: Path | str, *, field: str | None = None, claim_timeout_s: float = CLAIM_TIMEOUT_S):
        self._db = open_backend(location, field or ("store.url" if is_server_url(location) else "store.path"))
        self.field = self._db.field
        self.path: Path | None = getattr(self._db, "path", None)  # the SQLite file; None for a server
        self.location: str = self._db.location  # what messages name (a server's password masked)
        self.claim_timeout_s = float(claim_timeout_s)
        self._heartbeat: _Heartbeat | None = None
        self._ensure_schema()
        if self._db.identity() not in _CHECKED:  # once per process: SQLite's quick_check reads every page
            self._db.check_health()
            _CHECKED.add(self._db.identity())
        self.reap_dead_runs()

    def sqlalchemy_url(self) -> str:
        """This store's database as an SQLAlchemy URL (Optuna's study storage shares it)."""
        return sqlalchemy_url(self.path if self.path is not None else self._db.url)

    # connections and transactions

    @contextmanager
    def _write(self) -> Iterator:
        """One write transaction, no other writer in between (SQLite: BEGIN IMMEDIATE; PostgreSQL: the
        store's advisory lock)."""
        with self._db.write() as db:
            yield db

    @contextmanager
    def _read(self) -> Iterator:
        with self._db.read() as db:
            yield db

    def _ensure_schema(self) -> None:
        with self._read() as db:
            if self._version(db) == SCHEMA_VERSION:
                return
        with self._write() as db:  # re-read under the lock: another process may have just migrated
            version = self._version(db)
            if version == 0:
                create(db, self._db.ddl)
            elif version > SCHEMA_VERSION:
                raise UserError(
                    self.field,
                    f"{self.location} has schema v{version}, newer than this mergeval (v{SCHEMA_VERSION})",
                    f"upgrade mergeval or use another {self.field}",
                )
            elif version < SCHEMA_VERSION:
                migrate(db, version)
                stale = stale_rows(db) if version < 6 else (0, 0)  # rows keyed by weights alone (before v6)
                if any(stale):  # said once: the migration happens once per store
                    print(
                        f"mergeval: the results store {self.location} was keyed by model weights alone; its "
                        f"{stale[0]} stored evaluations and {stale[1]} merges stay for the record but are not "
                        "reused (a model's config and tokenizer now count too): models are evaluated once more",
                        flush=True,
                    )

    def _version(self, db) -> int:
        if not self._db.table_exists(db, "meta"):
            return 0
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0]) if row else 0

    def schema_version(self) -> int:
        with self._read() as db:
            return self._version(db)

    # evaluations

    # ``settings`` of the evaluation methods: one Mapping for every task, or a PerTask (each task's own part of
    # the run's settings, read under the run's too: eval/settings.py)

    def get_scores(
        self,
        fingerprint: str,
        digests: Mapping[str, str],
        settings: Mapping | PerTask,
        metrics: Mapping[str, str] | None = None,
    ) -> dict[str, dict] | None:
        """{task: {metric, value, stderr, n}} if every task is stored for this model and settings, else None.
        ``metrics`` (task -> ``"metric,filter"``) picks what each task reports; default ``acc,none``."""
        got = self.stored_scores(fingerprint, digests, settings, metrics)
        return got if set(got) == set(digests) else None

    def stored_scores(
        self,
        fingerprint: str,
        digests: Mapping[str, str],
        settings: Mapping | PerTask,
        metrics: Mapping[str, str] | None = None,
    ) -> dict[str, dict]:
        """{task: {metric, value, stderr, n}} of the tasks of ``digests`` stored for this model (any subset)."""
        with self._read() as db:
            return _stored(db, fingerprint, digests, settings, metrics, self._report)

    def claim_or_scores(
        self,
        fingerprint: str,
        digests: Mapping[str, str],
        settings: Mapping | PerTask,
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 2.0,
        metrics: Mapping[str, str] | None = None,
    ) -> dict[str, dict]:
        """{task: scores} of the tasks already stored for this model and settings; when that is not every
        task of ``digests``, this process has claimed the evaluation of the missing ones.

        A task is evaluated once per model, task digest and settings, whatever other tasks a run has.
        Parallel sweep workers share constituents: the first to ask claims the missing tasks; the others
        wait (``on_wait`` is called once) until their scores arrive, then reuse them. The claim ends with
        ``put_scores`` of those tasks or ``release_claims``; while it lasts, a background thread renews it
        (``_Heartbeat``). A claim whose process is gone (same host, pid not running) or that another host
        stopped renewing ``claim_timeout_s`` ago (by the database's clock) is taken over.
        """
        key = settings_hash(_run(settings))  # claims are per run settings: two runs that share a task's key
        # but not the run's may both evaluate it, which costs time, never a wrong row
        waited = False
        while True:
            with self._write() as db:
                got = _stored(db, fingerprint, digests, settings, metrics, self._report)
                missing = {task: digest for task, digest in digests.items() if task not in got}
                if not missing:
                    return got
                tasks = _tasks_key(missing)
                holder = db.execute(
                    "SELECT host, pid, since, renewed FROM claims WHERE model_fingerprint=? AND "
                    "settings_hash=? AND tasks_key=?",
                    (fingerprint, key, tasks),
                ).fetchone()
                now = self._db.now(db)
                if holder is None or not _claim_alive(*holder, now=now, timeout_s=self.claim_timeout_s):
                    db.execute(
                        "INSERT INTO claims (model_fingerprint, settings_hash, tasks_key, host, pid, since, "
                        "renewed) VALUES (?,?,?,?,?,?,?) ON CONFLICT (model_fingerprint, settings_hash, "
                        "tasks_key) DO UPDATE SET host=excluded.host, pid=excluded.pid, "
                        "since=excluded.since, renewed=excluded.renewed",
                        (fingerprint, key, tasks, socket.gethostname(), os.getpid(), now, now),
                    )
                    claimed = True
                else:
                    claimed = False
            if claimed:  # after the commit, so the heartbeat's first renewal sees the claim
                self._keep_claims_alive()
                return got
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            time.sleep(poll_s)

    def _keep_claims_alive(self) -> None:
        """Start this process's heartbeat unless it runs (one per Store and process; a forked child starts its
        own)."""
        with _HEARTBEAT_LOCK:
            beat = self._heartbeat
            if beat is None or beat.pid != os.getpid() or not beat.is_alive():
                self._heartbeat = _Heartbeat(self)
                self._heartbeat.start()

    def renew_claims(self) -> int:
        """Mark every claim of this process renewed now (the heartbeat's beat); returns how many it holds."""
        with self._write() as db:
            return db.execute(
                "UPDATE claims SET renewed=? WHERE host=? AND pid=?",
                (self._db.now(db), socket.gethostname(), os.getpid()),
            ).rowcount

    def release_claims(self) -> None:
        """Drop every evaluation claim of this process (its run failed before scoring)."""
        with self._write() as db:
            db.execute("DELETE FROM claims WHERE host=? AND pid=?", (socket.gethostname(), os.getpid()))

    def samples_paths(
        self, fingerprint: str, digests: Mapping[str, str], settings: Mapping | PerTask
    ) -> dict[str, str | None]:
        """task -> the file its per-item samples were written to (None: stored without samples). Tasks
        evaluated in different runs have different files."""
        with self._read() as db:
            rows = _rows(db, "samples_path", fingerprint, digests, settings)
        return {task: found[0][1][0] for task, found in rows.items()}

    def all_metrics(self, fingerprint: str, digests: Mapping[str, str], settings: Mapping | PerTask) -> dict[str, dict]:
        """task -> every metric stored for it (``{"acc,none": [value, stderr], ...}``), for the tasks stored."""
        with self._read() as db:
            rows = _rows(db, "metrics", fingerprint, digests, settings)
        out = {}
        for task, found in rows.items():
            try:
                out[task] = _json("metrics", found[0][1][0])
            except Damaged as err:
                self._report(f"the evaluation of {task} by model {fingerprint[:12]}", err)
        return out

    def put_scores(
        self,
        fingerprint: str,
        digests: Mapping[str, str],
        settings: Mapping | PerTask,
        scores: Mapping[str, Mapping],
        samples_path: str | None = None,
    ) -> None:
        """Store one model's scores on several tasks: all tasks or none (one transaction); a re-evaluation replaces.
        Each score is ``{metric, value, stderr, n}``, with ``metrics`` (every key -> [value, stderr]) when the
        task reported more than the one shown, and ``items_by_metric`` (key -> {"ids", "values"}: each item's
        outcome; ``TaskScore.stored``) or ``items`` (the shown metric's) where it has them."""
        key, now = settings_hash(_run(settings)), time.time()
        own = {task: _of(settings, task) for task in scores}  # each task under its own key (eval/settings.py)
        with self._write() as db:
            db.executemany(
                "INSERT INTO evaluations (model_fingerprint, task_digest, settings_hash, task, settings, metrics, n, "
                "created, samples_path, items) VALUES (?,?,?,?,?,?,?,?,?,?) ON CONFLICT (model_fingerprint, "
                "task_digest, settings_hash) DO UPDATE SET task=excluded.task, settings=excluded.settings, "
                "metrics=excluded.metrics, n=excluded.n, created=excluded.created, "
                "samples_path=excluded.samples_path, items=excluded.items",
                [
                    (
                        fingerprint,
                        digests[task],
                        settings_hash(own[task]),
                        task,
                        _canonical(own[task]),
                        _canonical(_all_metrics(s)),
                        s["n"],
                        now,
                        samples_path,
                        _all_items(s),
                    )
                    for task, s in scores.items()
                ],
            )
            # this process's claims on the model end here (it may have evaluated more tasks than it claimed: a
            # group is evaluated whole when one of its members is missing)
            db.execute(
                "DELETE FROM claims WHERE model_fingerprint=? AND settings_hash=? AND (tasks_key=? OR "
                "(host=? AND pid=?))",
                (fingerprint, key, _tasks_key(digests), socket.gethostname(), os.getpid()),
            )

    # models and merges

    def put_model(
        self,
        fingerprint: str,
        source: str,
        architecture: Mapping | None = None,
        path: str | None = None,
        weights: str | None = None,
    ) -> None:
        """Record a model the first time its identity is seen (a copy elsewhere keeps the first row)."""
        with self._write() as db:
            db.execute(
                "INSERT INTO models (fingerprint, source, architecture, path, created, weights) "
                "VALUES (?,?,?,?,?,?) ON CONFLICT (fingerprint) DO NOTHING",
                (
                    fingerprint,
                    source,
                    None if architecture is None else _canonical(architecture),
                    path,
                    time.time(),
                    weights,
                ),
            )

    def model(self, fingerprint: str) -> dict | None:
        with self._read() as db:
            row = db.execute(
                "SELECT source, architecture, path, weights FROM models WHERE fingerprint=?", (fingerprint,)
            ).fetchone()
        if row is None:
            return None
        return {
            "fingerprint": fingerprint,
            "source": row[0],
            "architecture": row[1] and json.loads(row[1]),
            "path": row[2],
            "weights": row[3],
        }

    def get_merge(self, key: str) -> str | None:
        """The output fingerprint of the merge with this ``merge_key``, if it was ever done."""
        with self._read() as db:
            row = db.execute("SELECT output_fingerprint FROM merges WHERE merge_key=?", (key,)).fetchone()
        return row[0] if row else None

    def evaluated_merge(
        self, key: str, digests: Mapping[str, str], settings: Mapping, metrics: Mapping[str, str] | None = None
    ) -> str | None:
        """The output fingerprint of merge ``key`` if it was done and its output scored on all these tasks and
        settings (then neither the merge nor its evaluation needs redoing), else None."""
        output = self.get_merge(key)
        done = output is not None and self.get_scores(output, digests, settings, metrics) is not None
        return output if done else None

    def put_merge(
        self,
        key: str,
        inputs: Sequence[str],
        method_config,
        seed: int | None,
        output_fingerprint: str,
        options: Mapping | None = None,
    ) -> None:
        """Record a merge's output; the first record of a key is kept (merges are deterministic)."""
        with self._write() as db:
            db.execute(
                "INSERT INTO merges VALUES (?,?,?,?,?,?,?) ON CONFLICT (merge_key) DO NOTHING",
                (
                    key,
                    _canonical(list(inputs)),
                    _canonical(_as_mapping(method_config)),
                    seed,
                    _canonical(dict(options or {})),
                    output_fingerprint,
                    time.time(),
                ),
            )

    # runs

    def start_run(
        self,
        run_id: str,
        *,
        experiment: str,
        method: str,
        config: Mapping,
        versions: Mapping,
        git: Mapping,
        job_dir: str | None = None,
        config_hash: str | None = None,
    ) -> None:
        """Insert the run as ``running``. Raises StoreError if the run id is already in the store.
        ``config_hash`` identifies the configuration for ``finished_run`` (resumable sweeps)."""
        try:
            with self._write() as db:
                db.execute(
                    "INSERT INTO runs (run_id, created, status, experiment, method, config, versions, git, "
                    "job_dir, host, pid, pid_start, config_hash) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        run_id,
                        time.time(),
                        "running",
                        experiment,
                        method,
                        _dump(config),
                        _dump(versions),
                        _dump(git),
                        job_dir,
                        *proc.me(),
                        config_hash,
                    ),
                )
        except self._db.IntegrityError as err:
            raise StoreError(f"run {run_id} is already in the store") from err

    def finish_run(
        self,
        run_id: str,
        *,
        result_path: str,
        aggregates: Mapping,
        timings: Mapping,
        models: Sequence[Mapping],
        scores: Mapping,
    ) -> None:
        """Mark a running run finished with its results, exactly once.

        Raises StoreError (and changes nothing) if the run is unknown or not
        ``running``: finishing twice, or finishing a failed run, is a bug.
        """
        with self._write() as db:
            changed = db.execute(
                "UPDATE runs SET status='finished', finished=?, result_path=?, aggregates=?, timings=?, models=?, "
                "scores=? WHERE run_id=? AND status='running'",
                (
                    time.time(),
                    str(result_path),
                    _dump(aggregates),
                    _dump(timings),
                    _dump(list(models)),
                    _dump(scores),
                    run_id,
                ),
            ).rowcount
        if changed != 1:
            state = self._status(run_id)
            raise StoreError(f"run {run_id} cannot be finished: it is {state or 'not in the store'}")

    def fail_run(self, run_id: str, error: str, timings: Mapping | None = None) -> bool:
        """Mark a running run failed; False (and no change) if it is not running. Never raises on state,
        so it is safe in an error handler."""
        with self._write() as db:
            return (
                db.execute(
                    "UPDATE runs SET status='failed', finished=?, error=?, timings=? "
                    "WHERE run_id=? AND status='running'",
                    (time.time(), error, None if timings is None else _dump(timings), run_id),
                ).rowcount
                == 1
            )

    def interrupt_run(self, run_id: str, note: str, timings: Mapping | None = None) -> bool:
        """Mark a running run interrupted (SIGTERM, Ctrl-C); like ``fail_run``, never raises on state."""
        with self._write() as db:
            return (
                db.execute(
                    "UPDATE runs SET status='interrupted', finished=?, error=?, timings=? "
                    "WHERE run_id=? AND status='running'",
                    (time.time(), note, None if timings is None else _dump(timings), run_id),
                ).rowcount
                == 1
            )

    def reap_dead_runs(self, found_by: str = "a later run") -> list[str]:
        """Runs left ``running`` by a process of this host that is provably gone (killed) become ``interrupted``
        with a note (naming ``found_by``), and that process's evaluation claims are dropped; returns their run
        ids. Runs of other hosts, and runs from before schema v4 (no process recorded), are left as they are."""
        with self._read() as db:
            rows = db.execute(
                "SELECT run_id, host, pid, pid_start FROM runs WHERE status='running' AND host=?",
                (socket.gethostname(),),
            ).fetchall()
            claims = db.execute("SELECT DISTINCT pid FROM claims WHERE host=?", (socket.gethostname(),)).fetchall()
        dead = [r for r in rows if proc.gone(r[1], r[2], r[3])]
        dead_claims = [pid for (pid,) in claims if pid != os.getpid() and proc.gone(socket.gethostname(), pid)]
        if not dead and not dead_claims:
            return []
        with self._write() as db:
            for run_id, host, pid, _ in dead:
                db.execute(
                    "UPDATE runs SET status='interrupted', finished=?, error=? WHERE run_id=? AND status='running'",
                    (
                        time.time(),
                        f"process {pid} on {host} ended without finishing (killed?); found by {found_by}",
                        run_id,
                    ),
                )
            for pid in dead_claims:
                db.execute("DELETE FROM claims WHERE host=? AND pid=?", (socket.gethostname(), pid))
        return [r[0] for r in dead]

    def _status(self, run_id: str) -> str | None:
        with self._read() as db:
            row = db.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return row[0] if row else None

    def runs(
        self,
        experiment: str | None = None,
        method: str | None = None,
        status: str | None = None,
        since: float | None = None,
    ) -> list[dict]:
        """Runs, oldest first, filtered by modelset (experiment), method, status and start time (epoch s)."""
        filters: list[tuple[str, object]] = [
            (f"{col}=?", val)
            for col, val in (("experiment", experiment), ("method", method), ("status", status))
            if val is not None
        ]
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
        out = []
        for row in rows:
            try:
                out.append(
                    {
                        k: (_json(k, v) if k in _JSON_COLUMNS and v is not None else _text(k, v))
                        for k, v in zip(names, row)
                    }
                )
            except Damaged as err:  # one damaged run never hides the others
                self._report(f"run {_shown(row[names.index('run_id')])}", err)
        return out

    def _report(self, what: str, err: Damaged) -> None:
        """One line on stderr for a damaged row (once per row and process); the caller goes on without it."""
        line = f"mergeval: results store {self.location}: {what} is damaged ({err}); {err.then or 'left out'}"
        if line not in _REPORTED:
            _REPORTED.add(line)
            print(line, file=sys.stderr, flush=True)


_CHECKED: set[str] = set()  # stores this process has health-checked
_REPORTED: set[str] = set()  # damaged rows this process has reported


class Damaged(ValueError):
    """A row whose text is not UTF-8 or whose JSON does not parse: PRAGMA integrity_check cannot see either.
    ``then`` says what happens instead (e.g. the evaluation is run again)."""

    def __init__(self, problem: str, then: str = ""):
        super().__init__(problem)
        self.then = then


def _text(column: str, value):
    """A text column as read; lone surrogates (bytes that were not UTF-8, results/backends/sqlite.py) are damage."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise Damaged(f"{column}: not UTF-8 text") from None
    return value


def _json(column: str, value):
    try:
        return json.loads(_text(column, value))
    except ValueError as err:
        if isinstance(err, Damaged):
            raise
        raise Damaged(f"{column}: not valid JSON") from None


def _shown(value) -> str:
    return value.encode("utf-8", "backslashreplace").decode() if isinstance(value, str) else str(value)


_HEARTBEAT_LOCK = threading.Lock()  # a heartbeat's stop decision and a new claim's start never interleave


class _Heartbeat(threading.Thread):
    """Renews its process's claims every ``claim_timeout_s / 4`` while the process holds any, then ends (a
    daemon thread: it dies with the process, and so do the renewals). A failed renewal (the server briefly
    unreachable) is retried at the next beat; should they fail for ``claim_timeout_s``, another host may take
    the claim and evaluate the model too: time lost, never a wrong row (scores of one model, task and
    settings are the same whoever computes them). The heartbeat then ends: the lease is lost either way, and
    a store that is gone for good (its file removed) is not knocked at forever."""

    def __init__(self, store: Store):
        super().__init__(daemon=True, name="mergeval-claims-heartbeat")
        self.store, self.pid = store, os.getpid()

    def run(self) -> None:
        renewed = time.monotonic()
        while True:
            time.sleep(self.store.claim_timeout_s / 4)
            with _HEARTBEAT_LOCK:  # the decision to end and a new claim's check for a heartbeat never interleave
                try:
                    held = self.store.renew_claims()
                    renewed = time.monotonic()
                except Exception:  # noqa: BLE001 - any failure: try again at the next beat (docstring)
                    held = None
                if held == 0 or time.monotonic() - renewed >= self.store.claim_timeout_s:
                    if self.store._heartbeat is self:
                        self.store._heartbeat = None
                    return


def _all_metrics(score: Mapping) -> dict:
    return dict(score.get("metrics") or {score["metric"]: [score["value"], score["stderr"]]})


def _all_items(score: Mapping) -> str | None:
    """The ``items`` column of a score: every metric's per-item outcomes, or the shown metric's; None: none."""
    items = score.get("items_by_metric")
    if items is None and score.get("items") is not None:
        items = {score["metric"]: score["items"]}
    return _canonical(items) if items else None


def _of(settings: Mapping | PerTask, task: str) -> Mapping:
    return settings.of(task) if isinstance(settings, PerTask) else settings


def _run(settings: Mapping | PerTask) -> Mapping:
    return settings.run if isinstance(settings, PerTask) else settings


def _rows(
    db, columns: str, fingerprint: str, digests: Mapping[str, str], settings: Mapping | PerTask
) -> dict[str, list[tuple[str, tuple]]]:
    """task -> [(settings hash, the row's ``columns``)] of this model's evaluations of the tasks of ``digests``:
    the row under the task's own settings first, then the one under the run's settings (how it was keyed
    before per-task keys). Tasks with neither are left out."""
    if not digests:
        return {}
    keys = {task: [settings_hash(_of(settings, task))] for task in digests}
    legacy = settings_hash(_run(settings))
    for ordered in keys.values():
        if legacy not in ordered:
            ordered.append(legacy)
    hashes = sorted({k for ordered in keys.values() for k in ordered})
    found = {}
    for task, digest, key, *values in db.execute(
        f"SELECT task, task_digest, settings_hash, {columns} FROM evaluations WHERE model_fingerprint=? "
        f"AND task_digest IN ({','.join('?' * len(digests))}) AND settings_hash IN ({','.join('?' * len(hashes))})",
        (fingerprint, *digests.values(), *hashes),
    ):
        if digests.get(task) == digest:
            found[task, key] = tuple(values)
    out = {task: [(k, found[task, k]) for k in ordered if (task, k) in found] for task, ordered in keys.items()}
    return {task: rows for task, rows in out.items() if rows}


def _stored(
    db,
    fingerprint: str,
    digests: Mapping[str, str],
    settings: Mapping | PerTask,
    metrics: Mapping[str, str] | None = None,
    report=None,
) -> dict[str, dict]:
    """{task: {metric, value, stderr, n}} (+ ``items``: the metric's per-item outcomes, where kept) of the tasks of
    ``digests`` stored for this model and settings (any subset); a task stored without the metric asked for counts as not stored, and so does a damaged row
    (``report``-ed; the evaluation that follows replaces it)."""
    out = {}
    for task, rows in _rows(db, "metrics, n, items", fingerprint, digests, settings).items():
        metric = (metrics or {}).get(task, DEFAULT_METRIC)
        for _, (stored, n, items) in rows:
            try:
                values = _json("metrics", stored)
                items = {} if items is None else _json("items", items)
            except Damaged as err:
                err.then = "it is evaluated again and the row replaced"
                if report is not None:
                    report(f"the evaluation of {task} by model {fingerprint[:12]}", err)
                continue
            if metric in values:
                out[task] = {"metric": metric, "value": values[metric][0], "stderr": values[metric][1], "n": n}
                if isinstance(items, dict) and items.get(metric) is not None:
                    out[task]["items"] = items[metric]
                break
    return out


def _tasks_key(digests: Mapping[str, str]) -> str:
    return hashlib.sha256(_canonical(sorted(digests.values())).encode()).hexdigest()[:16]


def _claim_alive(host: str, pid: int, since: float, renewed: float | None, *, now: float, timeout_s: float) -> bool:
    """Whether a claim's process may still be evaluating: on this host, unless its process is gone (this very
    process's stale claims never block it); elsewhere, whether it was renewed (or made, before any renewal)
    less than ``timeout_s`` before ``now``."""
    if host != socket.gethostname():
        return now - (since if renewed is None else renewed) < timeout_s
    return pid != os.getpid() and not proc.gone(host, pid)


# "postgres//host/db", "postgresql:/host/db", "sqlite:/x": a scheme or "//" in what would be taken for a file path
_MISSPELT_URL = re.compile(r"^(postgres(ql)?|sqlite)[:/]|^[a-z][a-z0-9+.-]*:/|//", re.IGNORECASE)


def open_store(cfg, cache: Path) -> Store:
    """The results store of a run config: ``store.url`` (a PostgreSQL URL, an ``sqlite:///`` URL or a file
    path) or ``store.path`` (a file), default ``<cache>/results.sqlite``; ``store.claim_timeout_s``."""
    url, path = getattr(cfg.store, "url", None), cfg.store.path
    timeout = float(getattr(cfg.store, "claim_timeout_s", CLAIM_TIMEOUT_S))
    if not timeout > 0:
        raise UserError("store.claim_timeout_s", f"must be positive, got {timeout}", "give seconds, e.g. 300")
    if url and path:
        raise UserError(
            "store.url", "store.url and store.path are both set", "keep one of them (store.url also takes a file path)"
        )
    if url:
        url = str(url)
        if "://" in url and not is_server_url(url) and not url.startswith("sqlite:///"):
            raise UserError(
                "store.url",
                f"'{url.split('://')[0]}://' is not a store this mergeval can use",
                "give postgresql://USER@HOST:PORT/DB, sqlite:///FILE or a file path",
            )
        if "://" not in url and _MISSPELT_URL.search(url):  # a file path by the rules, a URL by intent
            raise UserError(
                "store.url",
                f"'{url}' reads as a URL without its '://', which would make a new SQLite file at that relative path",
                "write postgresql://USER@HOST:PORT/DB or sqlite:///FILE, or give the file with store.path=FILE",
            )
        return Store(url if is_server_url(url) else sqlite_path(url), field="store.url", claim_timeout_s=timeout)
    return Store(
        Path(path).expanduser() if path else cache / "results.sqlite", field="store.path", claim_timeout_s=timeout
    )


def record_models(store: Store, models) -> None:
    """Each constituent's fingerprint, source and architecture (from its config.json) in the models table;
    ``models`` are ModelInfo rows, the first one the base."""
    for info in models:
        try:  # the in-memory merge has the base's architecture
            source_dir = Path(info.path or models[0].path)
            arch = architecture_of(json.loads((source_dir / "config.json").read_text()))
        except (OSError, TypeError, ValueError):  # no path or no readable config.json: the row keeps no architecture
            arch = None
        store.put_model(info.fingerprint, info.source, arch, info.path, getattr(info, "weights", None))


def default_store_path() -> Path:
    return cache_root(None) / "results.sqlite"


def open_existing(path: str | None) -> Store:
    """The store at ``path`` (default: the cache's), which must exist: listing never creates one. A
    ``postgresql://`` URL opens the server's store (mergeval/results/backends)."""
    if path is not None and is_server_url(path):
        return Store(path, field="--store")
    where = sqlite_path(path) if path else default_store_path()
    if not where.exists():
        raise UserError("--store", f"no results store at {where}", "run python -m mergeval first or pass --store PATH")
    return Store(where, field="--store")
