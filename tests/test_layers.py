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


# Comparisons with a method's name that are about something else: (the expression, what it is about)
NOT_A_METHOD = {"kind == 'fisher'": "a calibration statistic's kind (expert_statistics.KINDS)"}


def method_name_tests(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, expression) of each place in ``source`` that tests a method's name: a comparison (==, !=, in,
    not in) with a registered method's name as a string literal or among a literal tuple, list, set or dict,
    a ``match`` case on one, a ``startswith``/``endswith`` with one, and any literal collection holding two or
    more method names (a hand-kept list of methods)."""
    import ast

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names

    def members(node) -> list:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return list(node.elts)
        return [k for k in node.keys if k is not None] if isinstance(node, ast.Dict) else []

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            hit = any(named(o) or any(named(e) for e in members(o)) for o in (node.left, *node.comparators))
        elif isinstance(node, ast.MatchValue):
            hit = named(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = node.func.attr in ("startswith", "endswith") and any(named(a) for a in node.args)
        else:
            hit = sum(named(e) for e in members(node)) >= 2
        if hit and ast.unparse(node) not in NOT_A_METHOD:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_method_name_tests_are_found():
    names = {"cmm", "ties", "linear", "fisher"}
    planted = (
        "if method.name == 'cmm': pass\n"
        "x = name in ('ties', 'other')\n"
        "ok = kind == 'fisher'\n"
        "if name != 'nope': pass\n"
        "OWN = ['linear', 'ties']\n"
        "match m:\n    case 'linear': pass\n"
        "s.startswith('cmm')\n"
    )
    assert [line for line, _ in method_name_tests(planted, names)] == [1, 2, 5, 7, 8]


def test_what_a_method_needs_is_declared_where_it_is_registered():
    """The run, merge-only, staged, search and mergekit paths read what a method declared at registration
    (``MergeMethod.needs``, ``.mergekit``, ``.details``); no module outside the methods tests a method's name."""
    from mergeval.merge.expert_statistics import KINDS
    from mergeval.methods import METHODS

    assert {n: m.needs.statistics for n, m in METHODS.items() if m.needs.statistics} == {
        "fisher": "fisher",
        "regmean": "gram",
        "localize_stitch_trained": "localize",
    }
    assert all(m.needs.statistics in (None, *KINDS) for m in METHODS.values())
    prepared_from_models = {
        n for n, m in METHODS.items() if m.needs.head_counts or m.needs.ranking is not None or m.needs.expert_names
    }
    assert prepared_from_models == {"cmm", "hierarchical", "pipeline"}
    found = [
        f"{p.relative_to(ROOT)}:{line}: {text}"
        for p in sorted((ROOT / "mergeval").rglob("*.py"))
        if "methods" not in p.relative_to(ROOT).parts
        for line, text in method_name_tests(p.read_text(), set(METHODS))
    ]
    assert not found, found
