"""``python -m mergeval.report``: a sweep's or a set of runs' table, Markdown report and plots.

    python -m mergeval.report multirun/2026-11-30/10-00-00-000000        # every result.json below it
    python -m mergeval.report outputs/*/*/result.json --out report/
    python -m mergeval.report --store --experiment quickstart --method ties   # finished runs in the store

Writes ``report.md``, ``pareto.png``, ``score_vs_param.png`` and
``normalized.png`` into ``--out`` (default ``./report``); a plot that the runs
cannot support (e.g. no swept hyperparameter) is skipped and the reason noted.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.outcome import score_value
from mergeval.report import data, markdown
from mergeval.report.data import add_filters, benchmark_of, parse_since
from mergeval.results.store import default_store_path, open_existing


def build_report(results: list[dict], out_dir: Path, source: str, tasks: list[str] | None = None,
                 param: str | None = None) -> dict:
    """Write report.md and the plots for ``results`` into ``out_dir``; returns what the terminal shows.

    Returns {"runs": rows, "tasks", "pareto": Pareto | None, "files": [paths], "notes": [why a plot is missing]}.
    """
    from mergeval.report import plots

    if not results:
        raise UserError("runs", "no finished runs to report", "check the paths or the filters")
    # Everything the runs or the arguments can get wrong is found before --out gets its first file.
    all_tasks = data.common_tasks(results)
    cons = data.constituents(results)
    varying = data.varying_params(results)
    pair = data.pareto_tasks(results, tasks)
    trade = None if isinstance(pair, str) else data.pareto(results, *pair, [data.run_label(r, varying) for r in results])
    swept = data.sweep_param(results, param)
    series = None if swept is None else data.param_series(results, swept, all_tasks)
    norm_tasks, norm = data.normalized_by_method(results)

    out_dir.mkdir(parents=True, exist_ok=True)
    notes, images, files = [], {}, []
    if trade is None:
        notes.append(f"pareto.png skipped: {pair}")
    else:
        files.append(plots.plot_pareto(trade, out_dir / "pareto.png"))
        images["pareto"] = "pareto.png"
    if swept is None or series is None:  # series: None exactly when swept is
        notes.append("score_vs_param.png skipped: no numeric hyperparameter varies across the runs; pass "
                     "--param NAME")
    else:
        base = {t: score_value(cons["base"]["scores"][t]) for t in all_tasks}
        files.append(plots.plot_score_vs_param(series, swept, all_tasks, base, out_dir / "score_vs_param.png",
                                               data.metric_names(results, all_tasks)))
        images["score_vs_param"] = "score_vs_param.png"
    norm_rows = [{"method": label, **{data.short(t): "undefined" if v[t] is None else f"{v[t]:.2f}"
                                      for t in norm_tasks}} for label, v in norm.items()]
    if norm_tasks:
        files.append(plots.plot_normalized(norm_tasks, norm, out_dir / "normalized.png"))
        images["normalized"] = "normalized.png"
    else:
        notes.append("normalized.png skipped: no expert names its own task (modelset.experts.<name>.task)")

    runs = data.run_rows(results, all_tasks)
    text = markdown.render(
        title="mergeval report", source=source, runs=runs, constituents=data.constituent_rows(cons, all_tasks),
        pareto=trade, notes=notes, param=swept, normalized=norm_rows, images=images)
    report = out_dir / "report.md"
    report.write_text(text)
    for skipped in {"pareto.png", "score_vs_param.png", "normalized.png"} - set(images.values()):
        (out_dir / skipped).unlink(missing_ok=True)  # an earlier report's plot beside this one would be taken for its
    return {"runs": runs, "tasks": all_tasks, "pareto": trade, "files": [report, *files], "notes": notes}


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 160)
    rows = summary["runs"]
    table = Table(title=f"{len(rows)} run(s): merged model, each task's metric ± stderr", title_justify="left")
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("run", "label") else "right", no_wrap=col != "label")
    for r in rows:
        table.add_row(*map(str, r.values()))
    console.print(table)
    if summary["pareto"] is not None:
        console.print(markdown.pareto_text(summary["pareto"]).replace("\n\n", "\n"))
    for note in summary["notes"]:
        console.print(f"[dim]{note}[/dim]")
    for path in summary["files"]:
        console.print(f"wrote {path}")


def collect(args: argparse.Namespace) -> tuple[list[dict], str]:
    """The finished runs the arguments select, and a line saying where they came from."""
    from mergeval.report.load import load_results, result_from_run

    since = None if args.since is None else parse_since(args.since)
    if args.paths and args.store is not None:
        raise UserError("--store", "give result.json paths or --store, not both", "drop one of them")
    if args.paths:
        found = load_results(args.paths)
        results = data.filter_results(found, args.experiment, args.method, since, args.benchmark)
        return results, f"{len(results)} run(s) from {', '.join(args.paths)}"
    store = open_existing(args.store or None)
    runs = [r for r in store.runs(args.experiment, args.method, "finished", since)
            if args.benchmark is None or benchmark_of(r) == args.benchmark]
    results = [result_from_run(r) for r in runs if r["models"] and r["scores"]]  # runs migrated without scores
    results, other = data.comparable_with_newest(results)
    left_out = "" if not other else (f" ({len(other)} other run(s) with other base/expert models or evaluation "
                                     "settings left out; a sweep directory, or filters that leave only them, report them)")
    return results, f"{len(results)} finished run(s) from the results store {store.location}{left_out}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mergeval.report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", metavar="PATH", help="result.json files or directories to search")
    parser.add_argument("--store", nargs="?", const="", default=None, metavar="FILE_OR_URL",
                        help=f"report finished runs from the results store (default file: {default_store_path()}); "
                             "the default when no PATH is given")
    add_filters(parser, status=False)
    parser.add_argument("--tasks", nargs=2, metavar=("TASK_X", "TASK_Y"),
                        help="the two tasks of the trade-off plot (default: the two experts' own tasks)")
    parser.add_argument("--param", help="the method hyperparameter on the x axis of score_vs_param.png "
                                        "(default: the swept one, lambda_ or density first)")
    parser.add_argument("--out", default="report", help="output directory (default: ./report)")
    args = parser.parse_args(argv)
    try:
        results, source = collect(args)
        summary = build_report(results, Path(args.out), source + f", {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
                               args.tasks, args.param)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return 2
    except OSError as err:  # the output directory cannot be written
        print(UserError("--out", f"cannot write {err.filename or args.out} ({err.strerror or err})",
                        "pass a writable directory").line(), file=sys.stderr)
        return 2
    print(source)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
