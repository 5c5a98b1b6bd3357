"""ruff's lint rules (pyproject.toml [tool.ruff.lint]) hold on the whole code base, and its formatter has nothing
to change: a finding fails the suite with ruff's own report (`ruff format` applies the formatting). The type
checker (mypy) runs in tests/test_types.py, a slow module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run(
        [str(ruff), "check", "--no-cache", "mergeval", "tests", "benchmarks", "docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_code_is_formatted_as_ruff_formats_it():
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run(
        [str(ruff), "format", "--check", "--no-cache", "mergeval", "tests", "benchmarks", "docs", "hydra_plugins"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_reports_a_planted_finding(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n")  # an unused import (F401)
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run(
        [str(ruff), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(planted)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 1 and "F401" in out.stdout, out.stdout + out.stderr
