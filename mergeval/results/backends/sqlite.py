"""The SQLite backend: one database file in WAL mode, one writer at a time (``BEGIN IMMEDIATE``).

Several processes of one machine (the joblib launcher's workers, Slurm jobs on
one node) read and write at once; concurrent writers wait for each other (busy
timeout) instead of failing. The file must sit on a local file system: SQLite's
locks are not reliable over NFS and similar network file systems, so machines
that share a store use a PostgreSQL server instead (``postgres.py``).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import make_dirs

BUSY_TIMEOUT_S = 120  # a writer waits this long for another process's transaction before giving up
DAMAGED_FIX = (
    "move the file aside and rerun (evaluations are then recomputed), or recover what it holds "
    "with `sqlite3 FILE .recover | sqlite3 NEW`"
)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


class SqliteBackend:
    name = "sqlite"
    IntegrityError = sqlite3.IntegrityError

    def __init__(self, path: Path, field: str):
        self.path, self.field = Path(path), field
        self.location = str(self.path)
        try:
            make_dirs(self.path.parent)
        except OSError as err:
            raise UserError(
                field,
                f"cannot create {self.path} ({err.strerror}: {err.filename})",
                f"point {field} at a writable location",
            ) from err

    def identity(self) -> str:
        """What names this database within one process (health is checked once per identity)."""
        return str(self.path.resolve())

    def connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)  # we issue BEGIN ourselves
        # text that is not UTF-8 (a damaged row PRAGMA integrity_check does not see) reads as lone surrogates
        # instead of failing the whole query: the store reports that row and goes on (store.py, damaged)
        db.text_factory = _text
        try:
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
            to_wal(db)
        except BaseException:
            db.close()
            raise
        return db

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; IMMEDIATE takes the write lock up front, so two writers never deadlock."""
        with self.faults(), closing(self.connect()) as db:
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
    def read(self) -> Iterator[sqlite3.Connection]:
        with self.faults(), closing(self.connect()) as db:
            yield db

    @contextmanager
    def faults(self) -> Iterator[None]:
        """An SQLite error the environment caused becomes one line naming the store; IntegrityError (a write
        the schema forbids) and anything else stay as they are."""
        try:
            yield
        except sqlite3.IntegrityError:
            raise
        except sqlite3.DatabaseError as err:
            line = store_fault(self.path, err, self.field)
            if line is None:
                raise
            raise line from err

    def check_health(self) -> None:
        """The file passes ``PRAGMA quick_check`` and accepts a write (a rolled-back one)."""
        with self.read() as db:
            found = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
        if found != ["ok"]:
            raise UserError(self.field, f"{self.path} is damaged ({'; '.join(found[:2])})", DAMAGED_FIX)
        with self.faults(), closing(self.connect()) as db:  # a read-only file fails here, not mid-run
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("UPDATE meta SET value=value WHERE key='schema_version'")
            finally:
                db.execute("ROLLBACK")

    @staticmethod
    def table_exists(db: sqlite3.Connection, name: str) -> bool:
        return db.execute("SELECT 1 FROM sqlite_master WHERE name=?", (name,)).fetchone() is not None

    @staticmethod
    def ddl(statement: str) -> str:
        return statement

    @staticmethod
    def now(db: sqlite3.Connection) -> float:
        """The clock claims are timed by: this machine's (an SQLite store is shared by one machine only)."""
        return time.time()


def to_wal(db: sqlite3.Connection, wait_s: float = BUSY_TIMEOUT_S) -> None:
    """Put the database in WAL mode (it stays so: the mode is kept in the file).

    Why the loop: switching a new file to WAL takes an exclusive lock, and when two processes open a fresh
    store at the same moment (a sweep's workers), each can hold the shared lock the other needs to give up.
    SQLite then answers SQLITE_BUSY at once, without waiting the busy timeout (waiting could deadlock). One of
    them succeeds; the other finds the file in WAL mode on its next try.
    """
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
                return
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if not is_busy(err) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def is_busy(err: sqlite3.DatabaseError) -> bool:
    code = getattr(err, "sqlite_errorname", "") or ""
    return code.startswith("SQLITE_BUSY") or "database is locked" in str(err)


def store_fault(path: Path, err: sqlite3.DatabaseError, field: str = "store.path") -> UserError | None:
    """The one-line error for an SQLite failure the environment caused, or None for any other."""
    code = getattr(err, "sqlite_errorname", "") or ""
    if code.startswith("SQLITE_READONLY") or "readonly database" in str(err):
        return UserError(
            field,
            f"{path} is read-only ({err})",
            f"make the file and its directory writable, or point {field} elsewhere",
        )
    if code in ("SQLITE_FULL",) or "disk is full" in str(err):
        return UserError(
            field,
            f"no space left for {path} ({err})",
            f"free some space there, or point {field} at another file system",
        )
    if (
        code in ("SQLITE_CORRUPT", "SQLITE_NOTADB")
        or code.startswith("SQLITE_CORRUPT")
        or "malformed" in str(err)
        or "not a database" in str(err)
    ):
        return UserError(field, f"{path} is damaged or not a results store ({err})", DAMAGED_FIX)
    if code.startswith("SQLITE_CANTOPEN") or code.startswith("SQLITE_IOERR") or code.startswith("SQLITE_PERM"):
        return UserError(
            field,
            f"cannot read or write {path} ({err})",
            f"check the file's permissions and the device, or point {field} elsewhere",
        )
    if is_busy(err):
        return UserError(
            field,
            f"{path} stayed locked by another process for over {BUSY_TIMEOUT_S} s",
            f"wait for that process, or use another {field} (a network file system cannot "
            "hold an SQLite store safely: use a PostgreSQL store.url)",
        )
    return None
