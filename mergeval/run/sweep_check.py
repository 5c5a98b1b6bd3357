"""Check every job of a multirun before the first one starts.

Hydra's launchers compose each job's config only when that job starts, so a bad
value in one job of a sweep (``-m method.density=0,0.5``) would surface after
the jobs before it had run for minutes. ``check_sweep`` expands the sweep the way
Hydra's basic sweeper does (the cartesian product of every swept override),
composes each job's config and runs the config checks that need no model or
data (``checks.validate``); every failing job is one line.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

from mergeval.core.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Each checked job's composed config, by its overrides: the sweep's progress (progress.py) hashes them.
COMPOSED: dict[tuple[str, ...], DictConfig] = {}
# Flags that change the primary config; with them the sweep is left to Hydra's own checks.
_CONFIG_FLAGS = ("-cp", "--config-path", "-cn", "--config-name")
# A directory of the user's configs (their experiments), added to the search path: composed here as Hydra does.
_CONFIG_DIR = ("-cd", "--config-dir")


def config_dir_flags(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(``argv`` without its ``--config-dir DIR`` / ``-cd DIR`` / ``--config-dir=DIR`` flags, each flag as
    (its spelling, DIR as written)): the one reading of the flag, for the sweep check and for rerun commands."""
    rest, found = [], []
    args = iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag in _CONFIG_DIR:
            found.append((flag, value if eq else next(args, "")))
        else:
            rest.append(arg)
    return rest, found


def split_config_dir(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(``argv`` without ``--config-dir DIR``, the override that adds DIR to the config search path as the flag
    makes Hydra do: empty without the flag; None when DIR is no directory, which Hydra reports in its own words)."""
    import os

    rest, found = config_dir_flags(argv)
    dirs = []
    for _, given in found:
        where = os.path.abspath(given)  # as Hydra takes it
        if not os.path.isdir(where):
            return rest, None
        dirs.append("'file://" + where.replace("\\", "\\\\").replace("'", "\\'") + "'")  # quoted for Hydra
    return rest, ([f"hydra.searchpath=[{','.join(dirs)}]"] if dirs else [])


def expand(overrides: list[str], params: dict | None = None) -> list[list[str]] | None:
    """Each job's overrides as Hydra's basic sweeper makes them: the config's ``hydra.sweeper.params`` first,
    then the command line's overrides (a key in both takes the command line's values in the config's place);
    None when the sweep cannot be expanded here (a parse error or a glob sweep: Hydra reports or expands
    those itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mergeval.run.config import open_mappings

    # the config's params opened as mergeval's basic sweeper opens them (hydra_plugins/mergeval_basic_sweeper),
    # so a key in both is one key; the command line's were opened by mergeval.run.cli
    lines = open_mappings([f"{key}={value}" for key, value in (params or {}).items()]) + list(overrides)
    try:
        by_key: dict[str, list[str]] = {}
        for o in OverridesParser.create().parse_overrides(lines):
            key = o.get_key_element()
            by_key[key] = (
                [f"{key}={v}" for v in o.sweep_string_iterator()]
                if o.is_sweep_override()
                else [f"{key}={o.get_value_element_as_str()}"]
            )
    except Exception:  # noqa: BLE001  anything Hydra cannot parse, it reports in its own words when it runs
        return None
    return [list(job) for job in itertools.product(*by_key.values())]


def task_overrides(argv: list[str]) -> list[str]:
    """The overrides of ``argv`` that the sweeper expands (Hydra's own ``hydra.*`` ones are not a job's)."""
    return [a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]


def job_label(job: list[str], swept: list[int]) -> str:
    """A job's swept overrides as the user wrote them ("method=ties, method.lambda_=1.0"); the ``++`` that
    config.open_mappings puts before a mapping's override is left out."""
    return ", ".join(job[i].removeprefix("++") for i in swept)


def jobs_of(argv: list[str]) -> list[list[str]] | None:
    """``sweep_jobs(argv)``, composed once per process (the check and the progress both need it)."""
    jobs = _sweep_jobs(tuple(argv))
    return None if jobs is None else [list(job) for job in jobs]


def might_sweep(argv: list[str]) -> bool:
    """Whether ``argv`` can start a multirun: ``-m``, or an experiment or ``hydra.mode`` that may set it."""
    return any(arg in ("-m", "--multirun") for arg in argv) or any(
        a.lstrip("+~").startswith(("experiment=", "hydra.mode=")) for a in argv
    )


@functools.lru_cache(maxsize=4)
def _sweep_jobs(argv: tuple[str, ...]) -> tuple[tuple[str, ...], ...] | None:
    jobs = sweep_jobs(list(argv))
    return None if jobs is None else tuple(map(tuple, jobs))


def sweep_jobs(argv: list[str]) -> list[list[str]] | None:
    """Each job's overrides of the multirun that ``argv`` starts, with ``-m`` or with ``hydra.mode=MULTIRUN``
    in the composed config (an experiment such as cmm_mini sets it and lists its sweep in
    ``hydra.sweeper.params``); None when ``argv`` starts no multirun that can be expanded here (config flags,
    another sweeper, a parse error)."""
    if any(arg.split("=")[0] in _CONFIG_FLAGS for arg in argv):
        return None
    multirun = any(arg in ("-m", "--multirun") for arg in argv)
    if not might_sweep(argv):
        return None
    argv, search = split_config_dir(argv)
    if search is None:
        return None
    hydra_cfg = _hydra_config(search + [a for a in argv if not a.startswith("-")])
    if hydra_cfg is None:  # not composable here: the command line's own sweep, as far as it goes
        jobs = expand(task_overrides(argv)) if multirun else None
    elif (not multirun and not str(hydra_cfg.mode).endswith("MULTIRUN")) or "basic_sweeper" not in str(
        hydra_cfg.sweeper.get("_target_", "")
    ):  # no multirun, or another sweeper
        return None
    else:
        params = hydra_cfg.sweeper.get("params") or {}
        jobs = expand(task_overrides(argv), {str(k): str(v) for k, v in params.items()})
    # each job composes with the user's config directory (the same in every job: no job's label)
    return None if jobs is None else [search + job for job in jobs]


def _hydra_config(overrides: list[str]):
    """The ``hydra`` node composed with ``overrides`` (each swept override at its first value), or None."""
    return _composed_hydra(tuple(overrides))[0]


def code_in_config(argv: list[str]) -> str | None:
    """The one line for Hydra settings that would run code and come from a config file (an experiment, a
    modelset, a file of ``--config-dir``) rather than the user's own command line: ``hydra.callbacks`` (Hydra
    instantiates each ``_target_``), and logging handlers, formatters or filters made by a factory (``()``) or a
    class outside the standard library's ``logging`` (``logging.config`` calls them). None when there are none.
    Hydra's blocklist stops ``os.system``, not ``shutil.copyfile``: files must not be able to run code at all."""
    rest, search = split_config_dir(argv)
    if search is None:
        return None
    overrides = [a for a in rest if not a.startswith("-")]
    hydra_cfg = _hydra_config(search + overrides)
    if hydra_cfg is None:
        return None
    own = [a.lstrip("+~").split("=", 1)[0] for a in overrides]

    def on_command_line(name: str) -> bool:
        return any(key == f"hydra.{name}" or key.startswith((f"hydra.{name}.", f"hydra/{name}")) for key in own)

    fix = "mergeval runs no code from config files; set it on your own command line if you mean it"
    callbacks = hydra_cfg.get("callbacks") or {}
    if callbacks and not on_command_line("callbacks"):
        return f"hydra.callbacks: a config file sets {', '.join(map(str, callbacks))}, which run code; {fix}"
    for node in ("job_logging", "hydra_logging"):
        if on_command_line(node):
            continue
        for section in ("handlers", "formatters", "filters"):
            for name, spec in ((hydra_cfg.get(node) or {}).get(section) or {}).items():
                made_by = spec.get("()") or spec.get("class") if hasattr(spec, "get") else None
                if made_by is not None and ("()" in spec or not str(made_by).startswith("logging.")):
                    return (
                        f"hydra.{node}.{section}.{name}: a config file makes it with {made_by}, which runs code; {fix}"
                    )
    return None


def hydra_problem(argv: list[str]) -> str | None:
    """The one line for a mistake in the sweep's own Hydra settings (``hydra/launcher=paralel``): found before
    the progress line says "sweep 0/2 done" and Hydra then fails; None when there is none (a job's mistake
    is check_sweep's, per job)."""
    from mergeval.core.errors import explain

    argv, search = split_config_dir(argv)
    error = _composed_hydra(tuple((search or []) + [a for a in argv if not a.startswith("-")]))[1]
    line = None if error is None else explain(error)
    return line if line is not None and line.startswith("hydra") else None


@functools.lru_cache(maxsize=4)
def _composed_hydra(overrides: tuple[str, ...]) -> tuple[object | None, Exception | None]:
    """(the ``hydra`` node, None), or (None, the composition's error) for ``overrides`` at their first values."""
    from hydra import compose, initialize_config_module

    first = expand(list(overrides))
    if first is None:
        return None, None
    try:
        with initialize_config_module("mergeval.run.conf", version_base="1.3"):
            return compose("config", overrides=first[0], return_hydra_config=True).hydra, None
    except Exception as ex:  # noqa: BLE001  a bad override: hydra_problem, check_sweep or Hydra itself says so
        return None, ex


def check_sweep(argv: list[str]) -> list[str]:
    """One line per job of the multirun in ``argv`` whose config fails to compose or to validate."""
    from hydra import compose, initialize_config_module

    from mergeval.core.errors import explain
    from mergeval.run.checks import validate

    problem = hydra_problem(argv)
    if problem is not None:
        return [problem]
    jobs = jobs_of(argv)
    if jobs is None or len(jobs) < 2:
        return []
    swept = swept_positions(jobs)
    problems = []
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        for number, job in enumerate(jobs, start=1):
            try:
                COMPOSED[tuple(job)] = cfg = compose("config", overrides=job)
                validate(cfg)
            except UserError as err:
                line = str(err)
            except Exception as ex:  # noqa: BLE001  a composition error: explain() words it, else Hydra will
                explained = explain(ex)
                if explained is None:
                    continue
                line = explained
            else:
                continue
            label = job_label(job, swept)
            problems.append(f"sweep job {number} of {len(jobs)} ({label}): {line}")
    if problems:
        problems.append(
            f"{len(problems)} of {len(jobs)} jobs are invalid; no job was started: fix the swept "
            "values and run the sweep again"
        )
    return problems


def swept_positions(jobs: list[list[str]]) -> list[int]:
    """The positions of the overrides whose value differs between jobs (what labels a job)."""
    return [i for i in range(len(jobs[0])) if len({job[i] for job in jobs}) > 1]
