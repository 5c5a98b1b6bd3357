"""benchmarks/mutants.py's planted bugs still match the code they mutate.

Each mutant names an exact snippet of a file; when the code changes under it, the mutation check stops
with an error before planting anything (12 of its 79 snippets had drifted that way unnoticed). This
holds the list to the code on every run of the suite: each snippet occurs exactly once in its file,
differs from its replacement, and the tests it runs exist.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("mutants_list", ROOT / "benchmarks" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.MUTANTS


MUTANTS = _mutants()


def test_mutant_names_are_distinct():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_still_matches_the_code_it_mutates(mutant):
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.before) == 1, f"{mutant.name}: its snippet occurs {text.count(mutant.before)} times"
    assert mutant.after != mutant.before
    for target in mutant.tests:
        assert (ROOT / target.split("::")[0]).is_file(), f"{mutant.name}: no test file {target}"
