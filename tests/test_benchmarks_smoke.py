"""The benchmarks issue 13 is checked with still run: each one's smallest case, end to end.

``merge_throughput.py --smoke`` merges tiny synthetic models with mergeval and with ``mergekit-yaml`` and
compares the outputs tensor by tensor; ``run_memory.py`` on a tiny synthetic Llama runs ``python -m
mergeval`` and polls its peak memory. Their figures on models this small say nothing about speed or
memory; what is held here is that the scripts work and report what their readers rely on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_merge_throughput_smoke_gives_mergekits_ties_merge_bit_for_bit(tmp_path):
    out = tmp_path / "throughput.json"
    done = run_script("merge_throughput.py", "--smoke", "--repeats", "1", "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert case["method"] == "ties"
    agreement = case["agreement"]  # the same merge (TIES with mergekit's defaults): the same tensors
    assert agreement["compared"] > 0 and agreement["max_abs_diff"] == 0.0
    assert agreement["only_mergeval"] == [] and agreement["only_mergekit"] == []
    for tool in ("mergeval", "mergekit"):
        assert case["summary"][tool]["median_wall_s"] > 0 and case["summary"][tool]["peak_rss_mib"] > 0
    assert "checks the script" in done.stdout  # a smoke run says its figures are not throughput


def test_merge_throughput_records_a_mergekit_run_killed_for_memory_as_its_result(tmp_path, monkeypatch):
    """At 8B mergekit may not finish within the machine's memory: that run is the result (its exit and the peak
    it reached), not the end of the benchmark; no speed-up is claimed against a run that did not finish."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import merge_throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # 50 MiB held for a second (the poller reads the peak every POLL_S), then killed as the OOM killer would
    die = "import os, signal, time; b = bytearray(50 << 20); time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)"
    killed = [sys.executable, "-c", die]
    monkeypatch.setattr(merge_throughput, "mergekit_command", lambda *args, **kwargs: killed)
    out = tmp_path / "throughput.json"
    merge_throughput.main(["--smoke", "--repeats", "1", "--workdir", str(tmp_path), "--json", str(out)])
    (case,) = json.loads(out.read_text())["cases"]
    (mergekit,) = [run for run in case["runs"] if run["tool"] == "mergekit"]
    assert mergekit["exit"] == -9 and mergekit["peak_rss_mib"] >= 50
    assert case["summary"]["mergekit"]["failed_runs"] == 1 and case["summary"]["mergeval"]["failed_runs"] == 0
    assert case["speedup_mergekit_over_mergeval"] is None and case["agreement"] is None
    assert case["memory_mergeval_over_mergekit"] > 0


def test_run_memory_reports_each_runs_peak_and_no_gpu_memory_on_the_cpu(tmp_path):
    done = run_script(
        "run_memory.py",
        "--layers",
        "2",
        "--hidden",
        "256",
        "--intermediate",
        "512",
        "--experts",
        "2",
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["experts"] for row in rows] == [2]
    (row,) = rows
    assert row["table"] and row["peak_rss_mib"] > 0  # the run printed its table; its peak was polled
    assert row["peak_gpu_allocated_mib"] is None and row["peak_gpu_reserved_mib"] is None


def test_run_memory_one_task_shared_store_evaluates_each_constituent_once(tmp_path):
    """Issue 56's whole run: one task's items, the store shared by the runs. The second run merges and scores
    its own merge and its new expert, and takes the base's and the first expert's scores from the store."""
    keep = tmp_path / "kept"
    shape = ["--layers", "2", "--hidden", "256", "--intermediate", "512"]
    task = ["--task", "mergeval_chem_count", "--limit", "6", "--shared-store", "--method", "ties", "--keep", str(keep)]
    done = run_script("run_memory.py", *shape, "--experts", "1,2", *task, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [json.loads(line)["experts"] for line in done.stdout.splitlines() if line.startswith("{")] == [1, 2]
    first, second = (json.loads((keep / f"this-{n}.json").read_text()) for n in (1, 2))
    for result, models in ((first, {"base", "e0", "merged"}), (second, {"base", "e0", "e1", "merged"})):
        (scores,) = result["scores"].values()  # the one task
        assert set(scores) == models and {s["n"] for s in scores.values()} == {6}
    evaluated = {m["role"]: m["evaluated"] for m in second["models"]}
    assert evaluated == {
        "base": "reused from the results store",
        "e0": "reused from the results store",
        "e1": "this run",
        "merged": "this run",
    }
    assert second["config"]["method"]["name"] == "ties"
