"""``python -m mergeval.results``: list the runs in the results store, filter them, export CSV.

    python -m mergeval.results                          # every run, oldest first
    python -m mergeval.results --method ties --csv ties.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mergeval.paths import cache_root
from mergeval.store import Store

COLUMNS = ["created", "run_id", "experiment", "method", "params", "macro_gain", "macro_og", "normalized_mean",
           "result_path"]


def _params(method_cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in method_cfg.items() if k != "name" and v is not None)


def rows(store: Store, experiment: str | None, method: str | None) -> list[dict]:
    out = []
    for run in store.runs(experiment, method):
        agg = run["aggregates"]
        out.append({
            "created": datetime.fromtimestamp(run["created"], timezone.utc).isoformat(timespec="seconds"),
            "run_id": run["run_id"], "experiment": run["experiment"], "method": run["method"],
            "params": _params(run["config"]["method"]), "macro_gain": agg["macro_gain"], "macro_og": agg["macro_og"],
            "normalized_mean": agg["normalized_mean"], "result_path": run["result_path"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mergeval.results", description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="the SQLite results store (default: <cache>/results.sqlite)")
    parser.add_argument("--experiment", help="only runs of this modelset")
    parser.add_argument("--method", help="only runs of this merge method")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    path = Path(args.store).expanduser() if args.store else cache_root(None) / "results.sqlite"
    if not path.exists():
        print(f"mergeval: error: --store: no results store at {path}; run python -m mergeval first or pass "
              "--store PATH", file=sys.stderr)
        return 2
    found = rows(Store(path), args.experiment, args.method)
    table = Table(title=f"{len(found)} run(s) in {path}", title_justify="left")
    for col in COLUMNS[:-1]:
        table.add_column(col, justify="right" if col in ("macro_gain", "macro_og", "normalized_mean") else "left")
    for r in found:
        norm = r["normalized_mean"]
        table.add_row(r["created"], r["run_id"][:8], r["experiment"], r["method"], r["params"],
                      f"{r['macro_gain']:+.2f}", f"{r['macro_og']:+.2f}", "-" if norm is None else f"{norm:.2f}")
    Console(width=None if Console().is_terminal else 160).print(table)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(found)
        print(f"wrote {len(found)} row(s) to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
