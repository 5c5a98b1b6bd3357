"""One job per GPU on one node, on a machine without a GPU: the assignment with a simulated device list.

``MERGEVAL_SIMULATED_GPUS=N`` (mergeval/core/gpus.py) makes the processes count N CUDA devices; tensors stay on
the CPU. What these tests prove: which device each job claims (its own while there are enough, the least-used
one otherwise, a released or dead job's device free again, a live one's avoided, across real processes), that
``eval.device`` and result.json record it, that the ``parallel`` preset starts one job per GPU, that jobs on
different GPUs share the store's evaluations (each constituent evaluated once) and configuration hashes, and
that the Ray preset passes ``gpus_per_job`` to Ray, which places the jobs. What only a node with several real
GPUs proves: that torch then puts each job's tensors on its GPU (``gpus.select``) and that nothing in lm-eval or
transformers falls back to device 0 (tests/test_gpu.py holds the single-GPU run).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mergeval.core import gpus
from mergeval.core.errors import UserError
from mergeval.run import devices
from tests.child import run_module


@pytest.fixture
def claims(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "claims"
    monkeypatch.setenv(gpus.CLAIMS_ENV, str(where))
    monkeypatch.setenv(gpus.SIMULATED_ENV, "4")
    return where


def test_jobs_get_a_device_each_their_own_first_whatever_their_order(claims):
    held = [gpus.claim(4, preferred=job) for job in (2, 0, 3, 1)]
    assert [c.index for c in held] == [2, 0, 3, 1] and all(c.shared_with == 0 for c in held)
    for c in held:
        c.release()


def test_a_job_whose_own_device_is_taken_gets_a_free_one(claims):
    """Jobs of unequal length: job 1 ended, so job 4 (whose own device, 0, is busy) takes device 1."""
    held = {job: gpus.claim(4, preferred=job) for job in range(4)}
    held.pop(1).release()
    late = gpus.claim(4, preferred=4)
    assert late.index == 1 and late.shared_with == 0
    with gpus.claim(4, preferred=5) as sixth:  # every device busy: shared, its own (5 % 4) among the least used
        assert (sixth.index, sixth.shared_with) == (1, 1)
    for c in [*held.values(), late]:
        c.release()


def test_more_jobs_than_devices_share_them_evenly(claims):
    held = [gpus.claim(4, preferred=0) for _ in range(10)]
    per_device = [sum(c.index == i for c in held) for i in range(4)]
    assert per_device == [3, 3, 2, 2]  # at most ceil(10 / 4) on any device
    for c in held:
        c.release()
    with gpus.claim(4, preferred=3) as again:  # all released: its own device again, alone
        assert (again.index, again.shared_with) == (3, 0)


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mergeval.core import gpus
    held = gpus.claim(2, preferred=int(sys.argv[2]), directory=Path(sys.argv[1]), holder={"job": 7})
    print(held.index, flush=True)
    time.sleep(600)
""")


def test_a_live_process_keeps_its_device_and_a_killed_ones_is_free_at_once(claims):
    """The claim is the kernel's lock on a file: another process's is respected while it lives, and gone the
    moment it is killed (SIGKILL: no handler of ours runs), with its lock file and note left behind."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(claims), "1"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "1"
        with gpus.claim(2, preferred=1, directory=claims) as mine:
            assert (mine.index, mine.shared_with) == (0, 0)  # device 1 is the live process's
        note = json.loads((claims / "cuda-sim1.0.lock").read_text())
        assert note["pid"] == holder.pid and note["job"] == 7
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with gpus.claim(2, preferred=1, directory=claims) as after:
        assert (after.index, after.shared_with) == (1, 0)


def test_the_visible_devices_and_their_names(monkeypatch):
    monkeypatch.delenv(gpus.SIMULATED_ENV, raising=False)
    assert gpus.count() == 0  # this machine: no CUDA
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-5f1e/x")
    assert gpus.names(2) == ["2", "GPU-5f1e_x"]  # the same GPU has the same lock file in every process
    monkeypatch.setenv(gpus.SIMULATED_ENV, "3")
    assert gpus.count() == 3 and gpus.names(3) == ["sim0", "sim1", "sim2"]
    assert gpus.compute_device("cuda:2") == "cpu" and gpus.select("cuda:2") == "cpu"
    assert gpus.compute_device("cpu") == "cpu" and gpus.kind("cuda:2") == "cuda"
    monkeypatch.setenv(gpus.SIMULATED_ENV, "four")
    with pytest.raises(UserError, match=r"^MERGEVAL_SIMULATED_GPUS: 'four' is not a number of GPUs; set it to"):
        gpus.count()


def test_a_parallel_job_on_several_gpus_gets_one_and_gives_it_back(claims, monkeypatch):
    monkeypatch.setattr(devices, "parallel_job", lambda: 2)
    cfg = OmegaConf.create({"eval": {"device": "cuda"}})
    with devices.job_device(cfg) as device:
        assert device == cfg.eval.device == "cuda:2"
    with gpus.claim(4, preferred=2) as after:
        assert after.shared_with == 0  # released
    cfg = OmegaConf.create({"eval": {"device": "cuda"}})
    with pytest.raises(RuntimeError), devices.job_device(cfg):  # a job that fails gives its device back too
        raise RuntimeError("the job failed")
    with gpus.claim(4, preferred=2) as after:
        assert after.shared_with == 0


def test_a_job_on_cuda_2_reads_the_memory_peak_of_cuda_2(monkeypatch):
    import torch

    from mergeval.core.runtime import peak_device_memory, reset_device_memory_peak

    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *device: asked.append(("reset", *device)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: f"GPU {device}")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *device: asked.append(("peak", *device)) or 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *device: 2**21)
    reset_device_memory_peak("cuda:2")
    assert peak_device_memory("cuda:2") == {"device": "GPU ('cuda:2',)", "allocated_mib": 1.0, "reserved_mib": 2.0}
    reset_device_memory_peak("cuda")  # no index: torch's current device, as before
    assert asked == [("reset", "cuda:2"), ("peak", "cuda:2"), ("reset",)]


@pytest.mark.parametrize(
    ("device", "simulated", "job"),
    [
        ("cpu", "4", 0),  # the CPU asked for
        ("cuda:1", "4", 0),  # a device named
        ("cuda", "1", 0),  # one GPU: as before
        ("cuda", "4", None),  # not a parallel sweep's job (a single run, Ray, Slurm)
    ],
)
def test_everything_else_is_left_as_it_was(device, simulated, job, claims, monkeypatch):
    monkeypatch.setenv(gpus.SIMULATED_ENV, simulated)
    monkeypatch.setattr(devices, "parallel_job", lambda: job)
    cfg = OmegaConf.create({"eval": {"device": device}})
    with devices.job_device(cfg) as claimed:
        assert claimed is None and cfg.eval.device == device


def test_which_gpu_ran_is_not_part_of_the_store_key_nor_the_config_hash(monkeypatch):
    from hydra import compose, initialize_config_module

    from mergeval.eval.settings import eval_settings
    from mergeval.run.config import register_configs
    from mergeval.run.resume import config_hash

    monkeypatch.setenv(gpus.SIMULATED_ENV, "4")
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        on = {d: compose("config", overrides=["+experiment=tiny", f"eval.device={d}"]) for d in ("cuda:0", "cuda:3")}
        cpu = compose("config", overrides=["+experiment=tiny", "eval.device=cpu"])
    assert (
        eval_settings(on["cuda:0"]) == eval_settings(on["cuda:3"]) and eval_settings(on["cuda:3"])["device"] == "cuda"
    )
    assert config_hash(on["cuda:0"]) == config_hash(on["cuda:3"]) != config_hash(cpu)


@pytest.mark.parametrize(("simulated", "n_jobs", "gpus_per_job"), [(None, 2, 0), ("1", 2, 0), ("4", 4, 1)])
def test_the_presets_run_one_job_per_gpu_where_there_are_several(simulated, n_jobs, gpus_per_job, monkeypatch):
    from hydra import compose, initialize_config_module

    from mergeval.run.config import register_configs

    if simulated is None:
        monkeypatch.delenv(gpus.SIMULATED_ENV, raising=False)
    else:
        monkeypatch.setenv(gpus.SIMULATED_ENV, simulated)
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        parallel = compose("config", overrides=["hydra/launcher=parallel"], return_hydra_config=True)
        ray = compose("config", overrides=["hydra/launcher=ray"], return_hydra_config=True)
        given = compose(
            "config", overrides=["hydra/launcher=parallel", "hydra.launcher.n_jobs=3"], return_hydra_config=True
        )
    assert parallel.hydra.launcher.n_jobs == n_jobs and ray.hydra.launcher.gpus_per_job == gpus_per_job
    assert given.hydra.launcher.n_jobs == 3


def test_gpus_per_job_that_ray_cannot_place_is_one_line(caplog):
    from hydra_plugins.mergeval_ray_launcher.ray_launcher import check_gpus_per_job

    check_gpus_per_job(1, 4)
    check_gpus_per_job(1, None)  # not known before Ray starts: checked again after
    with pytest.raises(
        UserError,
        match=r"^hydra.launcher.gpus_per_job: 2 GPUs per job, but the local Ray instance "
        r"has 1; set hydra.launcher.gpus_per_job to at most 1 \(0: CPU only\)",
    ):
        check_gpus_per_job(2, 1)
    with pytest.raises(UserError, match=r"^hydra.launcher.gpus_per_job: must be 0 or more, got -1"):
        check_gpus_per_job(-1, None)
    check_gpus_per_job(2, 1, cluster=True)  # an autoscaler may add such a node: a warning
    assert "no node of the cluster has more than 1 GPUs now" in caplog.text


def sweep_env(tmp_path: Path, simulated: str) -> dict:
    return dict(
        os.environ, HF_HUB_OFFLINE="1", **{gpus.SIMULATED_ENV: simulated, gpus.CLAIMS_ENV: str(tmp_path / "claims")}
    )


def test_a_ray_sweep_asking_more_gpus_than_the_machine_has_ends_in_one_line(tmp_path):
    out = run_module(
        "mergeval",
        "-m",
        "hydra/launcher=ray",
        "hydra.launcher.num_gpus=1",
        "hydra.launcher.gpus_per_job=2",
        "+experiment=tiny",
        "method.lambda_=0.5,1.0",
        f"store.path={tmp_path / 'runs.sqlite'}",
        cwd=tmp_path,
        env=sweep_env(tmp_path, "1"),
        timeout=600,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "mergeval: error: hydra.launcher.gpus_per_job: 2 GPUs per job, but the local Ray instance has 1; set "
        "hydra.launcher.gpus_per_job to at most 1 (0: CPU only), or run on a machine with more GPUs "
        "(hydra.launcher.num_gpus, CUDA_VISIBLE_DEVICES)"
    ]


def results(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("result.json"))]


@pytest.mark.slow
def test_a_parallel_sweep_on_a_simulated_4_gpu_node_runs_one_job_per_device(tmp_path, cache, tiny_dir):
    """The issue's check: ``hydra/launcher=parallel`` and nothing else about GPUs on a node with 4 (simulated):
    4 jobs at once (n_jobs from the GPU count), each on a device of its own, recorded in its result.json; the
    constituents the jobs share evaluated once, under a store key that names no particular GPU."""
    store = tmp_path / "runs.sqlite"
    out = run_module(
        "mergeval",
        "-m",
        "hydra/launcher=parallel",
        "+experiment=tiny",
        "benchmark.limit=8",
        "method.lambda_=0.5,0.75,1.0,1.25",
        f"store.path={store}",
        cwd=tmp_path,
        env=sweep_env(tmp_path, "4"),
        timeout=1200,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "Joblib.Parallel(n_jobs=4," in out.stdout + out.stderr
    runs = results(tmp_path / "multirun")
    assert len(runs) == 4
    assert sorted(r["config"]["eval"]["device"] for r in runs) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(r["hardware"]["simulated_gpus"] == 4 and r["device_memory"] is None for r in runs)
    for job in range(4):
        assert f"mergeval: job {job} evaluates on cuda:{job} of 4 (simulated: computing on the CPU)" in out.stdout
    for role in ("base", "chem", "units"):  # each constituent evaluated by one job, reused by the three others
        evaluated = [m["evaluated"] for r in runs for m in r["models"] if m["role"] == role]
        assert evaluated.count("this run") == 1 and len(evaluated) == 4, (role, evaluated)
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        devices_keyed = {json.loads(s)["device"] for (s,) in db.execute("SELECT settings FROM evaluations")}
        hashes = {h for (h,) in db.execute("SELECT config_hash FROM runs WHERE status='finished'")}
    assert devices_keyed == {"cuda"} and len(hashes) == 4


@pytest.mark.slow
def test_a_ray_sweep_places_each_job_on_a_gpu_of_its_own(tmp_path, cache, tiny_dir):
    """The Ray preset on a (simulated) 2-GPU machine: gpus_per_job defaults to 1, the local instance has the 2
    GPUs, and Ray gives each job one of them (CUDA_VISIBLE_DEVICES, recorded in result.json's hardware); inside
    its task a job evaluates on what Ray made visible (eval.device=cuda), without claims. That two jobs running
    at once get different GPUs is Ray's guarantee for num_gpus=1, not asserted here: whether the second job
    starts before the first ends is Ray's scheduling."""
    pytest.importorskip("ray")
    out = run_module(
        "mergeval",
        "-m",
        "hydra/launcher=ray",
        "hydra.launcher.num_cpus=2",
        "+experiment=tiny",
        "benchmark.limit=8",
        "method.lambda_=0.5,1.0",
        f"store.path={tmp_path / 'runs.sqlite'}",
        cwd=tmp_path,
        env=sweep_env(tmp_path, "2"),
        timeout=1200,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    runs = results(tmp_path / "multirun")
    assert len(runs) == 2 and all(r["hardware"].get("cuda_visible_devices") in ("0", "1") for r in runs)
    assert {r["config"]["eval"]["device"] for r in runs} == {"cuda"}  # Ray placed them: no claims
    assert not (tmp_path / "claims").exists()
