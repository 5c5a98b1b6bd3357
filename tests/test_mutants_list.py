"""benchmarks/mutants.py's planted bugs still match the code they mutate, and keep matching it once reformatted.

Each mutant names a snippet of a file; when the code changes under it, the mutation check stops with an
error before planting anything (12 of its 79 snippets had drifted that way unnoticed when they were matched
as exact text). This holds the list to the code on every run of the suite: each snippet matches exactly once
in its file (token by token: mutants.py's "locating a snippet by its tokens"), plants code that compiles,
differs from its replacement, and the tests it runs exist. It also formats each mutated file with
``ruff format`` (the project's settings, and a narrow, single-quoted variant that wraps far more) and checks
that every snippet still matches once there and plants code that compiles: reformatting cannot break the list.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants_module():
    spec = importlib.util.spec_from_file_location("mutants_list", ROOT / "benchmarks" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


mutants = _mutants_module()
MUTANTS = mutants.MUTANTS
FILES = sorted({m.path for m in MUTANTS})
# (id, extra ruff format arguments): the project's settings; 40 columns and single quotes, which rewraps most
# statements, adds parentheses and trailing commas and changes every quote
FORMATS = [("project", []), ("narrow-single", ["--line-length", "40", "--config", "format.quote-style = 'single'"])]


def test_mutant_names_are_distinct():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_still_matches_the_code_it_mutates(mutant):
    text = (ROOT / mutant.path).read_text()
    _, found = mutants.find(text, mutant.before)
    assert len(found) == 1, f"{mutant.name}: its snippet matches {len(found)} times"
    result = mutants.planted(text, mutant)
    assert result != text
    compile(result, mutant.path, "exec")
    assert mutant.after != mutant.before
    for target in mutant.tests:
        assert (ROOT / target.split("::")[0]).is_file(), f"{mutant.name}: no test file {target}"


def _ruff_format(path: str, args: list[str]) -> str:
    """``path`` as ``ruff format`` (with the project's configuration, plus ``args``) would write it."""
    cmd = [sys.executable, "-m", "ruff", "format", *args, "--stdin-filename", str(ROOT / path), "-"]
    return subprocess.run(
        cmd, input=(ROOT / path).read_text(), capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("args", [a for _, a in FORMATS], ids=[i for i, _ in FORMATS])
@pytest.mark.parametrize("path", FILES)
def test_every_mutant_survives_ruff_format_of_its_file(path, args):
    formatted = _ruff_format(path, args)
    errors = []
    for m in (m for m in MUTANTS if m.path == path):
        try:
            compile(mutants.planted(formatted, m), path, "exec")
        except (mutants.MutantError, SyntaxError) as err:
            errors.append(f"{m.name}: {err}")
    assert not errors, "\n".join(errors)


def _plant(source: str, before: str, after: str) -> tuple[int, str]:
    return mutants.plant(textwrap.dedent(source), before, after)


def test_a_snippet_matches_whatever_its_quotes():
    assert _plant("x = f('a', b'c')\n", 'f("a", b"c")', 'g("a")') == (1, 'x = g("a")\n')
    assert _plant("x = 'it\\'s'\n", 'x = "it\'s"', "x = 0")[0] == 1
    assert _plant("x = f'{a!r} is \"{b}\"'\n", 'x = f"{a!r} is \\"{b}\\""', "x = 0")[0] == 1
    assert _plant("x = 'ab'\n", "x = 'a' 'b'", "x = 0")[0] == 1  # implicit concatenation
    assert _plant("x = 'a'\n", "x = 'b'", "x = 0")[0] == 0
    assert _plant("x = 0XFF\n", "x = 0xff", "x = 0")[0] == 1
    assert _plant("x = 1\n", "x = 1.0", "x = 0")[0] == 0


def test_a_snippet_matches_a_rewrapped_call_with_comments_and_a_trailing_comma():
    source = """
        def f():
            total = combine(
                first,  # the first
                second,
            )
            return total
    """
    count, result = _plant(source, "total = combine(first, second)", "total = combine(second, first)")
    assert count == 1
    assert "    total = combine(second, first)\n    return total" in result
    compile(result, "x", "exec")
    # a partial snippet, spread over the wrapped lines: the replacement keeps the rest
    count, result = _plant(source, "combine(first,", "combine(None,")
    assert count == 1 and "combine(None,  # the first\n        second," in result


def test_a_trailing_comma_only_where_it_changes_nothing():
    assert _plant("f(a, b,)\n", "f(a, b)", "g()")[0] == 1
    assert _plant("f(a, b)\n", "f(a, b,)", "g()")[0] == 1
    assert _plant("x = [a,]\n", "x = [a]", "x = 0")[0] == 1
    assert _plant("x = f((a,))\n", "x = f((a))", "x = 0")[0] == 0  # a one-element tuple
    assert _plant("x = y[a,]\n", "x = y[a]", "x = 0")[0] == 0


def test_redundant_parentheses_around_a_whole_expression():
    count, result = _plant(
        """
        if ok:
            allowed = (
                (p_hi - p_lo) / 2
                + record.width
            )
        """,
        "allowed = (p_hi - p_lo) / 2 + record.width",
        "allowed = 0",
    )
    assert count == 1 and "    allowed = 0\n" in result
    # the file's parentheses close after the snippet's end: planting opens them again in after
    count, result = _plant(
        "h = (\n    0.0 if exact else 0.5 * 10.0**-digits\n)\n",
        "h = 0.0 if exact else 0.5 * 10.0 **",
        "h = 0.0 if exact else 10.0 **",
    )
    assert count == 1 and result == "h = (0.0 if exact else 10.0 **-digits\n)\n"
    assert _plant("return (a + b)\n", "return a + b", "return 0")[0] == 1
    assert _plant("x = a + b\n", "x = (a + b)", "x = 0")[0] == 1
    assert _plant("x = a * (b + c)\n", "x = a * b + c", "x = 0")[0] == 0  # not around a whole expression
    assert _plant("x = (a or b) in c\n", "x = a or b in c", "x = 0")[0] == 0
    assert _plant("x = f(a + b)\n", "x = f a + b", "x = 0")[0] == 0
    assert _plant("lo, hi = (\n    f(lo),\n    g(hi),\n)\n", "lo, hi = f(lo), g(hi)", "lo = 0")[0] == 1
    assert _plant("for (\n    ends\n) in product():\n    pass\n", "for ends in product():", "for e in ():")[0] == 1


def test_a_snippet_must_match_once():
    assert _plant("a = 1\nb = a + 1\n", "a", "c")[0] == 2
    assert _plant("x = int((t > e).sum())\n", "(t > e)", "(t < e)") == (1, "x = int((t < e).sum())\n")
    assert _plant("x = 1\n", "y = 1", "y = 2") == (0, "x = 1\n")


def test_a_multi_line_after_lands_at_the_matched_depth():
    source = """
        def f():
            if x:
                v = g()
                return v
    """
    count, result = _plant(source, "v = g()\n", "v = g()\nv = -v\n")
    assert count == 1 and "        v = g()\n        v = -v\n        return v" in result
    count, result = _plant(source, "    if x:\n        v = g()", "    if not x:\n        v = h()")
    assert count == 1 and "    if not x:\n        v = h()\n        return v" in result
