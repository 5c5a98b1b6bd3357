"""Concurrent builds of one cached model and writers killed mid-write (real processes, real signals).

Two processes asked for the same zoo model and the same generated expert at once must both succeed and
leave one valid copy in the cache, even where the build lock is unavailable (the race is forced with it off);
with the lock, the second waits for the first and builds nothing. A writer of ``atomic_write_text`` / ``atomic_dir`` killed with SIGKILL at
random points must leave, at every final path, either the old complete content or the new one.

The interleavings are forced, not hoped for: each child is held at a gate after writing its copy and before
renaming it into place until both have written, so both really build. No step has a time limit; a child that
fails releases the other through an abort file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# The child: builds the tiny zoo model, then a one-step expert from it, with ``atomic_dir`` gated (see module
# docstring). argv: cache, sync directory, "0" | "1", "ordered" (1 renames after 0) | "together".
CHILD = textwrap.dedent("""
    import contextlib, json, os, sys, time
    from pathlib import Path
    import mergeval.core.paths, mergeval.models.zoo.experts as experts, mergeval.models.zoo.tiny as tiny

    cache, sync, me, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    real_dir, real_replace = mergeval.core.paths.atomic_dir, os.replace

    def wait_for(*names):
        while not all((sync / n).exists() for n in names):
            if (sync / "abort").exists():
                raise SystemExit("aborted: the other process failed")
            time.sleep(0.005)

    def both_reach(step):
        (sync / f"{step}-{me}").touch()
        wait_for(f"{step}-0", f"{step}-1")

    @contextlib.contextmanager
    def gated(final):
        stage = final.parent.name
        with real_dir(final) as tmp:
            yield tmp
            both_reach(f"built-{stage}")  # both copies complete, neither renamed
            if mode == "ordered" and me == "1":
                wait_for(f"done-0-{stage}")
            elif mode == "together":  # both pass the existence check before either renames
                def replace(src, dst):
                    both_reach(f"replace-{stage}")
                    return real_replace(src, dst)
                os.replace = replace
        os.replace = real_replace
        (sync / f"done-{me}-{stage}").touch()

    tiny.atomic_dir = experts.atomic_dir = gated
    experts.one_builder = lambda final, what: contextlib.nullcontext(True)  # no build lock: both really build
    model = tiny.zoo_dir("tiny", cache)
    train = type("Train", (), dict(steps=1, batch_size=2, lr=1e-3, seed=0))
    expert = experts.expert_dir(model, "fp-test", "chem_count", train, cache, "modelset.experts.chem")
    print(json.dumps({"model": str(model), "expert": str(expert)}))
""")


def run_pair(cache: Path, sync: Path, mode: str, script: str = CHILD) -> list[subprocess.CompletedProcess]:
    """Start both children, abort the survivor if one fails, and return both results."""
    sync.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(cache), str(sync), str(i), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            (sync / "abort").touch()
        time.sleep(0.01)
    return [subprocess.CompletedProcess(p.args, p.returncode, *p.communicate()) for p in procs]


def test_two_processes_building_the_same_model_and_expert_both_succeed_with_one_copy(tmp_path):
    from mergeval.models.checkpoint import load_tensors

    cache = tmp_path / "cache"
    done = run_pair(cache, tmp_path / "sync", "ordered")
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    paths = [json.loads(d.stdout.strip().splitlines()[-1]) for d in done]
    assert paths[0] == paths[1]
    for stage in ("models", "experts"):  # both built their own copy: the race really happened
        assert (tmp_path / "sync" / f"built-{stage}-0").exists() and (tmp_path / "sync" / f"built-{stage}-1").exists()
        entries = sorted(p.name for p in (cache / stage).iterdir() if not p.name.endswith(".lock"))
        assert entries == [Path(paths[0]["model" if stage == "models" else "expert"]).name], entries
    model, expert = Path(paths[0]["model"]), Path(paths[0]["expert"])
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    assert set(load_tensors(model)) == set(load_tensors(expert))
    assert json.loads((expert / "mergeval-expert.json").read_text())["domain"] == "chem_count"


# The child for the build lock: builds a one-step expert of the tiny zoo model; child 0 holds its build (the
# lock taken) until the file "go" exists. argv: cache, sync directory, "0" | "1".
LOCKED = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import mergeval.models.zoo.experts as experts, mergeval.models.zoo.tiny as tiny

    cache, sync, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    real_build = experts._build

    def build(*args):
        (sync / f"building-{me}").touch()
        while me == "0" and not (sync / "go").exists():
            time.sleep(0.005)
        real_build(*args)

    experts._build = build
    model = tiny.zoo_dir("tiny", cache)
    train = type("Train", (), dict(steps=1, batch_size=2, lr=1e-3, seed=0))
    print(json.dumps(str(experts.expert_dir(model, "fp-test", "chem_count", train, cache, "modelset.experts.chem"))))
""")


def test_a_second_builder_waits_for_the_first_and_builds_nothing(tmp_path):
    cache, sync = tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1")

    def start(me: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", LOCKED, str(cache), str(sync), me],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = start("0")
    while not (sync / "building-0").exists():  # the first holds the lock, inside its build
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    second = start("1")
    waiting = second.stdout.readline()  # blocks until the second reports that it waits
    (sync / "go").touch()
    outs = [first.communicate(), second.communicate()]
    assert [first.returncode, second.returncode] == [0, 0], [err[-2000:] for _, err in outs]
    assert waiting.startswith("mergeval: waiting for another process building expert 'chem_count'"), waiting
    assert not (sync / "building-1").exists()  # the second reused the first's expert
    paths = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert paths[0] == paths[1]
    assert [p.name for p in (cache / "experts").iterdir() if not p.name.startswith(".")] == [Path(paths[0]).name]


ATOMIC_DIR_PAIR = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from mergeval.core.paths import atomic_dir

    final, sync, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    real_replace = os.replace

    def both_reach(step):
        (sync / f"{step}-{me}").touch()
        while not ((sync / f"{step}-0").exists() and (sync / f"{step}-1").exists()):
            if (sync / "abort").exists():
                raise SystemExit("aborted")
            time.sleep(0.005)

    def replace(src, dst):
        both_reach("replace")
        return real_replace(src, dst)

    with atomic_dir(final) as tmp:
        (tmp / "owner").write_text(me)
        os.replace = replace  # after the existence check both see a missing final
    print("ok")
""")


def test_two_builders_renaming_at_the_same_moment_both_succeed(tmp_path):
    """Both builders pass atomic_dir's exists() check before either renames: the second rename meets a
    non-empty directory (ENOTEMPTY), which means another process built it; it keeps theirs."""
    final = tmp_path / "cache" / "models" / "m"
    done = run_pair(final, tmp_path / "sync", "", ATOMIC_DIR_PAIR)
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-1500:] for d in done]
    assert (final / "owner").read_text() in ("0", "1")


# ---------------------------------------------------------------- killed writers

WRITER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from mergeval.core.paths import atomic_dir, atomic_write_text

    root, start = Path(sys.argv[1]), int(sys.argv[2])
    print("ready", flush=True)
    for n in range(start, start + 10_000):
        body = str(n % 10) * 100_000  # ~100 kB: a write takes long enough for kills to land inside it
        atomic_write_text(root / "result.json", json.dumps({"n": n, "body": body}))
        print("wrote", n, flush=True)
        with atomic_dir(root / "dirs" / f"d{n}") as tmp:
            for part in ("a", "b"):
                (tmp / part).write_text(f"{n}:{body}")
""")


def check_result(root: Path, previous: int) -> int:
    """The n of result.json, after checking it is one whole write no older than ``previous``."""
    path = root / "result.json"
    if not path.exists():
        assert previous == 0
        return 0
    data = json.loads(path.read_text())
    assert data["body"] == str(data["n"] % 10) * 100_000
    assert data["n"] >= previous
    return data["n"]


def check_dirs(root: Path) -> None:
    """Every renamed directory holds both files, each whole."""
    for d in (root / "dirs").glob("d*"):
        n = int(d.name[1:])
        for part in ("a", "b"):
            assert (d / part).read_text() == f"{n}:" + str(n % 10) * 100_000, (d, part)


def test_a_writer_killed_at_random_points_leaves_old_or_new_content_never_partial(tmp_path):
    rng = random.Random(20)
    latest, start = 0, 1
    for round_ in range(20):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(start)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout.readline().strip() == "ready"
        # 0-2 whole writes first (1 in the first round), then the kill at a random point: with a disk slow
        # to fsync (CI, the other worker writing) a kill 0-50 ms after "ready" alone could land before any
        # write finished in every round, and the last assertion would fail for the machine, not the code
        for _ in range(rng.randrange(3) if round_ else 1):
            assert writer.stdout.readline().startswith("wrote ")
        time.sleep(rng.uniform(0.0, 0.05))
        writer.send_signal(signal.SIGKILL)
        assert writer.wait() == -signal.SIGKILL
        writer.stdout.close()
        latest = check_result(tmp_path, latest)
        check_dirs(tmp_path)
        start = latest + 1  # the next writer continues the sequence, so n only grows
    assert latest > 0  # some writes completed between kills


def test_a_file_written_whole_gets_the_mode_open_would_give_it(tmp_path):
    """result.json, mergekit.yaml and exported results were 0600 (mkstemp's) beside a run's other files."""
    import stat

    from mergeval.core.paths import atomic_write_text

    for umask in (0o022, 0o077):
        before = os.umask(umask)
        try:
            atomic_write_text(tmp_path / f"result-{umask:o}.json", "{}")
            with open(tmp_path / f"plain-{umask:o}.json", "w") as f:
                f.write("{}")
        finally:
            os.umask(before)
        modes = {stat.S_IMODE((tmp_path / f"{name}-{umask:o}.json").stat().st_mode) for name in ("result", "plain")}
        assert modes == {0o666 & ~umask}, (oct(umask), modes)
