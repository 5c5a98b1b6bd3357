"""Sweeps at scale: launcher presets (joblib, Ray, Slurm via submitit), resumable sweeps, progress.

One 12-job sweep on the tiny zoo with two workers is killed (SIGKILL to its whole process group) at random
points and resumed until it completes: every configuration ends finished exactly once in the store and the
store passes its integrity check. Four of its configurations through a local Ray instance (two CPUs) into
another store give the same scores (four, not twelve: starting Ray and its workers is most of the cost, and
what Ray could get wrong is already there with four). The runs are shared by the assertions (module-scoped
fixtures).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from mergeval.run.config import register_configs
from tests.child import default_signals

LAMBDAS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
SWEEP = [
    "+experiment=tiny",
    "benchmark.limit=8",
    "method=task_arithmetic,ties",
    f"method.lambda_={','.join(map(str, LAMBDAS))}",
]
CONFIGS = {(m, lam) for m in ("task_arithmetic", "ties") for lam in LAMBDAS}
RAY_LAMBDAS = (0.5, 2.0)
RAY_SWEEP = [*SWEEP[:-1], f"method.lambda_={','.join(map(str, RAY_LAMBDAS))}"]
RAY_CONFIGS = {(m, lam) for m in ("task_arithmetic", "ties") for lam in RAY_LAMBDAS}
KILLS = 2
SEED = 16  # the kill points: random, and the same every run of the suite


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mergeval", "-m", *args]


def env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1")


def finished_rows(store: Path) -> list[tuple]:
    """(config_hash, method, lambda_, aggregates, scores) of every finished run, read without locking writers."""
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=60) as db:
        rows = db.execute("SELECT config_hash, config, aggregates, scores FROM runs WHERE status='finished'")
        found = []
        for config_hash, config, aggregates, scores in rows.fetchall():
            method = json.loads(config)["method"]
            found.append((config_hash, method["name"], method["lambda_"], json.loads(aggregates), json.loads(scores)))
    return found


def count_finished(store: Path) -> int:
    if not store.exists():
        return 0
    try:
        return len(finished_rows(store))
    except sqlite3.OperationalError:  # not created yet
        return 0


def kill_after_progress(cmd: list[str], cwd: Path, store: Path, rng: random.Random, log: Path) -> int:
    """Start the sweep, wait until one more job has finished, then a random 0-4 s (the kill lands anywhere:
    mid-merge, mid-evaluation, mid-write), and SIGKILL its whole process group (launcher and workers).

    The wait ends early once all but the two jobs the workers run have finished, so the kill lands while the
    sweep still has work: with faster merges (fingerprints by BLAKE3) the tiny jobs left after the first
    resume all finished within the random wait, and the kill found nothing left to interrupt."""
    before = count_finished(store)
    with log.open("a") as out:
        sweep = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while count_finished(store) <= before and sweep.poll() is None:
            time.sleep(0.2)
        deadline = time.monotonic() + rng.uniform(0, 4)
        while time.monotonic() < deadline and count_finished(store) < len(CONFIGS) - 2 and sweep.poll() is None:
            time.sleep(0.05)
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
        return sweep.wait()


@pytest.fixture(scope="module")
def joblib_sweep(tmp_path_factory, cache, tiny_dir) -> dict:
    """The 12-job sweep with the parallel (joblib) preset, two workers: killed twice, then run to the end."""
    work = tmp_path_factory.mktemp("joblib-sweep")
    store, log = work / "runs.sqlite", work / "killed.log"
    cmd = command("hydra/launcher=parallel", "hydra.launcher.n_jobs=2", f"store.path={store}", *SWEEP)
    rng = random.Random(SEED)
    kills = [(kill_after_progress(cmd, work, store, rng, log), count_finished(store)) for _ in range(KILLS)]
    final = subprocess.run(cmd, cwd=work, env=env(), capture_output=True, text=True, timeout=1800)
    return {"store": store, "kills": kills, "final": final, "work": work}


@pytest.fixture(scope="module")
def ray_sweep(tmp_path_factory, cache, tiny_dir) -> dict:
    """Four of the sweep's jobs on a local Ray instance with two CPUs (one job per CPU), into a store of its own."""
    work = tmp_path_factory.mktemp("ray-sweep")
    store = work / "runs.sqlite"
    cmd = command("hydra/launcher=ray", "hydra.launcher.num_cpus=2", f"store.path={store}", *RAY_SWEEP)
    done = subprocess.run(cmd, cwd=work, env=env(), capture_output=True, text=True, timeout=1800)
    return {"store": store, "out": done}


def by_config(rows: list[tuple]) -> dict:
    return {(method, lam): (aggregates, scores) for _, method, lam, aggregates, scores in rows}


def count_running(store: Path) -> int:
    try:
        with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=60) as db:
            return db.execute("SELECT COUNT(*) FROM runs WHERE status='running'").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


@pytest.mark.parametrize("how", ["SIGTERM to the sweep", "Ctrl-C to its process group"])
def test_an_interrupted_parallel_sweep_ends_in_one_line_and_leaves_no_run_running(how, cache, tiny_dir, tmp_path):
    """joblib's launcher kills its workers when the sweep is interrupted, before their jobs can record it: their
    runs stayed ``running`` (until a later command found the processes gone), and the resource tracker then
    warned on stderr about the semaphores the workers held."""
    store = tmp_path / "runs.sqlite"
    cmd = command("hydra/launcher=parallel", "hydra.launcher.n_jobs=2", f"store.path={store}", *SWEEP)
    sweep = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_signals,
    )
    try:
        while count_running(store) == 0 and sweep.poll() is None:  # a worker runs a job
            time.sleep(0.05)
        assert sweep.poll() is None, "the sweep ended before a job ran: " + sweep.stderr.read()[-3000:]
        if how.startswith("SIGTERM"):
            sweep.send_signal(signal.SIGTERM)
        else:
            os.killpg(sweep.pid, signal.SIGINT)
        _, err = sweep.communicate(timeout=600)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip() and "building expert" not in line]  # bars
    assert sweep.returncode == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("mergeval: interrupted by "), err[-3000:]
    assert count_running(store) == 0


def test_a_sweep_killed_and_resumed_finishes_every_configuration_once(joblib_sweep):
    final = joblib_sweep["final"]
    assert final.returncode == 0, final.stderr[-3000:]
    assert all(code == -signal.SIGKILL for code, _ in joblib_sweep["kills"]), joblib_sweep["kills"]
    finished_after_kill = [n for _, n in joblib_sweep["kills"]]
    assert finished_after_kill == sorted(finished_after_kill) and 0 < finished_after_kill[-1] < 12
    rows = finished_rows(joblib_sweep["store"])
    hashes = [r[0] for r in rows]
    assert len(rows) == 12 and len(set(hashes)) == 12 and None not in hashes
    assert {(method, lam) for _, method, lam, _, _ in rows} == CONFIGS
    from mergeval.results.store import Store

    Store(joblib_sweep["store"])  # opens only after its health check (quick_check and a rolled-back write)
    with sqlite3.connect(joblib_sweep["store"]) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        statuses = dict(db.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall())
    assert "running" not in statuses  # the killed jobs' rows were found dead: interrupted
    # the last run skipped what had finished, ran the rest, and said so
    skipped = final.stdout.count("mergeval: skipped: this configuration finished before")
    assert skipped == finished_after_kill[-1], final.stdout[-3000:]
    assert f"({skipped} finished before)" in final.stdout and "mergeval: sweep 12/12 done" in final.stdout
    results = list((joblib_sweep["work"] / "multirun").rglob("result.json"))
    last = max({r.parent.parent for r in results}, key=lambda d: d.stat().st_mtime)
    assert len(list(last.rglob("result.json"))) == 12  # skipped jobs carry their earlier result.json


def test_the_config_hash_is_the_one_the_job_recorded(joblib_sweep):
    """The sweep's process hashes each job's config as the job does (progress reads the store by it), and what
    does not change a result (where it is stored, the cache, the sweep's own settings) leaves it as it is."""
    from mergeval.run.resume import config_hash

    register_configs()
    recorded = {(method, lam): h for h, method, lam, _, _ in finished_rows(joblib_sweep["store"])}
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        base = ["+experiment=tiny", "benchmark.limit=8", "method=ties", "method.lambda_=1.5"]
        cfg = compose("config", overrides=[*base, f"store.path={joblib_sweep['store']}"])
        assert config_hash(cfg) == recorded[("ties", 1.5)]
        same = compose(
            "config",
            overrides=[
                *base,
                "store.path=/elsewhere.sqlite",
                "cache_dir=/tmp/c",
                "sweep.resume=false",
                "verbose=true",
                "eval.force=true",
            ],
        )
        assert config_hash(same) == config_hash(cfg)
        for change in ("method.lambda_=1.4", "seed=1", "eval.dtype=bfloat16", "benchmark.limit=9", "save_merged=true"):
            other = compose("config", overrides=[*base, change])
            assert config_hash(other) != config_hash(cfg), change


def test_ray_and_joblib_give_the_same_scores(joblib_sweep, ray_sweep):
    out = ray_sweep["out"]
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    ray_rows = finished_rows(ray_sweep["store"])
    assert len(ray_rows) == 4 and {(m, lam) for _, m, lam, _, _ in ray_rows} == RAY_CONFIGS
    joblib_rows = [r for r in finished_rows(joblib_sweep["store"]) if (r[1], r[2]) in RAY_CONFIGS]
    assert by_config(ray_rows) == by_config(joblib_rows)
    # the hashes agree too: the same configurations
    assert {r[0] for r in ray_rows} == {r[0] for r in joblib_rows}
    # The sweep's process read the store the Ray jobs wrote: its last line counts all four. Lines between the
    # first and the last depend on when jobs end against the poll (on CI's 2 cores the last three jobs once ended
    # within one poll, so none was printed); each one printed says how long is left
    # (test_the_watching_thread_prints_the_time_left_while_jobs_run holds the thread to that without a race).
    lines = [line for line in out.stdout.splitlines() if line.startswith("mergeval: sweep ")]
    assert lines[0] == "mergeval: sweep 0/4 done" and lines[-1].startswith("mergeval: sweep 4/4 done"), lines
    assert all(" left" in line for line in lines[1:-1]), lines


def test_progress_counts_best_and_time_left(tmp_path):
    """The progress line from a store's finished runs: done / total, those finished before, the best on the
    chosen aggregate with its job's label, and the time left at the sweep's own rate."""
    from mergeval.run.progress import SweepJob, SweepProgress

    now = 1000.0
    runs = {
        "a": {"finished": now - 50, "aggregates": {"macro_gain": 3.0}},  # before the sweep
        "b": {"finished": now + 20, "aggregates": {"macro_gain": 7.5, "forgetting": {"mean": 0.1}}},
        "c": {"finished": now + 40, "aggregates": {"macro_gain": -2.0, "forgetting": {"mean": -0.3}}},
    }

    class Store:
        def finished_run(self, config_hash):
            return runs.get(config_hash)

    jobs = [SweepJob(f"method.lambda_={h}", h) for h in "abcdef"]
    progress = SweepProgress(jobs, Store(), poll_s=60)
    progress.started = now
    tally = progress.tally()
    assert (tally.done, tally.before) == (3, 1)
    # 2 jobs ran in 40 s, 3 are left: 60 s
    assert progress.line(tally, now=now + 40) == (
        "mergeval: sweep 3/6 done (1 finished before) · best macro_gain +7.50 (method.lambda_=b) · about 1m00s left"
    )
    least = SweepProgress(jobs, Store(), best="forgetting.mean", minimize=True)
    least.started = now
    assert least.tally().best == (-0.3, "method.lambda_=c")
    rerun = SweepProgress(jobs, Store(), resumed=False)  # sweep.resume=false: what finished before is not done
    rerun.started = now
    assert (rerun.tally().done, rerun.tally().before) == (2, 0)


def test_the_watching_thread_prints_the_time_left_while_jobs_run():
    """While a sweep runs, the thread prints a line as soon as another job has finished, with the time left at
    the sweep's rate; stopping prints the last line once."""
    import io

    from mergeval.run.progress import SweepJob, SweepProgress

    finished: dict = {}

    class Store:
        def finished_run(self, config_hash):
            return finished.get(config_hash)

    out = io.StringIO()
    progress = SweepProgress([SweepJob(h, h) for h in "abc"], Store(), poll_s=0.01, out=out).start()
    finished["a"] = {"finished": progress.started + 0.001, "aggregates": {"macro_gain": 2.0}}
    for _ in range(3000):  # the thread's next poll sees it (at most 30 s on a loaded machine)
        if "1/3" in out.getvalue():
            break
        time.sleep(0.01)
    with progress._lock:  # the thread tallies under this lock: it sees both jobs finished or neither
        finished.update(b=finished["a"], c=finished["a"])
    progress.stop(final=True)
    lines = out.getvalue().splitlines()
    assert lines[0] == "mergeval: sweep 0/3 done", lines
    assert lines[1].startswith("mergeval: sweep 1/3 done · best macro_gain +2.00 (a) · about ") and lines[1].endswith(
        " left"
    ), lines
    assert len(lines) == 3 and lines[2].startswith("mergeval: sweep 3/3 done · best macro_gain +2.00 (a) · took "), (
        lines
    )


def test_the_final_line_is_written_even_when_the_watching_thread_failed_to_write():
    """The watching thread stops at its first failure (progress must never take a sweep down); a line whose
    write failed does not count as printed, so the sweep's end still says where it ended."""
    import io

    from mergeval.run.progress import SweepJob, SweepProgress

    finished: dict = {}

    class Store:
        def finished_run(self, config_hash):
            return finished.get(config_hash)

    class FailsOnce(io.StringIO):
        failed = False

        def write(self, text):
            if not self.failed and "1/2" in text:
                self.failed = True
                raise BlockingIOError(11, "write could not complete without blocking", 0)
            return super().write(text)

    out = FailsOnce()
    progress = SweepProgress([SweepJob("a", "a"), SweepJob("b", "b")], Store(), poll_s=0.01, out=out).start()
    finished["a"] = {"finished": progress.started + 1, "aggregates": {"macro_gain": 1.0}}
    progress._thread.join(timeout=30)  # it fails at "1/2" and stops
    assert out.failed and not progress._thread.is_alive()
    progress.stop(final=True)
    assert out.getvalue().splitlines()[0] == "mergeval: sweep 0/2 done"
    assert out.getvalue().splitlines()[-1].startswith("mergeval: sweep 1/2 done · best macro_gain +1.00 (a)")


def test_the_jobs_of_an_experiment_that_sets_multirun_are_found_without_dash_m():
    """An experiment with hydra.mode=MULTIRUN sweeps its hydra.sweeper.params: the check and the progress
    expand them as Hydra's basic sweeper does (the config's params, then the command line's, a key on both
    taking the command line's values), with or without -m."""
    from mergeval.run.sweep_check import sweep_jobs

    register_configs()
    methods = ["cmm", "cmm_chem/reverse", "cmm_chem/constant", "cmm_chem/task_arithmetic"]
    jobs = sweep_jobs(["+experiment=cmm_mini", "benchmark.n_items=20"])
    assert jobs == [[f"method={m}", "+experiment=cmm_mini", "benchmark.n_items=20"] for m in methods]
    assert sweep_jobs(["-m", "+experiment=cmm_mini", "benchmark.n_items=20"]) == jobs
    assert sweep_jobs(["+experiment=cmm_mini", "method=cmm,cmm_chem/reverse"]) == [
        ["method=cmm", "+experiment=cmm_mini"],
        ["method=cmm_chem/reverse", "+experiment=cmm_mini"],
    ]
    cpt = sweep_jobs(["+experiment=cpt_finance_mini", "method.lambda_=0.5,1.5", "hydra.sweep.dir=/x"])
    assert len(cpt) == 4 * 2 * 2 and cpt[0][-1] == "+experiment=cpt_finance_mini"
    assert sweep_jobs(["+experiment=quickstart"]) is None  # a plain run
    assert sweep_jobs(["+experiment=quickstart", "hydra.mode=MULTIRUN", "seed=0,1"]) == [
        ["+experiment=quickstart", "seed=0"],
        ["+experiment=quickstart", "seed=1"],
    ]
    assert sweep_jobs(["method=ties", "seed=0,1"]) is None  # no -m: Hydra runs one job (and rejects the sweep)


def test_a_config_dir_experiments_jobs_are_found_as_hydra_composes_them(tmp_path):
    """``--config-dir DIR`` (any of its spellings) adds DIR to the search path, as Hydra does: the sweep of an
    experiment kept there is expanded; a DIR that is no directory is left to Hydra's own message."""
    from mergeval.run.sweep_check import split_config_dir, sweep_jobs

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      seed: 1,2\n"
    )
    search = f"hydra.searchpath=['file://{tmp_path}']"
    assert split_config_dir(["-cd", str(tmp_path), "seed=3"]) == (["seed=3"], [search])
    assert split_config_dir([f"--config-dir={tmp_path}"]) == ([], [search])
    assert split_config_dir(["--config-dir", str(tmp_path / "none")])[1] is None
    register_configs()
    assert sweep_jobs(["--config-dir", str(tmp_path), "+experiment=mine"]) == [
        [search, "seed=1", "+experiment=mine"],
        [search, "seed=2", "+experiment=mine"],
    ]
    assert sweep_jobs(["--config-dir", str(tmp_path / "none"), "+experiment=mine"]) is None


def test_a_mappings_key_in_the_configs_params_and_on_the_command_line_is_one_key():
    """The config's params are opened as mergeval's sweeper opens them (``++`` for a mapping's key), the command
    line's as mergeval.run.cli opens them: the same key on both is one key, the command line's values winning."""
    from mergeval.run.sweep_check import expand

    params = {"benchmark.fewshot.mergeval_chem_count": "0,1", "method.lambda_": "0.5,1.0"}
    assert expand(["++benchmark.fewshot.mergeval_chem_count=2"], params) == [
        ["++benchmark.fewshot.mergeval_chem_count=2", "method.lambda_=0.5"],
        ["++benchmark.fewshot.mergeval_chem_count=2", "method.lambda_=1.0"],
    ]
    from mergeval.run.config import open_key

    assert [open_key(key) for key in params] == ["++benchmark.fewshot.mergeval_chem_count", "method.lambda_"]


def test_mergevals_commands_sweep_with_mergevals_basic_sweeper_and_other_apps_keep_hydras(tmp_path):
    """hydra/sweeper=basic is mergeval's (Hydra's, with its params opened) once mergeval's schema is registered,
    as every mergeval command does before Hydra scans its plugins; a process that never registers it (another
    Hydra application) keeps Hydra's own. Choosing another sweeper still works."""
    (tmp_path / "config.yaml").write_text("a: 1\n")  # another application's config
    program = """
import sys
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.plugins import Plugins
if sys.argv[1] == "mergeval":
    from mergeval.run.config import register_configs
    register_configs()
Plugins.instance()  # the plugin scan, as hydra.main runs it
app = (initialize_config_module("mergeval.run.conf", version_base="1.3") if sys.argv[1] == "mergeval"
       else initialize_config_dir(sys.argv[2], version_base="1.3"))
with app:
    print(compose("config", return_hydra_config=True).hydra.sweeper._target_)
    print(compose("config", overrides=["hydra/sweeper=staged"], return_hydra_config=True).hydra.sweeper._target_)
"""
    ours, other = (
        subprocess.run(
            [sys.executable, "-c", program, who, str(tmp_path)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for who in ("mergeval", "other")
    )
    assert ours[0] == "hydra_plugins.mergeval_basic_sweeper.basic_sweeper.MergevalBasicSweeper", ours
    assert other[0] == "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", other
    assert ours[1] == other[1] == "hydra_plugins.mergeval_staged_sweeper.staged_sweeper.StagedSweeper"


def test_a_commands_own_sections_are_opened_in_its_sweeps():
    from omegaconf import OmegaConf

    from mergeval.run.config import RunConfig, open_key, sweep_sections
    from mergeval.search.schema import SearchConfig, SearchRunConfig

    assert sweep_sections(OmegaConf.structured(SearchRunConfig)) == {"search": SearchConfig}
    assert sweep_sections(OmegaConf.structured(RunConfig)) == {}
    assert open_key("eval.gen_kwargs.max_gen_toks=5") == "++eval.gen_kwargs.max_gen_toks=5"
    assert open_key("eval.dtype=float32") == "eval.dtype=float32"


def test_the_slurm_preset_composes_with_its_overrides():
    """hydra/launcher=slurm is Hydra's submitit_slurm launcher with mergeval's defaults; partition, GPUs per
    task, time and array parallelism are overrides."""
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.gpus_per_task=2",
                "hydra.launcher.timeout_min=30",
                "hydra.launcher.array_parallelism=4",
            ],
            return_hydra_config=True,
        )
        launcher = cfg.hydra.launcher
        assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
        assert (launcher.partition, launcher.gpus_per_task, launcher.timeout_min, launcher.array_parallelism) == (
            "gpu",
            2,
            30,
            4,
        )
        ray = compose(
            "config", overrides=["hydra/launcher=ray", "hydra.launcher.gpus_per_job=1"], return_hydra_config=True
        ).hydra.launcher
        assert ray._target_.endswith("mergeval_ray_launcher.ray_launcher.RayLauncher") and ray.gpus_per_job == 1
        parallel = compose("config", overrides=["hydra/launcher=parallel"], return_hydra_config=True)
        assert parallel.hydra.launcher.n_jobs == 2


def test_submitit_local_runs_a_sweep_and_resumes_it(joblib_sweep, tmp_path):
    """Slurm's launcher through submitit's local executor, on a copy of the finished sweep's store: two jobs
    are skipped (found by their hash), a new one runs, the sweep's process prints the progress."""
    store = tmp_path / "runs.sqlite"
    with sqlite3.connect(f"file:{joblib_sweep['store']}?mode=ro", uri=True) as source, sqlite3.connect(store) as copy:
        source.backup(copy)
    out = subprocess.run(
        command(
            "hydra/launcher=submitit_local",
            f"store.path={store}",
            "+experiment=tiny",
            "benchmark.limit=8",
            "method=ties",
            "method.lambda_=1.0,2.0,3.0",
        ),
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert "mergeval: sweep 2/3 done (2 finished before)" in out.stdout
    assert "mergeval: sweep 3/3 done (2 finished before)" in out.stdout
    rows = finished_rows(store)
    assert len(rows) == 13 and ("ties", 3.0) in {(m, lam) for _, m, lam, _, _ in rows}
    logs = "".join(p.read_text() for p in tmp_path.rglob("*_log.out"))
    assert logs.count("mergeval: skipped: this configuration finished before") == 2, logs[-2000:]


def test_a_configuration_a_live_process_here_runs_is_not_run_again(tmp_path):
    """A worker of a sweep whose launching process was killed alone goes on with its job: while that process
    lives, a resumed sweep leaves its configuration to it; once it is gone, the configuration runs again."""
    from mergeval.core import proc
    from mergeval.results.store import Store
    from mergeval.run.resume import running_here

    store = Store(tmp_path / "runs.sqlite")
    store.start_run(
        "r1", experiment="tiny", method="ties", config={}, versions={}, git={}, job_dir="j", config_hash="h1"
    )
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with sqlite3.connect(store.path) as db:  # the run belongs to that process
            db.execute(
                "UPDATE runs SET pid=?, pid_start=? WHERE run_id='r1'", (worker.pid, proc.start_time(worker.pid))
            )
        assert running_here(store, "h1")["run_id"] == "r1" and running_here(store, "h2") is None
        worker.kill()  # not reaped yet: a zombie, as a killed sweep's workers can stay for a while
        for _ in range(6000):
            if proc.state(worker.pid) == "Z":
                break
            time.sleep(0.01)
        assert running_here(store, "h1") is None  # a zombie runs nothing: its configuration may run again
    finally:
        worker.kill()
        worker.wait()
    assert running_here(store, "h1") is None


def test_a_ray_job_that_exits_ends_the_sweep_with_its_code():
    """The Ray launcher carries a job's sys.exit code back (mergeval's one-line errors exit 2) instead of
    letting Ray report a crashed worker: the sweep ends with the first non-zero code once every job ended;
    a job that exited 0 counts as completed."""
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.mergeval_ray_launcher.ray_launcher import _Exited, _job_exit_code, _returns

    done = JobReturn(overrides=["method=ties"], status=JobStatus.COMPLETED)
    with pytest.raises(SystemExit) as ended:
        _returns([done, _Exited(2), _Exited(3)], [["a"], ["b"], ["c"]])
    assert ended.value.code == 2
    returns = _returns([done, _Exited(0)], [["method=ties"], ["method=linear"]])
    assert returns[0] is done and returns[1].status == JobStatus.COMPLETED and returns[1].overrides == ["method=linear"]
    assert [_job_exit_code(SystemExit(c)) for c in (None, 0, 2, "message")] == [0, 0, 2, 1]


def test_a_slurm_job_that_failed_with_one_line_is_that_line():
    """submitit reports a job that exited without a result with its stderr; mergeval's one line in it is what
    the sweep prints (exit 2), not submitit's traceback."""
    from submitit.core.utils import UncompletedJobError

    from mergeval.run.cli import explain

    report = UncompletedJobError(
        "Job 12 (task: 0) with path /x/.submitit/12/12_0_result.pkl\nhas not produced "
        "any output (state: FINISHED)\nError stream produced:\n-----\n[HYDRA] Launching\n"
        "mergeval: error: modelset.base: no such model directory '/m'; point it at one\n"
    )
    assert explain(report) == "modelset.base: no such model directory '/m'; point it at one"
    assert explain(UncompletedJobError("Job 12 has not produced any output (state: TIMEOUT)")) is None
