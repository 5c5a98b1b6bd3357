"""The results store (SQLite or PostgreSQL) and its command, ``python -m mergeval.results``."""
