"""Where the results store lives: an SQLite file (the zero-setup default) or a PostgreSQL server.

``mergeval.results.store.Store`` holds the schema and every query; a backend gives it
connections, one write transaction at a time, the clock claims are timed by,
and the one-line errors for what the environment can do to the database.

Why psycopg 3 behind a thin adapter, not SQLAlchemy Core + Alembic: the
store's SQL is already portable (``ON CONFLICT`` upserts, which SQLite has
since 3.24, plain types and constraints), so what differs between the two
databases fits in a few lines here: the placeholder style (``?`` vs ``%s``),
two column types (PostgreSQL's ``REAL`` is 4 bytes: timestamps need ``DOUBLE
PRECISION``), how a table's existence is looked up, and how writers are
serialised (SQLite's ``BEGIN IMMEDIATE``; a transaction-level advisory lock on
PostgreSQL, so every read-then-write of the claim protocol runs as it does on
SQLite). Rewriting the queries in SQLAlchemy's expression language would touch
every one of them and put a second transaction layer over SQLite's, whose
fault mapping (read-only, full, damaged file) the tests pin down; Alembic
would be a second migration system beside the v1 -> v5 in-place SQLite
migrations, for a PostgreSQL schema that starts at the current version.
Migrations stay versioned in ``meta.schema_version`` for both. SQLAlchemy is
still the way *into* the store's database for tools built on it (Optuna's
study storage): ``sqlalchemy_url`` gives its URL.
"""

from __future__ import annotations

from pathlib import Path

SERVER_SCHEMES = ("postgresql://", "postgres://")


def is_server_url(location: str | Path | None) -> bool:
    """Whether ``store.url`` names a PostgreSQL server rather than an SQLite file."""
    return isinstance(location, str) and location.startswith(SERVER_SCHEMES)


def sqlite_path(location: str | Path) -> Path:
    """The file of an SQLite location: a path, or an ``sqlite:///`` URL (``sqlite:////abs`` or ``sqlite:///rel``)."""
    text = str(location)
    if text.startswith("sqlite:///"):
        text = text[len("sqlite:///") :]
    return Path(text).expanduser()


def sqlalchemy_url(location: str | Path) -> str:
    """The SQLAlchemy URL of the store's database (for Optuna's ``RDBStorage`` and the like): ``sqlite:///<abs
    path>`` for a file, ``postgresql+psycopg://...`` for a server (psycopg 3, the driver the store uses; a bare
    ``postgresql://`` would make SQLAlchemy look for psycopg2)."""
    if is_server_url(location):
        return "postgresql+psycopg://" + str(location).split("://", 1)[1]
    return "sqlite:///" + str(sqlite_path(location).resolve())


def open_backend(location: str | Path, field: str):
    """The backend for ``location`` (a server URL or an SQLite file); ``field`` is the config field errors name."""
    if is_server_url(location):
        from mergeval.results.backends.postgres import PostgresBackend

        return PostgresBackend(str(location), field)
    from mergeval.results.backends.sqlite import SqliteBackend

    return SqliteBackend(sqlite_path(location), field)
