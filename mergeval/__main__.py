"""``python -m mergeval``: the Hydra entry point (thin: compose, run, report, record).

Mistakes a user can make (a bad override, an unknown option, an invalid
hyperparameter, a missing model) end in one line on stderr and exit status 2.
Set HYDRA_FULL_ERROR=1 to see the full traceback instead.
"""

from __future__ import annotations

import os
import re
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mergeval.config import register_configs
from mergeval.errors import UserError

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://mergeval.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    from mergeval import app
    from mergeval.report.table import render

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        outcome = app.run(cfg, out_dir)
    except UserError as err:
        _discard_job_dir(out_dir)
        print(err.line(), file=sys.stderr)
        sys.exit(2)
    render(outcome, title=f"{cfg.modelset.name} · {cfg.method.name} · {cfg.benchmark.name}")
    path = app.write_result(cfg, outcome, out_dir)
    print(f"result: {path}")


def _discard_job_dir(out_dir) -> None:
    """A run that failed on bad input leaves no job directory behind (it holds only Hydra's own files)."""
    import shutil

    if not (out_dir / "result.json").exists():
        shutil.rmtree(out_dir, ignore_errors=True)


def explain(ex: BaseException) -> str | None:
    """One line for a Hydra/OmegaConf composition error, or None if it is not one."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    chain, cur = [], ex
    while cur is not None:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for err in chain:
        key = getattr(err, "full_key", None)
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


def cli() -> None:
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us instead of Hydra's multi-line report
    try:
        main()
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(2)
    except Exception as ex:
        line = None if full_error else explain(ex)
        if line is None:
            raise
        print(f"mergeval: error: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
