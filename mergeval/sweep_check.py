"""Check every job of a multirun before the first one starts.

Hydra's launchers compose each job's config only when that job starts, so a bad
value in one job of a sweep (``-m method.density=0,0.5``) would surface after
the jobs before it had run for minutes. ``check_sweep`` expands the sweep the way
Hydra's basic sweeper does (the cartesian product of every swept override),
composes each job's config and runs the config checks that need no model or
data (``checks.validate``); every failing job is one line.
"""

from __future__ import annotations

import itertools

from mergeval.errors import UserError

# Each checked job's composed config, by its overrides: the sweep's progress (progress.py) hashes them.
COMPOSED: dict[tuple[str, ...], object] = {}
# Flags that change which config is composed; with them the sweep is left to Hydra's own checks.
_CONFIG_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")


def expand(overrides: list[str]) -> list[list[str]] | None:
    """Each job's overrides (Hydra's basic sweeper's order), or None when the sweep cannot be expanded here
    (a parse error or a glob sweep: Hydra reports or expands those itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
                   else [o.input_line] for o in parsed]
    except Exception:  # noqa: BLE001  anything Hydra cannot parse, it reports in its own words when it runs
        return None
    return [list(job) for job in itertools.product(*choices)]


def check_sweep(argv: list[str]) -> list[str]:
    """One line per job of the multirun in ``argv`` whose config fails to compose or to validate."""
    from hydra import compose, initialize_config_module

    from mergeval.checks import validate
    from mergeval.cli import explain

    if any(arg.split("=")[0] in _CONFIG_FLAGS for arg in argv):
        return []
    overrides = [a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    jobs = expand(overrides)
    if jobs is None or len(jobs) < 2:
        return []
    swept = [i for i in range(len(overrides)) if len({job[i] for job in jobs}) > 1]
    problems = []
    with initialize_config_module("mergeval.conf", version_base="1.3"):
        for number, job in enumerate(jobs, start=1):
            try:
                COMPOSED[tuple(job)] = cfg = compose("config", overrides=job)
                validate(cfg)
            except UserError as err:
                line = str(err)
            except Exception as ex:  # noqa: BLE001  a composition error: explain() words it, else Hydra will
                line = explain(ex)
                if line is None:
                    continue
            else:
                continue
            label = ", ".join(job[i] for i in swept)
            problems.append(f"sweep job {number} of {len(jobs)} ({label}): {line}")
    if problems:
        problems.append(f"{len(problems)} of {len(jobs)} jobs are invalid; no job was started: fix the swept "
                        "values and run the sweep again")
    return problems
