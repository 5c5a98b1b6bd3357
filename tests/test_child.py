"""The suite's child processes (tests/child.py): a child forked from a zygote behaves as ``python -m`` would."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.child import Zygote, import_time_env, run_module

PROBE = """
import atexit, json, os, sys, time
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                  "name": __name__, "spec": __spec__.name, "is_main": sys.modules["__main__"].__dict__ is globals(),
                  "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["fail"]:
    raise ValueError("boom")
if sys.argv[1:] == ["exit3"]:
    sys.exit(3)
if sys.argv[1:] == ["sleep"]:
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def zygote():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # with more threads torch's import starts some
    zygote = Zygote(env)
    assert zygote.ready, "the zygote did not start (or had threads after its imports)"
    yield zygote
    zygote.close()


@pytest.mark.parametrize("args", [[], ["fail"], ["exit3"], ["a b", "--flag=1"]])
def test_a_forked_child_is_what_python_m_gives(zygote, tmp_path, args):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    env = dict(zygote.env, PROBE="here")
    forked = zygote.run("probe_mod", args, tmp_path, env, timeout=120)
    fresh = subprocess.run(
        [sys.executable, "-m", "probe_mod", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert forked is not None
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    assert forked.stdout.endswith("atexit ran\n") and '"probe": "here"' in forked.stdout
    assert forked.stderr.startswith("to stderr\n")
    if args == ["fail"]:  # an uncaught exception: the interpreter's traceback and status 1
        assert forked.returncode == 1 and "Traceback" in forked.stderr
        assert forked.stderr.strip().endswith("ValueError: boom") and fresh.stderr.strip().endswith("ValueError: boom")
    else:
        assert forked.stderr == fresh.stderr


def test_a_child_past_its_timeout_is_killed_and_the_zygote_serves_on(zygote, tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run("probe_mod", ["sleep"], tmp_path, zygote.env, timeout=2)
    again = zygote.run("probe_mod", [], tmp_path, zygote.env, timeout=120)
    assert again is not None and again.returncode == 0


def test_mergevals_one_line_error_is_the_same_forked_and_fresh(tmp_path, cache):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    forked = run_module("mergeval", "+experiment=tiny", "method.densty=0.5", cwd=tmp_path, env=env, timeout=300)
    fresh = subprocess.run(
        [sys.executable, "-m", "mergeval", "+experiment=tiny", "method.densty=0.5"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and forked.stderr.startswith("mergeval: error: method.densty: no such field")


def test_only_import_time_variables_pick_the_zygote():
    base = {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MERGEVAL_CACHE": "/a"}
    assert import_time_env(base) == import_time_env(dict(base, MERGEVAL_CACHE="/b", PROBE="x"))
    for changed in (
        {"HF_HUB_OFFLINE": "0"},
        {"OMP_NUM_THREADS": "2"},
        {"HOME": "/elsewhere"},
        {"HF_DATASETS_OFFLINE": "1"},
    ):
        assert import_time_env(base) != import_time_env({**base, **changed}), changed


def test_an_environment_whose_zygote_refuses_is_not_tried_again(monkeypatch):
    """With two OpenMP threads torch's import starts a thread, so that zygote refuses to fork; every later
    child with that environment is spawned fresh at once instead of paying another refused start."""
    import tests.child as child

    started = []

    class Counting(child.Zygote):
        def __init__(self, env):
            started.append(env)
            super().__init__(env)

    monkeypatch.setattr(child, "Zygote", Counting)
    monkeypatch.setattr(child, "_refused", set())
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    assert child._zygote_for(env) is None and child._zygote_for(env) is None
    assert len(started) == 1
