"""Where a report's runs come from: result.json files and directories, or the results store."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import result_files_below

REQUIRED = ("run_id", "created", "config", "models", "tasks", "scores", "aggregates")


def result_files(paths: list[str]) -> list[Path]:
    """Each path as given if it is a file, every result.json below it if it is a directory (a sweep)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += result_files_below(p)
        elif p.is_file():
            found.append(p)
        else:
            raise UserError(str(p), "no such file or directory", "pass result.json files or job/sweep directories")
    return list(dict.fromkeys(found))


def read_result(path: Path) -> dict:
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(str(path), f"cannot read it as JSON ({err})", "pass result.json files written by mergeval")
    missing = [k for k in REQUIRED if not isinstance(result, dict) or k not in result]
    if missing:
        raise UserError(str(path), f"is not a mergeval result.json (no {', '.join(missing)})",
                        "pass result.json files written by mergeval")
    return result


def load_results(paths: list[str]) -> list[dict]:
    """The results under ``paths``, oldest first (each run once, even if reached by two paths)."""
    results = {r["run_id"]: r for r in map(read_result, result_files(paths))}
    return sorted(results.values(), key=lambda r: (r["created"], r["run_id"]))


def result_from_run(run: dict) -> dict:
    """A finished run's row in the results store, shaped like its result.json."""
    tasks = run["config"].get("benchmark", {}).get("tasks") or list(run["scores"])
    return {"run_id": run["run_id"],
            "created": datetime.fromtimestamp(run["created"], timezone.utc).isoformat(timespec="seconds"),
            "config": run["config"], "models": run["models"], "tasks": [t for t in tasks if t in run["scores"]],
            "scores": run["scores"], "aggregates": run["aggregates"], "timings_s": run["timings"],
            "versions": run["versions"], "git": run["git"], "result_path": run["result_path"]}
