"""mypy (pyproject.toml [tool.mypy]: the package and the Hydra plugins) finds nothing: a finding fails the suite
with mypy's own report. A slow module (tests/conftest.py SLOW_MODULES): about a minute of one core on a fresh
checkout, a second or two once its cache (.mypy_cache, beside pyproject.toml) holds the unchanged modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MYPY = Path(sys.executable).parent / "mypy"


def test_mypy_finds_nothing():
    out = subprocess.run([str(MYPY)], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]


def test_mypy_reports_a_planted_finding(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def half(n: int) -> int:\n    return n / 2\n")  # a float returned as an int
    out = subprocess.run(
        [str(MYPY), "--config-file", str(ROOT / "pyproject.toml"), str(planted)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 1 and "[return-value]" in out.stdout, out.stdout + out.stderr
