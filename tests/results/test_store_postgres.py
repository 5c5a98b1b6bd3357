"""The results store on a PostgreSQL server (``store.url=postgresql://...``), against a real server the suite
starts (tests/postgres_server.py), and the claim lease on both backends.

- Two processes on their own store connections, in lock step: every constituent is evaluated by exactly one
  of them while the other waits for it (forced: a claimant stores its scores only once the other process is
  waiting on that claim), and no run or evaluation row is lost.
- A claimant of another host that dies is taken over once its heartbeat stops for ``claim_timeout_s``, and
  not before: while it lives, its heartbeat keeps the claim past the timeout.
- ``mergeval.results`` and ``mergeval.report`` read a server's store.
- An unreachable server, refused credentials or a missing database are one line naming ``store.url``.

Skipped, with the reason, where no PostgreSQL binaries or psycopg are installed (.ci/run installs both).
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.child import run_module
from tests.postgres_server import Server, free_port, why_not

ROOT = Path(__file__).resolve().parents[2]
DIGESTS = {"a": "d1", "b": "d2"}
SETTINGS = {"limit": None, "dtype": "float32"}
NOT_HERE = why_not()
needs_server = pytest.mark.skipif(NOT_HERE is not None, reason=f"PostgreSQL server tests: {NOT_HERE}")


@pytest.fixture(scope="session")
def pg_server():
    if NOT_HERE is not None:
        pytest.skip(f"PostgreSQL server tests: {NOT_HERE}")
    server = Server()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=needs_server)])
def store_location(request, tmp_path) -> str:
    """A new, empty store: an SQLite file, or a fresh database on the suite's server."""
    if request.param == "sqlite":
        return str(tmp_path / "r.sqlite")
    return request.getfixturevalue("pg_server").new_database()


def child(script: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), **popen
    )


def scores(i: int) -> dict:
    return {task: {"metric": "acc,none", "value": i / 100, "stderr": 0.01, "n": 10} for task in DIGESTS}


# A sweep job: for each model in turn, a run row and the model's evaluation, claimed through the store. The
# claimant stores the scores only once the other job waits on its claim (or has claimed too: the bug this
# test looks for), so each model is contended for. argv: store, sync dir, "0" | "1", number of models.
JOB = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from mergeval.results.store import Store
    from tests.results.test_store_postgres import DIGESTS, SETTINGS, scores

    location, sync, me, n = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    other = "1" if me == "0" else "0"

    def wait_for_any(*names):
        while not any((sync / name).exists() for name in names):
            if (sync / "abort").exists():
                raise SystemExit("aborted: the other job failed")
            time.sleep(0.005)

    try:
        store = Store(location)
        (sync / f"ready-{me}").touch()
        wait_for_any(f"ready-{other}")
        evaluated = []
        for i in range(n):
            fp = f"model{i}"
            run_id = f"job{me}-{i}"
            store.start_run(run_id, experiment="e", method="m", config={"i": i}, versions={}, git={},
                            config_hash=f"h{i}")
            got = store.claim_or_scores(fp, DIGESTS, SETTINGS, lambda: (sync / f"waiting-{fp}").touch(), 0.01)
            if not got:  # claimed: evaluate
                evaluated.append(fp)
                (sync / f"claimed-{me}-{fp}").touch()
                wait_for_any(f"waiting-{fp}", f"claimed-{other}-{fp}")
                store.put_scores(fp, DIGESTS, SETTINGS, scores(i))
            elif got != scores(i):
                raise SystemExit(f"{fp}: read {got}")
            store.finish_run(run_id, result_path=f"/{run_id}/result.json", aggregates={"i": i}, timings={},
                             models=[{"fingerprint": fp}], scores={})
        print(json.dumps(evaluated), flush=True)
    except BaseException:
        (sync / "abort").touch()
        raise
""")


def test_two_jobs_evaluate_each_constituent_once_and_lose_no_row(store_location, tmp_path):
    from mergeval.results.store import Store

    store, n = Store(store_location), 6
    sync = tmp_path / "sync"
    sync.mkdir()
    jobs = [child(JOB, store_location, str(sync), me, str(n), stdout=subprocess.PIPE) for me in "01"]
    outputs = [job.communicate()[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    evaluated = [json.loads(out) for out in outputs]
    assert sorted(evaluated[0] + evaluated[1]) == [f"model{i}" for i in range(n)]  # each exactly once
    assert len(list(sync.glob("waiting-*"))) == n  # and every one was contended for
    runs = store.runs()
    assert len(runs) == 2 * n and {r["status"] for r in runs} == {"finished"}
    assert {store.finished_run(f"h{i}")["config_hash"] for i in range(n)} == {f"h{i}" for i in range(n)}
    for i in range(n):
        assert store.get_scores(f"model{i}", DIGESTS, SETTINGS) == scores(i)
    with store._read() as db:
        assert db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0] == 2 * n
        assert db.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0


# A claimant on another machine (its host name says so): claims, then evaluates until it is killed; its
# heartbeat renews the claim meanwhile. argv: store, claim timeout (s).
ELSEWHERE = textwrap.dedent("""
    import socket, sys
    socket.gethostname = lambda: "another-node"
    from mergeval.results.store import Store
    from tests.results.test_store_postgres import DIGESTS, SETTINGS

    store = Store(sys.argv[1], claim_timeout_s=float(sys.argv[2]))
    assert store.claim_or_scores("fp", DIGESTS, SETTINGS) == {}
    print("claimed", flush=True)
    sys.stdin.read()
""")


def test_a_dead_claimant_of_another_host_is_taken_over_after_the_timeout(store_location):
    from mergeval.results.store import Store

    timeout = 3.0
    other = child(ELSEWHERE, store_location, str(timeout), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline() == "claimed\n"
        store = Store(store_location, claim_timeout_s=timeout)

        def claim() -> tuple:
            with store._read() as db:
                return db.execute("SELECT host, pid, since, renewed FROM claims").fetchone()

        while (row := claim())[3] - row[2] <= timeout:  # alive: renewed past the timeout, still its claim
            assert row[0] == "another-node"
            time.sleep(0.1)
        last = {}

        def kill_other() -> None:  # called once this process waits for the (live) claim
            other.kill()
            other.wait()
            last["renewed"] = claim()[3]

        # The claim as just renewed by its heartbeat: the loop above saw the heartbeat keep it past the timeout,
        # and a stall of this process between there and here (a loaded machine) must not let it expire first.
        with store._write() as db:
            db.execute("UPDATE claims SET renewed=?", (store._db.now(db),))
        assert store.claim_or_scores("fp", DIGESTS, SETTINGS, kill_other, poll_s=0.05) == {}  # taken over
        host, pid, since, _ = claim()
        assert (host, pid) == (socket.gethostname(), os.getpid()) and "renewed" in last
        assert since - last["renewed"] >= timeout  # not before its lease ran out
        store.release_claims()
    finally:
        other.kill()
        other.wait()


@needs_server
def test_results_and_report_read_a_server_store(pg_server, tmp_path, capsys):
    import mergeval.results.__main__ as results
    from mergeval.results.store import Store
    from tests.report.test_report import fill_store, is_png, report_main

    url = pg_server.new_database()
    store = Store(url)
    fill_store(store)
    assert (
        results.main(["--store", url, "--method", "ties", "--status", "finished", "--csv", str(tmp_path / "t.csv")])
        == 0
    )
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert len(rows) == 3 and {r["method"] for r in rows} == {"ties"}
    shown = capsys.readouterr().out
    assert "3 run(s) in postgresql://mergeval:***@" in shown and "s3cret" not in shown
    out = tmp_path / "ties"
    assert report_main(["--store", url, "--method", "ties", "--param", "density", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "3 finished run(s) from the results store postgresql://" in text and is_png(out / "score_vs_param.png")


@needs_server
def test_server_faults_are_one_line_naming_store_url(pg_server, tmp_path):
    from omegaconf import OmegaConf

    from mergeval.core.errors import UserError
    from mergeval.results.store import open_store

    def opened(url: str) -> str:
        cfg = OmegaConf.create({"store": {"path": None, "url": url, "claim_timeout_s": 60}})
        with pytest.raises(UserError) as caught:
            open_store(cfg, tmp_path)
        assert caught.value.field == "store.url" and "s3cret" not in str(caught.value) and "\n" not in str(caught.value)
        return str(caught.value)

    assert "authentication failed" in opened(pg_server.url(password="wrong"))
    assert "database does not exist" in opened(pg_server.url("no_such_db"))
    assert "cannot reach the PostgreSQL server" in opened(pg_server.url(port=free_port()))
    foreign = pg_server.new_database()  # another application's database
    import psycopg

    with psycopg.connect(foreign, autocommit=True) as db:
        db.execute("CREATE TABLE meta (name TEXT)")
    assert "tables that are not a mergeval store's" in opened(foreign)
    # through the command line: one line, exit 2, before any model is loaded
    out = run_module(
        "mergeval",
        f"store.url={pg_server.url(port=free_port())}",
        f"cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1"),
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("mergeval: error: store.url: cannot reach the PostgreSQL server"), lines[0]


def test_the_heartbeat_ends_with_the_last_claim_or_once_renewals_failed_for_the_timeout(tmp_path):
    from mergeval.results.store import Store

    store = Store(tmp_path / "r.sqlite", claim_timeout_s=0.2)
    assert store.claim_or_scores("fp", DIGESTS, SETTINGS) == {}
    beat = store._heartbeat
    assert beat.is_alive()
    store.put_scores("fp", DIGESTS, SETTINGS, scores(1))  # the last claim ends: so does the heartbeat
    beat.join()
    assert store._heartbeat is None
    assert store.claim_or_scores("fp2", DIGESTS, SETTINGS) == {}  # a new claim, a new heartbeat
    failing = store._heartbeat
    assert failing is not beat and failing.is_alive()

    def unreachable() -> int:
        raise OSError("the store is gone")

    store.renew_claims = unreachable
    failing.join()  # renewals failed for claim_timeout_s: the lease is lost, the heartbeat gives up
    assert store._heartbeat is None
