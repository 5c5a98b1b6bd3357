"""The layers' import rules (the design notes' "rules worth keeping as the code grows"), read from the source.

Metrics and merge methods are pure functions of score tables and tensors: they import neither evaluation
(lm-eval's world), the results store, nor the orchestrators. Nothing below the orchestrators imports them:
steps that several entry points share live in the module of their layer. A command's own ``__main__`` (e.g.
``python -m mergeval.report``) is an entry point, not a layer, and may reuse another command's helpers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mergeval"
# the run's orchestrators and command lines: they sequence the layers' steps
ORCHESTRATORS = ("mergeval.app", "mergeval.__main__", "mergeval.cli", "mergeval.staged", "mergeval.staging",
                 "mergeval.search", "mergeval.merge", "mergeval.ranking", "mergeval.verify", "mergeval.check")
LOWER = ("mergeval.metrics", "mergeval.methods", "mergeval.engine", "mergeval.models", "mergeval.eval",
         "mergeval.store", "mergeval.store_backends", "mergeval.zoo", "mergeval.report", "mergeval.specs")
PURE = ("mergeval.metrics", "mergeval.methods")
NOT_FOR_PURE = ("mergeval.eval", "mergeval.store", "mergeval.store_backends", "mergeval.checks") + ORCHESTRATORS


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every mergeval module ``path`` imports, at the top or inside a function (a lazy import is still a
    dependency); ``from mergeval import proc`` counts as ``mergeval.proc``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mergeval")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mergeval"):
            found |= {f"{node.module}.{a.name}" if node.module == "mergeval" else node.module for a in node.names}
    return found


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


MODULES = {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def test_the_rules_see_the_code():
    assert len(MODULES) > 100 and "mergeval.metrics.composed" in MODULES
    assert "mergeval.proc" in MODULES["mergeval.store"]  # `from mergeval import proc` is read as the module


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, PURE)))
def test_metrics_and_methods_import_neither_evaluation_the_store_nor_the_orchestrators(module):
    assert not [i for i in MODULES[module] if within(i, NOT_FOR_PURE)], module


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, LOWER) and not m.endswith(".__main__")))
def test_nothing_below_the_orchestrators_imports_them(module):
    assert not [i for i in MODULES[module] if within(i, ORCHESTRATORS)], module
