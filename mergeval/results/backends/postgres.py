"""The PostgreSQL backend: a store shared by many machines through one server (``store.url=postgresql://...``).

Connections come from psycopg 3 (the ``cluster`` extra), one per store call as
on SQLite, so a ``Store`` survives ``fork`` and is safe across threads. Writes
are serialised as SQLite serialises them: each write transaction first takes a
transaction-level advisory lock, so the claim protocol's read-then-write runs
with no other writer in between, on any isolation level, and the lock ends
with the transaction (a writer that dies mid-transaction releases it with its
connection). Reads take no lock. Claims are timed by the server's clock, so the
claimants' clocks need not agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from mergeval.core.errors import UserError

CONNECT_TIMEOUT_S = 10  # an unreachable server fails after this long, not after the OS's TCP timeout
LOCK_TIMEOUT_S = 120  # as SQLite's busy timeout: a writer waits this long for another's transaction
WRITE_LOCK = 0x6D657267  # the advisory lock key all mergeval writers of one database share ("merg")
INSTALL_FIX = "pip install 'mergeval[cluster]' (psycopg), or use an SQLite file for store.url"


def masked(url: str) -> str:
    """A server URL as it may be printed: the password, if any, replaced by ``***``."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def _psycopg():
    try:
        import psycopg
    except ImportError as err:
        raise UserError("store.url", "a PostgreSQL store needs the psycopg package", INSTALL_FIX) from err
    return psycopg


class _Connection:
    """A psycopg connection that takes the store's SQL as written for SQLite (``?`` placeholders)."""

    def __init__(self, conn):
        self._conn = conn

    def execute(self, sql: str, params: Sequence = ()):
        return self._conn.execute(*_query(sql, params))

    def executemany(self, sql: str, rows: Sequence[Sequence]):
        cursor = self._conn.cursor()
        cursor.executemany(_query(sql, rows[0] if rows else ())[0], rows)
        return cursor


def _query(sql: str, params: Sequence) -> tuple[str, Sequence | None]:
    """``?`` -> ``%s`` (psycopg's placeholder; a literal ``%`` is doubled); no parameters: the SQL as it is."""
    if not params:
        return sql, None
    return sql.replace("%", "%%").replace("?", "%s"), params


class PostgresBackend:
    name = "postgresql"

    def __init__(self, url: str, field: str):
        self.psycopg = _psycopg()
        self.IntegrityError = self.psycopg.IntegrityError
        self.url, self.field = url, field
        self.location = masked(url)

    def identity(self) -> str:
        return self.url

    def connect(self, autocommit: bool = False):
        try:
            return self.psycopg.connect(
                self.url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_S, application_name="mergeval"
            )
        except self.psycopg.Error as err:
            raise connect_fault(self.location, err, self.field) from err

    @contextmanager
    def write(self) -> Iterator[_Connection]:
        """One write transaction, holding the store's write lock from its first statement to its end."""
        with self.faults():
            conn = self.connect()
            try:
                conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_S}s'")
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
                yield _Connection(conn)
                conn.commit()
            except BaseException:
                try:
                    conn.rollback()
                except self.psycopg.Error:  # the connection is gone: the server rolled it back
                    pass
                raise
            finally:
                conn.close()

    @contextmanager
    def read(self) -> Iterator[_Connection]:
        with self.faults():
            conn = self.connect(autocommit=True)
            try:
                yield _Connection(conn)
            finally:
                conn.close()

    @contextmanager
    def faults(self) -> Iterator[None]:
        """A server error the environment caused becomes one line naming ``store.url``; IntegrityError (a
        write the schema forbids) and anything else stay as they are."""
        try:
            yield
        except self.psycopg.IntegrityError:
            raise
        except self.psycopg.Error as err:
            line = server_fault(self.location, err, self.field)
            if line is None:
                raise
            raise line from err

    def check_health(self) -> None:
        """The server accepts this user's writes to the store (a rolled-back one): a read-only server or a
        user without write rights fails here, not mid-run."""
        with self.faults():
            conn = self.connect()
            try:
                conn.execute("UPDATE meta SET value=value WHERE key='schema_version'")
            finally:
                conn.rollback()
                conn.close()

    @staticmethod
    def table_exists(db: _Connection, name: str) -> bool:
        return db.execute("SELECT to_regclass(?) IS NOT NULL", (name,)).fetchone()[0]

    @staticmethod
    def ddl(statement: str) -> str:
        """The store's DDL for PostgreSQL: 8-byte numbers as SQLite's (REAL is 4 bytes in PostgreSQL)."""
        return re.sub(r"\bINTEGER\b", "BIGINT", re.sub(r"\bREAL\b", "DOUBLE PRECISION", statement))

    @staticmethod
    def now(db: _Connection) -> float:
        """The server's clock (epoch s): claimants on different machines agree on it."""
        return db.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8").fetchone()[0]


_AUTH = ("password authentication failed", "no password supplied", "authentication failed", "pg_hba.conf", "role ")
_UNREACHABLE_FIX = "start the server or correct the host and port in store.url (is it reachable from this machine?)"


def _fault(field: str, problem: str, fix: str) -> UserError:
    """The UserError, its fix naming the setting the location came from (``--store`` on the listing commands)."""
    return UserError(field, problem, fix.replace("store.url", field))


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def connect_fault(location: str, err: Exception, field: str) -> UserError:
    """The one line for a failed connection: the database missing, authentication refused, or the server
    not reachable (refused, no such host or socket, timed out)."""
    text, why = str(err), _first_line(err)
    if re.search(r'database "[^"]*" does not exist', text):
        return _fault(
            field,
            f"{location}: the database does not exist ({why})",
            "create it (createdb NAME) or point store.url at an existing database",
        )
    if any(marker in text for marker in _AUTH):  # a wrong password, an unknown role, a refused host
        return _fault(
            field,
            f"{location}: authentication failed ({why})",
            "check the user and password in store.url (or PGPASSWORD / ~/.pgpass)",
        )
    return _fault(field, f"cannot reach the PostgreSQL server at {location} ({why})", _UNREACHABLE_FIX)


def server_fault(location: str, err: Exception, field: str) -> UserError | None:
    """The one line for a server error the environment caused mid-run (by SQLSTATE class), or None."""
    state = getattr(err, "sqlstate", None) or ""
    why = _first_line(err)
    if state == "53100":  # disk_full
        return _fault(
            field,
            f"the server of {location} has no space left ({why})",
            "free space on the database server, or point store.url at another database",
        )
    if state in ("25006", "42501"):  # read_only_sql_transaction, insufficient_privilege
        return _fault(
            field,
            f"{location} does not accept this user's writes ({why})",
            "grant the user write rights on the store's tables, or point store.url at a "
            "primary server (not a read-only replica)",
        )
    if state in ("42P01", "42703", "42804"):  # undefined_table / _column, datatype_mismatch: someone else's tables
        return _fault(
            field,
            f"{location} holds tables that are not a mergeval store's ({why})",
            "point store.url at an empty database or one that mergeval created",
        )
    if state == "55P03":  # lock_not_available
        return _fault(
            field,
            f"{location} stayed locked by another writer for over {LOCK_TIMEOUT_S} s",
            "wait for that process, or check the server for a stuck session (pg_stat_activity)",
        )
    if state.startswith(("08", "57")) or isinstance(err, _psycopg().OperationalError):
        # connection exceptions, operator intervention (server shut down, connection terminated)
        return _fault(
            field,
            f"lost the connection to the PostgreSQL server at {location} ({why})",
            _UNREACHABLE_FIX + "; then rerun: the interrupted write was rolled back",
        )
    return None
