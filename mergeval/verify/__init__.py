"""Paper specs: a paper's setup, its published numbers, and the claims a run should reproduce.

The language is documented in docs/specs.md.

- ``load.py``: finding (by path or by name on the search path) and reading a spec;
  ``yamlload.py``: the strict YAML loader (duplicate keys, names as written).
- ``tables.py`` / ``formulas.py`` / ``expr.py`` / ``numbers.py``: published tables,
  their derived cells (plain formulas on intervals included), and the
  rounding-aware recomputation that checks them.
- ``runs.py``: result.json files, run selection (``where``), spec metrics.
- ``claims.py`` / ``quantified.py``: the claim language (relations, rankings,
  quantifiers over a table) and its verdicts.

``python -m mergeval.verify`` is the command line on top of these.
"""

from mergeval.verify.claims import Claim, ClaimResult, compare, evaluate_claim, evaluate_claims
from mergeval.verify.load import Spec, available, find_spec, load_spec
from mergeval.verify.runs import Measured, Run, load_runs
from mergeval.verify.tables import CellCheck, check_tables

__all__ = [
    "CellCheck",
    "Claim",
    "ClaimResult",
    "Measured",
    "Run",
    "Spec",
    "available",
    "check_tables",
    "compare",
    "evaluate_claim",
    "evaluate_claims",
    "find_spec",
    "load_runs",
    "load_spec",
]
