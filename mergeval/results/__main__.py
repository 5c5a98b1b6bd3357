"""``python -m mergeval.results``: list the runs in the results store, filter them, export CSV or Parquet.

python -m mergeval.results                                   # every run, oldest first
python -m mergeval.results --method ties --status finished --since 2026-11-01 --csv ties.csv
python -m mergeval.results --experiment quickstart --parquet runs.parquet
python -m mergeval.results import RESULTS_JSON --model SOURCE +experiment=...   # an lm_eval results file in
python -m mergeval.results export RUN_ID DIR                 # a run's models as lm_eval results files
"""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import UTC, datetime

from mergeval.core.errors import UserError
from mergeval.core.outcome import score_value
from mergeval.report.data import add_filters, benchmark_of, filtered_runs, parse_since  # noqa: F401  (re-exported)
from mergeval.results.store import STATUSES, Store, default_store_path, open_existing  # noqa: F401  (re-exported)

# experiment: the run's modelset (the store's column); benchmark: its benchmark's name (from the config)
COLUMNS = [
    "created",
    "status",
    "run_id",
    "experiment",
    "benchmark",
    "method",
    "params",
    "macro_gain",
    "macro_og",
    "normalized_mean",
    "duration_s",
    "commit",
    "result_path",
    "error",
]
_SHOWN = [
    "created",
    "status",
    "run_id",
    "experiment",
    "benchmark",
    "method",
    "params",
    "macro_gain",
    "macro_og",
    "normalized_mean",
]


def method_params(method_cfg: dict) -> str:
    """A method's hyperparameters as ``key=value`` words (its name and unset or empty values left out)."""
    return " ".join(f"{k}={v}" for k, v in method_cfg.items() if k != "name" and v not in (None, [], {}))


def run_row(run: dict) -> dict:
    """One flat row per run: the fixed COLUMNS, then ``merged:<task>`` accuracy columns of finished runs."""
    agg = run["aggregates"] or {}
    finished = run["finished"]
    row = {
        "created": datetime.fromtimestamp(run["created"], UTC).isoformat(timespec="seconds"),
        "status": run["status"],
        "run_id": run["run_id"],
        "experiment": run["experiment"],
        "benchmark": benchmark_of(run),
        "method": run["method"],
        "params": method_params(run["config"].get("method", {})),
        "macro_gain": agg.get("macro_gain"),
        "macro_og": agg.get("macro_og"),
        "normalized_mean": agg.get("normalized_mean"),
        "duration_s": None if finished is None else round(finished - run["created"], 3),
        "commit": (run["git"] or {}).get("commit"),
        "result_path": run["result_path"],
        "error": run["error"],
    }
    for task, by_role in (run["scores"] or {}).items():
        if "merged" in by_role:
            row[f"merged:{task}"] = score_value(by_role["merged"])
    return row


def table_columns(rows: list[dict]) -> list[str]:
    """COLUMNS, then every ``merged:<task>`` column in the order tasks first appear."""
    extra = []
    for row in rows:
        extra += [k for k in row if k not in COLUMNS and k not in extra]
    return COLUMNS + extra


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=table_columns(rows))
        writer.writeheader()
        writer.writerows(rows)


def write_parquet(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = table_columns(rows)
    pq.write_table(
        pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows], schema=_arrow_schema(columns)), path
    )


def _arrow_schema(columns: list[str]):
    """Fixed types, so an export of no rows or of all-null columns still has the right schema."""
    import pyarrow as pa

    numeric = {"macro_gain", "macro_og", "normalized_mean", "duration_s"}
    return pa.schema([(c, pa.float64() if c in numeric or c.startswith("merged:") else pa.string()) for c in columns])


def shown_params(runs: list[dict]) -> tuple[list[str], list[str]]:
    """(each run's params cell, the footer's lines). A method listed more than once shows only the hyperparameters
    that tell its runs apart; the values all its listed runs share go to one footer line per method, so a sweep's
    table shows what was swept (the CSV and Parquet keep every value). A method listed once shows them all."""
    from mergeval.report.data import varying_params

    counts: dict[str, int] = {}
    for run in runs:
        counts[run["method"]] = counts.get(run["method"], 0) + 1
    # grouped by the store's method column, as counted
    varying = varying_params(
        [{"config": {"method": {**(run["config"].get("method") or {}), "name": run["method"]}}} for run in runs]
    )
    cells, shared = [], {}
    for run in runs:
        params = {
            k: v for k, v in (run["config"].get("method") or {}).items() if k != "name" and v not in (None, [], {})
        }
        keep = [k for k in params if counts[run["method"]] == 1 or k in varying.get(run["method"], [])]
        cells.append(" ".join(f"{k}={params[k]}" for k in keep))  # in the config's order, as one run's are
        if counts[run["method"]] > 1:
            shared[run["method"]] = {k: v for k, v in params.items() if k not in keep}
    footer = [
        f"{method} (all {counts[method]} runs): {' '.join(f'{k}={v}' for k, v in values.items())}"
        for method, values in shared.items()
        if values
    ]
    return cells, footer


def print_table(rows: list[dict], title: str, params: tuple[list[str], list[str]] | None = None) -> None:
    """The listed runs; ``params``: ``shown_params`` of the same runs (else every row's params in full)."""
    from rich.console import Console
    from rich.table import Table

    cells_of, footer = params or ([r["params"] for r in rows], [])
    table = Table(title=title, title_justify="left")
    for col in _SHOWN:
        table.add_column(
            col,
            justify="right" if col in ("macro_gain", "macro_og", "normalized_mean") else "left",
            no_wrap=col in ("created", "status", "run_id"),
        )
    for r, params_cell in zip(rows, cells_of):
        # the start to the second, in UTC (the CSV and Parquet keep the full ISO time): room for the benchmark
        cells = {**r, "run_id": r["run_id"][:8], "created": r["created"][:19].replace("T", " "), "params": params_cell}
        for col, fmt in (("macro_gain", "{:+.2f}"), ("macro_og", "{:+.2f}"), ("normalized_mean", "{:.2f}")):
            cells[col] = "-" if r[col] is None else fmt.format(r[col])
        table.add_row(*[str(cells[c]) for c in _SHOWN])
    console = Console(width=None if Console().is_terminal else 160)
    console.print(table)
    if footer:
        console.print(
            "params shared by every listed run of a method (left out above):\n  " + "\n  ".join(footer),
            highlight=False,
            soft_wrap=True,
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import"]:  # an lm_eval results file in (mergeval/run/lm_eval_import.py)
        from mergeval.run.lm_eval_import import main as import_main

        return import_main(argv[1:])
    if argv[:1] == ["export"]:  # a run's models out in lm_eval's results shape (mergeval/results/lm_eval_export.py)
        from mergeval.results.lm_eval_export import main as export_main

        return export_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m mergeval.results",
        description=__doc__.splitlines()[0],
        epilog="subcommands: 'python -m mergeval.results export RUN_ID DIR' writes a run's models as lm_eval results "
        "files; 'python -m mergeval.results import RESULTS --model SOURCE' stores an lm_eval results file "
        "(each has its own --help)",
    )
    parser.add_argument(
        "--store", help="the results store: an SQLite file (default: <cache>/results.sqlite) or a postgresql:// URL"
    )
    add_filters(parser)
    parser.add_argument("--csv", metavar="FILE", help="also write the rows to this CSV file")
    parser.add_argument("--parquet", metavar="FILE", help="also write the rows to this Parquet file")
    args = parser.parse_args(argv)
    try:
        store = open_existing(args.store)
        runs = filtered_runs(store, args)
        found = [run_row(r) for r in runs]
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return 2
    print_table(found, f"{len(found)} run(s) in {store.location}", shown_params(runs))
    for flag, path, write in (("--csv", args.csv, write_csv), ("--parquet", args.parquet, write_parquet)):
        if path:
            try:
                write(found, path)
            except OSError as err:
                print(
                    UserError(flag, f"cannot write {path} ({err.strerror or err})", "pass a writable path").line(),
                    file=sys.stderr,
                )
                return 2
            print(f"wrote {len(found)} row(s) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
