"""The layers' import rules (pyproject.toml's [tool.importlinter] contracts), checked by import-linter over the
code as it is, imports inside functions included: no import cycle between modules or packages at any depth;
metrics and merge methods stay pure functions of scores and tensors; nothing below the orchestrators imports
them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's command on the ``mergeval`` package found under ``root``, with the project's contracts."""
    command = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(command), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


def test_the_layers_hold():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in out.stdout


def planted(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package whose ``module`` (a path under mergeval/) imports as ``line`` says, inside a function."""
    shutil.copytree(
        ROOT / "mergeval",
        tmp_path / "mergeval",
        symlinks=True,
        ignore=shutil.ignore_patterns("__pycache__", "conf", "library"),
    )
    target = tmp_path / "mergeval" / module
    target.write_text(target.read_text() + f"\n\ndef _planted():\n    {line}\n")
    return tmp_path


def test_a_cycle_through_a_lazy_import_is_caught(tmp_path):
    # the store opens its backends; a backend importing the store back closes a circle
    out = lint_imports(planted(tmp_path, "results/backends/sqlite.py", "from mergeval.results.store import Store"))
    assert out.returncode != 0 and "no import cycles" in out.stdout and "BROKEN" in out.stdout, out.stdout[-3000:]


def test_a_method_reaching_evaluation_is_caught(tmp_path):
    out = lint_imports(planted(tmp_path, "methods/geometric.py", "from mergeval.eval import harness"))
    assert out.returncode != 0 and "are pure" in out.stdout and "BROKEN" in out.stdout, out.stdout[-3000:]


def test_what_a_method_needs_is_declared_where_it_is_registered():
    """The run, merge-only, staged and search paths read ``MergeMethod.needs``; no module outside the methods
    tests a method's name to decide what to prepare (mergekit's configuration mapping, run/mergekit_config.py, names
    mergekit's own methods)."""
    import re

    from mergeval.merge.expert_statistics import KINDS
    from mergeval.methods import METHODS

    assert {n: m.needs.statistics for n, m in METHODS.items() if m.needs.statistics} == {
        "fisher": "fisher",
        "regmean": "gram",
        "localize_stitch_trained": "localize",
    }
    assert all(m.needs.statistics in (None, *KINDS) for m in METHODS.values())
    prepared_from_models = {
        n for n, m in METHODS.items() if m.needs.head_counts or m.needs.ranking or m.needs.expert_names
    }
    assert prepared_from_models == {"cmm", "hierarchical", "pipeline"}
    names = "|".join(sorted(METHODS, key=len, reverse=True))
    by_name = re.compile(
        rf"""(method\.name|\bname)\s*(==|!=|in)\s*["'({{]?["']?({names})\b|startswith\(["']({names})"""
    )
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "mergeval").rglob("*.py"))
        if "methods" not in p.parts and p.name != "mergekit_config.py"
        for i, line in enumerate(p.read_text().splitlines(), start=1)
        if by_name.search(line)
    ]
    assert not found, found
