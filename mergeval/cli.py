"""The command-line contract shared by every entry point (run, merge, staged).

Mistakes a user can make (a bad override, an unknown option, an invalid
hyperparameter, a missing model) end in one line on stderr and exit status 2,
and a job that failed that way leaves no job directory behind. Set
HYDRA_FULL_ERROR=1 to see the full traceback instead.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from mergeval.errors import UserError


def explain(ex: BaseException) -> str | None:
    """One line for a Hydra/OmegaConf composition error, or None if it is not one."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    chain, cur = [], ex
    while cur is not None:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    # An error inside an overridden value (e.g. a rule in method.rules) names its key relative to that value.
    target = next((m.group(1) for e in chain if (m := re.search(r"Could not override '([^']+)'", str(e)))), None)
    for err in chain:
        key = getattr(err, "full_key", None)
        if key and target and not str(key).startswith(target):
            key = f"{target}[...].{key}"
        if isinstance(err, OmegaConfBaseException) and key:
            msg = str(err).splitlines()[0]
            if "not in" in msg or "is not in struct" in msg:
                return f"{key}: no such field; check the spelling (see conf/ for the fields of each group)"
            return f"{key}: {msg}; fix the value's type"
    if isinstance(ex, MissingConfigException):
        found = re.search(r"Could not find '([^/']+)/([^']+)'", str(ex))
        options = re.findall(r"^\t(\S+)$", str(ex), flags=re.M)
        options = [o for o in options if not o.endswith("_schema")]
        if found:
            group, name = found.groups()
            return f"{group}: unknown option '{name}'; choose one of: {', '.join(options) or '(none)'}"
        return str(ex).splitlines()[0]
    if isinstance(ex, HydraException):
        lines = [ln.strip() for ln in str(ex).splitlines() if ln.strip() and not ln.startswith("See https")]
        return "; ".join(lines[:2])
    return None


def discard_job_dir(job_dir: Path) -> None:
    """A run that failed on bad input leaves no job directory, if it holds only Hydra's own files
    (never a directory with anything else in it, e.g. when hydra.run.dir points at the working directory)."""
    import shutil

    if job_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in job_dir.iterdir()):
        shutil.rmtree(job_dir, ignore_errors=True)
        for parent in (job_dir.parent, job_dir.parent.parent):  # outputs/<date>/ and outputs/, if now empty
            try:
                parent.rmdir()
            except OSError:  # not empty (other runs) or not ours to remove
                break


def run_cli(hydra_main, entry: str = "mergeval", summary: str = "") -> None:
    """Run a Hydra main with mergeval's error contract: a UserError or a composition error is one line on
    stderr and exit status 2; HYDRA_FULL_ERROR=1 shows the traceback instead. ``--help``/``-h`` print
    mergeval's help for ``entry`` (mergeval/help.py); Hydra's stays at --hydra-help."""
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from mergeval.help import help_text

        print(help_text(entry, summary))
        sys.exit(0)
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # composition errors reach us instead of Hydra's multi-line report
    try:
        hydra_main()
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(2)
    except Exception as ex:
        line = None if full_error else explain(ex)
        if line is None:
            raise
        print(f"mergeval: error: {line}", file=sys.stderr)
        sys.exit(2)
