"""Fault injection: damaged inputs, unwritable places, full disks, damaged stores, interruptions and kills.

The contract for each (issue 11): one line on stderr naming what and where and the fix, exit status 2, no
traceback, and nothing left half-written: no output directory, no temporary directory, no job directory, and
a results store whose integrity check passes with every run in a truthful state. Everything runs on the tiny
zoo (the merge-only CLI takes about 2 s per case).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.child import default_signals, run_module
from tests.merge.test_engine import make_expert

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def cli(
    module: str, *args: str, cwd: Path, prefix: tuple[str, ...] = (), preexec=None, timeout: float = 600
) -> subprocess.CompletedProcess:
    if prefix or preexec:  # a command around the interpreter, or a hook before it starts: a fresh process
        return subprocess.run(
            [*prefix, sys.executable, "-m", module, *args],
            cwd=cwd,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=preexec,
        )
    return run_module(module, *args, cwd=cwd, env=child_env(), timeout=timeout)


def assert_one_line(out: subprocess.CompletedProcess, starts: str, *contains: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mergeval: error: {starts}"), out.stderr[-3000:]
    for text in contains:
        assert text in lines[0], lines[0]
    return lines[0]


def leftovers(*dirs: Path) -> list[Path]:
    """Temporary files and directories, and Hydra job directories, below ``dirs``."""
    found = []
    for d in dirs:
        if d.exists():
            found += [p for p in d.rglob(".tmp-*")] + [p.parent for p in d.rglob(".hydra")]
    return found


@pytest.fixture(scope="module")
def zoo(tiny_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fault-zoo")
    return {
        "base": tiny_dir,
        "e0": make_expert(tiny_dir, root / "e0", seed=1),
        "e1": make_expert(tiny_dir, root / "e1", seed=2),
    }


def modelset(base: Path, e0: Path, e1: Path) -> list[str]:
    return [
        "+experiment=tiny",
        f"modelset.base={base}",
        "modelset.experts.chem.domain=null",
        f"modelset.experts.chem.source={e0}",
        "modelset.experts.units.domain=null",
        f"modelset.experts.units.source={e1}",
    ]


def damaged_copy(zoo, tmp_path: Path, damage) -> Path:
    bad = tmp_path / "damaged"
    shutil.copytree(zoo["e1"], bad)
    damage(bad)
    return bad


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4000])


def _garbage(d: Path) -> None:
    (d / "model.safetensors").write_bytes(os.urandom(5000))


def _huge_header(d: Path) -> None:
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes((len(data) * 4).to_bytes(8, "little") + data[8:])


def _header_not_json(d: Path) -> None:
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"{" * 32
    f.write_bytes(bytes(data))


def _index_names_missing_shard(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    (d / "model.safetensors").unlink()
    weight_map = {
        n: "model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors"
        for i, n in enumerate(names)
    }
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _config_not_json(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,')


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _other_head_layout(d: Path) -> None:
    """Same tensor shapes, other attention layout: 4 heads x 8 dims (2 kv heads) -> 2 heads x 16 (1 kv head)."""
    config = json.loads((d / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1)
    (d / "config.json").write_text(json.dumps(config))


def _other_rope(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    rope = config.get("rope_parameters") or config  # transformers 5 keeps rope_theta in rope_parameters
    rope["rope_theta"] = float(rope.get("rope_theta", 10000.0)) * 4
    (d / "config.json").write_text(json.dumps(config))


DAMAGE = {
    "truncated": (_truncate, "truncated"),
    "garbage": (_garbage, "safetensors"),
    "header length past the end": (_huge_header, "not a complete safetensors file"),
    "header not JSON": (_header_not_json, "damaged header"),
    "index names a missing shard": (_index_names_missing_shard, "missing shard"),
    "config.json not JSON": (_config_not_json, "not valid JSON"),
    "no weights": (_no_weights, "*.safetensors"),
    "attention layout": (_other_head_layout, "num_attention_heads is 2 but the base has 4"),
    "rope": (_other_rope, "rope_theta"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_expert_is_found_before_merging(case, zoo, tmp_path):
    """Each kind of damage is a UserError naming the expert's field (the CLI's one line; checked in-process)."""
    from mergeval.core.errors import UserError
    from mergeval.models.checkpoint import check_compatible

    damage, says = DAMAGE[case]
    with pytest.raises(UserError) as err:
        check_compatible(zoo["base"], {"units": damaged_copy(zoo, tmp_path, damage)})
    assert err.value.field == "modelset.experts.units" and says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["truncated", "config.json not JSON", "attention layout"])
def test_a_damaged_expert_is_one_line_and_leaves_nothing(case, zoo, tmp_path):
    damage, says = DAMAGE[case]
    bad = damaged_copy(zoo, tmp_path, damage)
    out = cli("mergeval.merge", *modelset(zoo["base"], zoo["e0"], bad), f"output={tmp_path / 'out'}", cwd=tmp_path)
    assert_one_line(out, "modelset.experts.units", says)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_the_full_run_checks_a_damaged_base_before_anything(zoo, tmp_path):
    bad = tmp_path / "base"
    shutil.copytree(zoo["base"], bad)
    _truncate(bad)
    out = cli("mergeval", *modelset(bad, zoo["e0"], zoo["e1"]), f"store.path={tmp_path / 'r.sqlite'}", cwd=tmp_path)
    assert_one_line(out, "modelset.base", "truncated")
    assert "evaluating" not in out.stdout and not leftovers(tmp_path)
    assert [r[0] for r in sqlite3.connect(tmp_path / "r.sqlite").execute("SELECT status FROM runs")] == ["failed"]


def test_a_damaged_tokenizer_fails_before_merging(zoo, tmp_path):
    bad = tmp_path / "base"
    shutil.copytree(zoo["base"], bad)
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    out = cli("mergeval", *modelset(bad, zoo["e0"], zoo["e1"]), f"store.path={tmp_path / 'r.sqlite'}", cwd=tmp_path)
    assert_one_line(out, "modelset.base", "transformers cannot load AutoTokenizer")
    assert "evaluating" not in out.stdout and not leftovers(tmp_path)


def test_nan_in_an_expert_names_the_same_field_and_directory_in_a_run_as_in_merge_only(zoo, tmp_path):
    def poison(tensors, _dst):
        tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")

    bad = make_expert(zoo["base"], tmp_path / "nan", seed=9, change=poison)
    lines = [
        assert_one_line(
            cli(
                module,
                *modelset(zoo["base"], zoo["e0"], bad),
                f"store.path={tmp_path / 'r.sqlite'}",
                f"output={tmp_path / 'out'}",
                cwd=tmp_path,
            ),
            "modelset.experts.units",
            f"in {bad}",
            "NaN or Inf",
        )
        for module in ("mergeval", "mergeval.merge")
    ]
    assert lines[0] == lines[1] and not leftovers(tmp_path)


# ---------------------------------------------------------------- places the user cannot write


def unprivileged() -> tuple[str, ...]:
    """A command prefix under which file permissions apply: root ignores them, so as root the child drops
    the capabilities that override them (setpriv); other users need nothing."""
    if os.geteuid() != 0:
        return ()
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: file permissions cannot be tested")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner")


def test_output_in_a_read_only_directory(zoo, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        out = cli(
            "mergeval.merge",
            *modelset(zoo["base"], zoo["e0"], zoo["e1"]),
            f"output={locked / 'out'}",
            cwd=tmp_path,
            prefix=unprivileged(),
        )
    finally:
        locked.chmod(0o755)
    assert_one_line(out, str(locked), "permission denied")
    assert not list(locked.iterdir()) and not leftovers(tmp_path)


def test_output_below_an_existing_file(zoo, tmp_path):
    (tmp_path / "afile").write_text("x")
    out = cli(
        "mergeval.merge",
        *modelset(zoo["base"], zoo["e0"], zoo["e1"]),
        f"output={tmp_path / 'afile' / 'sub' / 'out'}",
        cwd=tmp_path,
    )
    assert_one_line(out, str(tmp_path / "afile"), "is a file, not a directory")
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("where", ["below a file", "in /proc"])
def test_an_output_that_cannot_be_created_is_refused_before_any_model_is_built(tmp_path, where):
    """The quickstart's modelset with an empty cache would convert the base and fine-tune two experts for
    minutes before the merge found that its output cannot be made: the place is tried first."""
    if where == "in /proc" and not Path("/proc/self").is_dir():
        pytest.skip("no procfs here")
    (tmp_path / "afile").write_text("x")
    output = tmp_path / "afile" / "out" if where == "below a file" else Path("/proc/self/merged")
    out = cli("mergeval.merge", f"cache_dir={tmp_path / 'cache'}", f"output={output}", cwd=tmp_path, timeout=120)
    if where == "below a file":
        assert_one_line(out, str(tmp_path / "afile"), "is a file, not a directory")
    else:  # procfs refuses every mkdir with ENOENT; the line names the output field
        assert_one_line(out, "output: cannot create '/proc/", "choose a directory you can write to")
    assert not (tmp_path / "cache").exists() and not leftovers(tmp_path)


def test_a_file_size_limit_while_writing_the_merge(zoo, tmp_path):
    """The merged weights outgrow RLIMIT_FSIZE (as a full disk would stop them): EFBIG, one line, and the
    half-written temporary directory is gone."""
    limit = (zoo["e0"] / "model.safetensors").stat().st_size // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = cli(
        "mergeval.merge",
        *modelset(zoo["base"], zoo["e0"], zoo["e1"]),
        f"output={tmp_path / 'out'}",
        cwd=tmp_path,
        preexec=small_files,
    )
    assert_one_line(out, str(tmp_path / "out"), "file-size limit")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs (root with mount rights only; skipped elsewhere): a real full disk."""
    where = tmp_path / "small"
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root with mount rights)")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_while_writing_the_merge(zoo, tmp_path, small_fs):
    out = cli(
        "mergeval.merge", *modelset(zoo["base"], zoo["e0"], zoo["e1"]), f"output={small_fs / 'out'}", cwd=tmp_path
    )
    assert_one_line(out, str(small_fs / "out"), "no space left")
    assert not list(small_fs.iterdir()) and not leftovers(tmp_path)


def test_a_full_disk_under_a_native_writer_is_one_line_naming_the_directory(zoo, small_fs):
    """transformers' save_pretrained writes through safetensors' Rust code, whose full disk is a SafetensorError
    ("... (os error 28)"), not an OSError: an expert built into a full cache is still one line naming the
    directory being written, and nothing half-written stays."""
    from mergeval.core.paths import atomic_dir
    from mergeval.models.checkpoint import load_model
    from mergeval.run.cli import user_failure

    model = load_model(zoo["e0"])
    with pytest.raises(OSError) as raised:
        with atomic_dir(small_fs / "expert") as tmp:
            model.save_pretrained(tmp)
    assert type(raised.value.__cause__).__name__ == "SafetensorError"  # the native library's own type
    line = user_failure(raised.value).line()
    assert line.startswith(f"mergeval: error: {small_fs / 'expert'}: no space left on the device"), line
    assert not list(small_fs.iterdir())
    from safetensors import SafetensorError  # raised where no atomic_dir names the place: still one line

    assert (
        user_failure(SafetensorError("I/O error: No space left on device (os error 28)"))
        .line()
        .startswith("mergeval: error: disk: no space left on the device")
    )
    assert user_failure(SafetensorError("header too large")) is None  # not the environment: a bug, traceback


@pytest.mark.parametrize("below", ["", "sub"])
def test_cache_dir_below_a_file(zoo, tmp_path, below):
    """The line names the setting and the file in the way (below it, the file's path, not the one asked for)."""
    (tmp_path / "afile").write_text("x")
    out = cli(
        "mergeval.merge",
        *modelset(zoo["base"], zoo["e0"], zoo["e1"]),
        f"cache_dir={tmp_path / 'afile' / below}",
        f"output={tmp_path / 'out'}",
        cwd=tmp_path,
    )
    assert_one_line(out, f"cache_dir: '{tmp_path / 'afile'}' is a file, not a directory")


# ---------------------------------------------------------------- the results store


def make_store(path: Path) -> None:
    from mergeval.results.store import Store

    Store(path)


def test_a_read_only_store_fails_at_open_not_mid_run(zoo, tmp_path):
    store = tmp_path / "r.sqlite"
    make_store(store)
    store.chmod(0o444)
    out = cli(
        "mergeval",
        *modelset(zoo["base"], zoo["e0"], zoo["e1"]),
        f"store.path={store}",
        "benchmark.limit=4",
        cwd=tmp_path,
        prefix=unprivileged(),
    )
    assert_one_line(out, "store.path", "read-only")
    assert "evaluating" not in out.stdout and not leftovers(tmp_path)


@pytest.mark.parametrize("damage", ["page", "garbage"])
def test_a_damaged_store_is_found_at_open(damage, zoo, tmp_path):
    store = tmp_path / "r.sqlite"
    make_store(store)
    data = bytearray(store.read_bytes())
    if damage == "page":  # the runs table's page (4096-byte pages; page 6 is its root in a new store)
        data[4096 * 5 : 4096 * 5 + 300] = b"\x07" * 300
    else:
        data[:100] = os.urandom(100)
    store.write_bytes(bytes(data))
    out = cli(
        "mergeval",
        *modelset(zoo["base"], zoo["e0"], zoo["e1"]),
        f"store.path={store}",
        "benchmark.limit=4",
        cwd=tmp_path,
    )
    assert_one_line(out, "store.path", "damaged")
    assert not leftovers(tmp_path)


def test_a_store_damaged_mid_run_is_one_line(tmp_path):
    """A page corrupted after the open-time check: the next write names the store, not sqlite3."""
    from mergeval.core.errors import UserError
    from mergeval.results.store import Store

    store = Store(tmp_path / "r.sqlite")
    with sqlite3.connect(store.path) as db:
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name='runs'").fetchone()[0]
        page = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(store.path.read_bytes())
    data[page * (root - 1) : page * (root - 1) + 200] = b"\x07" * 200
    store.path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="store.path: .* is damaged"):
        store.start_run("r1", experiment="e", method="m", config={}, versions={}, git={})


# ---------------------------------------------------------------- interruptions and kills


def started(out_parent: Path, proc: subprocess.Popen, name: str, timeout: float = 300) -> bool:
    """Wait until the merge's temporary directory for ``name`` appears (the merge is writing), then freeze the
    process so a signal lands mid-merge; False if the process ended first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if any(out_parent.glob(f".tmp-{name}-*")):
            proc.send_signal(signal.SIGSTOP)
            # the merge may have ended between the glob and the signal (a test process descheduled there):
            # then it was not frozen mid-merge, and the caller treats it as a merge that finished first
            return frozen(proc)
        time.sleep(0.0005)
    return False


def frozen(proc: subprocess.Popen, timeout: float = 30) -> bool:
    """Whether the process reached the stopped state (its SIGSTOP delivered) rather than ending."""
    from mergeval.core.proc import state as process_state

    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:  # poll() does not report a stopped child
        state = process_state(proc.pid)
        if state in ("T", "t"):
            return True
        if state is None:
            return False
        time.sleep(0.001)
    return False


def signal_mid_merge(models: dict[str, Path], parent: Path, sig: int, attempts: int = 5) -> tuple[int, str, Path]:
    """Start merges into ``parent`` until one is caught while writing and deliver ``sig`` there: (exit status,
    stderr, its output path). A merge that finished before it could be caught must be whole; it is retried."""
    for attempt in range(attempts):
        out = parent / f"out{attempt}"
        # faulthandler: should the process crash after all (it aborted once at exit, before mergeval.run.cli.end_now),
        # its threads' stacks are in the failure's message
        proc = subprocess.Popen(
            merge_cmd(models, out),
            cwd=parent,
            env=dict(child_env(), PYTHONFAULTHANDLER="1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=default_signals,
        )
        # frozen with the temporary directory still there: the merge is mid-write. It may also have renamed it into
        # place between the glob and the freeze (CI saw one exit 0 that way); then it is a merge that finished first
        if started(parent, proc, out.name) and any(parent.glob(f".tmp-{out.name}-*")):
            proc.send_signal(sig)
            proc.send_signal(signal.SIGCONT)
            _, err = proc.communicate(timeout=120)
            return proc.returncode, err, out
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate()
        assert proc.returncode == 0 and whole(out), err[-3000:]
    pytest.fail(f"none of {attempts} merges could be caught while writing")


def whole(out: Path) -> bool:
    """A complete merged model directory (every tensor's bytes present)."""
    from mergeval.merge.reader import CheckpointReader

    return (out / "config.json").exists() and bool(CheckpointReader(out, "output").names())


@pytest.fixture(scope="module")
def medium(cache, tmp_path_factory) -> dict[str, Path]:
    """A model large enough (about 17 MB) that a merge lasts long enough to be interrupted."""
    from mergeval.models.zoo.tiny import ZOO, zoo_dir

    ZOO["medium"] = dict(ZOO["tiny"], hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    base = zoo_dir("medium", cache)
    root = tmp_path_factory.mktemp("medium")
    return {"base": base, "e0": make_expert(base, root / "e0", seed=1), "e1": make_expert(base, root / "e1", seed=2)}


def merge_cmd(models: dict[str, Path], out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mergeval.merge",
        *modelset(models["base"], models["e0"], models["e1"]),
        "method=ties",
        "method.density=0.3",
        f"output={out}",
    ]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_merge_stops_cleanly(sig, medium, tmp_path):
    status, err, out = signal_mid_merge(medium, tmp_path, sig)
    assert status == 2 and "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mergeval: interrupted by"), err[-3000:]
    assert (
        "run the same command again to merge" in lines[0] and "evaluations" not in lines[0]
    )  # a merge evaluates nothing
    # caught while writing: no output, unless the rename into place won the race (then it is whole)
    assert (not out.exists() or whole(out)) and not leftovers(tmp_path)


def merge_with_units(when: str) -> str:
    """A ``python -m mergeval.merge`` program whose merge units first run ``when`` (Python lines, indented by
    four spaces), with ``call`` the unit's number in the order the workers start them. A worker starts every unit
    of a merge to disk in ``execute._blocks_of``, whether the unit is then merged whole or in row blocks (which
    tensors take row blocks depends on whether the compiled kernels are loaded: ``fused.loaded``)."""
    return f"""
import runpy, sys, threading, time
from mergeval.merge import execute
from mergeval.core.errors import UserError

blocks_of, calls, lock = execute._blocks_of, [], threading.Lock()

def unit(*args, **kwargs):
    with lock:
        calls.append(1)
        call = len(calls)
{when}
    return blocks_of(*args, **kwargs)

execute._blocks_of = unit
sys.argv[0] = "mergeval.merge"
runpy.run_module("mergeval.merge", run_name="__main__", alter_sys=True)
"""


# The second merged unit never ends (a worker thread holds it): an interrupted merge must end without waiting for
# the units its workers are still merging.
HELD_IN_MERGING = merge_with_units("""\
    if call == 2:
        print("held in merging", flush=True)
        time.sleep(600)""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_merge_ends_without_waiting_for_a_running_unit(sig, medium, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", HELD_IN_MERGING, *merge_cmd(medium, out)[3:]],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    try:
        assert proc.stdout.readline().strip() == "held in merging", proc.stderr.read()[-3000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)  # waiting for the held unit would take 600 s
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("mergeval: interrupted by"), err[-3000:]
    assert not out.exists() and not leftovers(tmp_path)


def fail_while_merging(error: str, medium, tmp_path) -> tuple[int, str]:
    """(exit status, stderr) of a merge whose first unit never ends (the consumer waits for it, or for an error
    that comes first) while the next unit a worker starts raises ``error`` (a Python expression)."""
    script = merge_with_units(f"""\
    if call == 1:
        time.sleep(600)
    if call == 2:
        raise {error}""")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *merge_cmd(medium, tmp_path / "out")[3:]],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=120)  # waiting for the held unit would take 600 s
    finally:
        proc.kill()
    return proc.returncode, err


def test_a_merge_that_fails_ends_without_waiting_for_a_running_unit(medium, tmp_path):
    """A later unit finds a damaged tensor while a worker still merges an earlier one (held here for 600 s):
    the error's one line comes at once, status 2, and the process ends without waiting for that unit, as an
    interrupted merge does."""
    status, err = fail_while_merging(
        'UserError("modelset.experts.units.source", "tensor X holds NaN", "check the checkpoint")', medium, tmp_path
    )
    expected = "mergeval: error: modelset.experts.units.source: tensor X holds NaN; check the checkpoint"
    assert status == 2 and err.strip().splitlines() == [expected], err[-3000:]
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_an_unexpected_error_mid_merge_shows_its_traceback_and_ends_without_waiting(medium, tmp_path):
    """A bug (not a user's mistake) in a later unit while an earlier one still runs: the traceback as Python
    prints it, status 1, at once."""
    status, err = fail_while_merging('RuntimeError("a bug in a merge method")', medium, tmp_path)
    assert status == 1, err[-3000:]
    assert "Traceback (most recent call last):" in err and err.rstrip().endswith(
        "RuntimeError: a bug in a merge method"
    ), err[-3000:]
    # no half-written output; the job directory stays, with its log, as after any unexpected error
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_a_killed_merge_leaves_debris_that_the_next_merge_removes(medium, tmp_path):
    status, _, out = signal_mid_merge(medium, tmp_path, signal.SIGKILL)
    assert status == -signal.SIGKILL
    debris = list(tmp_path.glob(".tmp-*"))
    assert (debris and not out.exists()) or whole(out)
    again = run_module(*merge_cmd(medium, tmp_path / "again")[2:], cwd=tmp_path, env=child_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert whole(tmp_path / "again") and not list(tmp_path.glob(".tmp-*"))


def test_a_live_process_temporary_files_are_never_removed(tmp_path):
    from mergeval.core.paths import remove_orphans
    from mergeval.core.proc import tmp_prefix

    mine = tmp_path / (tmp_prefix("out") + "abc")
    mine.mkdir()
    foreign = tmp_path / ".tmp-out-deadbeef.1.1-abc"  # another host's: cannot be proven orphaned
    foreign.mkdir()
    unowned = tmp_path / ".tmp-out-xyz"  # an old-style name without an owner
    unowned.mkdir()
    assert remove_orphans(tmp_path) == [] and mine.exists() and foreign.exists() and unowned.exists()


def run_cmd(models: dict[str, Path], store: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mergeval",
        *modelset(models["base"], models["e0"], models["e1"]),
        f"store.path={store}",
        "benchmark.limit=4",
        *extra,
    ]


def statuses(store: Path) -> list[tuple[str, str | None]]:
    with sqlite3.connect(store) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return db.execute("SELECT status, error FROM runs ORDER BY created").fetchall()


# ``python -m mergeval`` whose first evaluation holds until a signal comes: the tiny model's whole evaluation
# takes a fraction of a second, so a signal sent after the "evaluating" line could otherwise arrive after the
# run had finished (a test process descheduled on a loaded machine), and the test would fail for the machine.
HELD_IN_EVALUATION = """
import runpy, sys, time
from mergeval.eval.harness import Harness

def held(self, *args, **kwargs):
    print("held in evaluation", flush=True)
    time.sleep(600)

Harness.score = held
sys.argv[0] = "mergeval"
runpy.run_module("mergeval", run_name="__main__", alter_sys=True)
"""


def evaluating(zoo, store: Path, cwd: Path) -> subprocess.Popen:
    """A run into job directory ``first``, returned while it is inside its first evaluation (held there)."""
    cmd = [sys.executable, "-c", HELD_IN_EVALUATION, *run_cmd(zoo, store, "hydra.run.dir=first")[3:]]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    for line in proc.stdout:
        if line.strip() == "held in evaluation":
            return proc
    pytest.fail("the run ended before it started evaluating: " + proc.stderr.read()[-3000:])


@pytest.mark.parametrize("sig,name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_a_signal_while_evaluating_marks_the_run_interrupted_and_a_rerun_finishes(zoo, tmp_path, sig, name):
    store = tmp_path / "r.sqlite"
    proc = evaluating(zoo, store, tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.strip().startswith(f"mergeval: interrupted by {name}"), err[-3000:]
    assert "run the same command again to continue" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "first").exists()
    assert statuses(store) == [("interrupted", f"interrupted by {name}")]  # Ctrl-C's once read "interrupted by "
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0
    again = run_module(*run_cmd(zoo, store, "hydra.run.dir=second")[2:], cwd=tmp_path, env=child_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert [s for s, _ in statuses(store)] == ["interrupted", "finished"]


# SIGTERM's handler (or Ctrl-C's) runs inside a weakref callback (as SIGTERM's once did inside importlib's module-lock
# callback during an import): Python discards the exception raised there; mergeval must deliver it again.
SWALLOWED_SIGTERM = """
import os, signal, sys, threading, time, weakref
from mergeval.run.cli import handle_sigterm

handle_sigterm()


class Held:
    pass


def callback(_):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    for _ in range(1000):  # the handler runs here, where its exception is discarded
        pass


held = Held()
ref = weakref.ref(held, callback)
try:
    del held
    if sys.argv[2] == "blocked":  # the main thread then waits, with no timeout (as a merge waits for its units)
        threading.Event().wait()
    else:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass
    print("not interrupted")
except KeyboardInterrupt as err:
    print("interrupted", type(err).__name__)
"""

# A job in a worker process (joblib's launcher): no run_cli set-up, Python's own SIGINT handler. Ctrl-C to the
# sweep's process group raises there too, and once it did so inside a finalizer (regex's Group.__del__).
DISCARDED_IN_A_JOB = """
import os, signal, sys, time
from pathlib import Path
from mergeval.run.cli import failing_cleanly


class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # Python's handler raises here, where its KeyboardInterrupt is discarded
            pass


job = Path(sys.argv[1])
job.mkdir()
before = sys.unraisablehook
try:
    with failing_cleanly(job):
        Finalized()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted", job.exists(), sys.unraisablehook is before)
"""


def test_an_interruption_discarded_inside_a_workers_job_still_interrupts_it(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", DISCARDED_IN_A_JOB, str(tmp_path / "job")],
        capture_output=True,
        text=True,
        env=child_env(),
        preexec_fn=default_signals,
        timeout=60,
        check=False,
    )
    assert out.stdout.split() == ["interrupted", "False", "True"], out.stdout + out.stderr[-2000:]
    assert out.stderr == ""  # not Python's "Exception ignored in" report


# The handler runs while importlib's own code runs (its module-lock callback holds the global import lock until
# the next statement): it must not raise there, but deliver the interruption a moment later to the main thread,
# here blocked in a wait.
IN_IMPORTLIB = """
import signal, sys, threading
from types import SimpleNamespace
from mergeval.run import cli

cli.handle_sigterm()
handler = signal.getsignal(getattr(signal, sys.argv[1]))
importlib_frame = SimpleNamespace(f_code=SimpleNamespace(co_filename="<frozen importlib._bootstrap>"))
try:
    handler(getattr(signal, sys.argv[1]), importlib_frame)
    print("deferred")
    threading.Event().wait()
    print("not interrupted")
except KeyboardInterrupt as err:
    print("interrupted", type(err).__name__)
"""


# A command ending (here: successfully) while a thread of its own still multiplies matrices; the signal arrives
# while the interpreter waits for that thread at exit.
SIGNAL_AT_EXIT = """
import sys, threading, time
import torch
from mergeval.run.cli import handle_sigterm

handle_sigterm()
a = torch.randn(1000, 1000)

def work():
    end = time.monotonic() + 60
    while time.monotonic() < end:
        a @ a  # torch releases the GIL here and takes it back after

threading.Thread(target=work).start()
# runs when the interpreter, exiting, starts to wait for the thread (CPython's hook for this, private but stable)
threading._register_atexit(print, "waiting for threads at exit", flush=True)
sys.exit(0)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interruption_while_the_interpreter_waits_for_threads_at_exit_ends_it_cleanly(sig):
    """Python reports it as unraisable and would go on to its teardown with the thread still in torch, which then
    aborted the process ("terminate called without an active exception"); the command ends at once instead."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNAL_AT_EXIT],
        env=dict(child_env(), PYTHONFAULTHANDLER="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    try:
        assert proc.stdout.readline().strip() == "waiting for threads at exit", proc.stderr.read()[-3000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)  # the thread alone would run 60 s
    finally:
        proc.kill()
    assert proc.returncode == 2 and err.strip() == "", err[-3000:]


@pytest.mark.parametrize("main_thread", ["busy", "blocked"])
@pytest.mark.parametrize("signame,raised", [("SIGTERM", "Interrupted"), ("SIGINT", "KeyboardInterrupt")])
def test_an_interruption_whose_exception_python_discards_still_interrupts(signame, raised, main_thread):
    """``blocked``: the signal sent again must reach the main thread itself; raised from a timer thread it landed
    there, and the main thread's wait never returned (an interrupted merge hung in the suite)."""
    out = subprocess.run(
        [sys.executable, "-c", SWALLOWED_SIGTERM, signame, main_thread],
        capture_output=True,
        text=True,
        env=child_env(),
        preexec_fn=default_signals,
        timeout=60,
    )
    assert out.stdout.strip() == f"interrupted {raised}", out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("signame,raised", [("SIGTERM", "Interrupted"), ("SIGINT", "KeyboardInterrupt")])
def test_an_interruption_inside_importlib_is_delivered_after_it(signame, raised):
    out = subprocess.run(
        [sys.executable, "-c", IN_IMPORTLIB, signame],
        capture_output=True,
        text=True,
        env=child_env(),
        preexec_fn=default_signals,
        timeout=60,
    )
    assert out.stdout.split() == ["deferred", "interrupted", raised], out.stdout + out.stderr[-2000:]


def test_sigkill_leaves_running_until_the_next_process_proves_it_dead(zoo, tmp_path):
    store = tmp_path / "r.sqlite"
    proc = evaluating(zoo, store, tmp_path)
    proc.kill()
    proc.communicate()
    assert [s for s, _ in statuses(store)] == ["running"]
    listed = cli("mergeval.results", "--store", str(store), cwd=tmp_path)
    assert listed.returncode == 0 and "interrupted" in listed.stdout, listed.stdout + listed.stderr
    ((status, note),) = statuses(store)
    assert status == "interrupted" and "ended without finishing" in note
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0


# ---------------------------------------------------------------- sweeps


def test_a_sweep_checks_every_job_before_the_first(zoo, tmp_path):
    store = tmp_path / "r.sqlite"
    out = cli(
        "mergeval",
        "-m",
        *modelset(zoo["base"], zoo["e0"], zoo["e1"]),
        f"store.path={store}",
        "method=ties",
        "method.density=0.5,0,1.5",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("mergeval: error: ") for line in lines), out.stderr
    assert "sweep job 2 of 3 (method.density=0)" in lines[0] and "method.density" in lines[0]
    assert "sweep job 3 of 3 (method.density=1.5)" in lines[1]
    assert "2 of 3 jobs are invalid; no job was started" in lines[2]
    assert not store.exists() and not leftovers(tmp_path) and not (tmp_path / "multirun").exists()
