"""Paper specs: a paper's setup, its published numbers, and the claims a run should reproduce.

- ``load.py``: finding (by path or by name in ``specs/``) and reading a spec.
- ``tables.py`` / ``formulas.py`` / ``numbers.py``: published tables, their
  derived cells, and the rounding-aware recomputation that checks them.
- ``runs.py``: result.json files, run selection (``where``), spec metrics.
- ``claims.py``: the claim language and its verdicts.

``python -m mergeval.verify`` is the command line on top of these.
"""

from mergeval.specs.claims import Claim, ClaimResult, compare, evaluate_claim
from mergeval.specs.load import Spec, available, find_spec, load_spec
from mergeval.specs.runs import Measured, Run, load_runs
from mergeval.specs.tables import CellCheck, check_tables

__all__ = ["CellCheck", "Claim", "ClaimResult", "Measured", "Run", "Spec", "available", "check_tables", "compare",
           "evaluate_claim", "find_spec", "load_runs", "load_spec"]
