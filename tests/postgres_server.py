"""A throwaway PostgreSQL server for tests: initdb in a temporary directory, a free private port on 127.0.0.1
and a unix socket in that directory, stopped and removed afterwards.

PostgreSQL refuses to run as root: when the tests run as root, the server's directory is handed to an
unprivileged user (``postgres`` where the Debian package created it, else ``nobody``) and initdb / pg_ctl run
as that user through ``runuser``; as a normal user they run directly. The binaries are looked up in
``$PG_BIN``, Debian's ``/usr/lib/postgresql/<version>/bin`` (newest first), then ``PATH``.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

USER, PASSWORD = "mergeval", "s3cret"  # the server's superuser; TCP logins need the password, the socket not


def find_binaries() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None."""
    candidates = [os.environ.get("PG_BIN")] + sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name), reverse=True
    )
    on_path = shutil.which("pg_ctl")
    candidates.append(str(Path(on_path).resolve().parent) if on_path else None)
    for directory in filter(None, candidates):
        if all((Path(directory) / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return Path(directory)
    return None


def why_not() -> str | None:
    """Why no server can be started here (None: it can)."""
    if find_binaries() is None:
        return "no PostgreSQL binaries (initdb, pg_ctl, postgres): install Debian's postgresql or set PG_BIN"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: PostgreSQL cannot run as root"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install '.[cluster]')"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One running server; ``url(db)`` connects over TCP with the password, ``new_database()`` makes a fresh
    database per test (so tests share the server but never its rows)."""

    def __init__(self):
        self.bin = find_binaries()
        # under /tmp: every user can reach it (the server's user must, when we are root), and the socket's path
        # stays under the 107 bytes a unix socket allows, whatever $TMPDIR is
        self.root = Path(tempfile.mkdtemp(prefix="mergeval-pg-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.data, self.port = self.root / "data", free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            owner = "postgres" if _user_exists("postgres") else "nobody"
            entry = pwd.getpwnam(owner)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self.as_user = ["runuser", "-u", owner, "--"]
        os.chmod(self.root, 0o700)
        (self.root / "pw").write_text(PASSWORD)
        if self.as_user:
            os.chown(self.root / "pw", entry.pw_uid, entry.pw_gid)
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=50"
        )
        try:
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                USER,
                f"--pwfile={self.root / 'pw'}",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--no-locale",
                "-E",
                "UTF8",
                "--no-sync",
            )
            self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self.as_user, str(self.bin / tool), *args],
            capture_output=True,
            text=True,
            cwd=self.root,
            env={**os.environ, "LC_ALL": "C"},
        )
        if done.returncode != 0:
            log = self.root / "log"
            raise RuntimeError(
                f"{tool} failed ({done.returncode}): {done.stderr[-2000:]}"
                + (f"\nserver log: {log.read_text()[-2000:]}" if log.exists() else "")
            )

    def url(self, database: str = "postgres", password: str = PASSWORD, port: int | None = None) -> str:
        return f"postgresql://{USER}:{password}@127.0.0.1:{port or self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database's URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
