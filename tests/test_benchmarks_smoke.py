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
