"""The run's benchmark as lm-eval tasks: generated, shipped, from a directory or from lm-eval's registry.

``benchmark.tasks`` mixes freely:

- mergeval's generated tasks (``mergeval_*``, eval/tasks.py), written to the cache;
- any lm-eval registry task, group or tag (``hellaswag``, ``gsm8k``, ``mmlu``);
- tasks from ``benchmark.include_path`` directories of lm-eval task YAMLs
  (``shipped:suites/chembench`` is a suite shipped with mergeval).

``benchmark.data`` points a task at local files (``{task: {split: file}}``):
mergeval writes a YAML that ``include:``s the task's own YAML and changes only
where its data comes from, so the task's ``process_docs``, prompts, filters
and metrics stay lm-eval's. That is how the real registry code runs offline
(tests, the ``quickstart_registry`` experiment). ``shipped:`` paths resolve
inside mergeval/eval/shipped/.

Every name in ``benchmark.tasks`` is an *entry*: evaluated as one unit. Each
entry gives one or more *rows* of scores: a task gives itself, a group gives
its aggregate (when lm-eval aggregates it) and every subtask and subgroup.
Only the entries' own rows count in Macro-Gain and the other aggregates; a
group's members are shown, never counted twice.

Loading a task loads its data, so a missing data set fails here, before any
merge, with one line naming the task (``python -m mergeval.check`` lists what
a run needs without loading it).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import atomic_dir
from mergeval.eval.metric_choice import default_metric, metric_keys, normalize_key
from mergeval.eval.settings import PerTask
from mergeval.eval.tasks import GENERATED, datasets_cache, task_digest, write_tasks

SHIPPED = Path(__file__).parent / "shipped"
SHIPPED_PREFIX = "shipped:"
LOWER_IS_BETTER_NOTE = "lower is better: shown, kept out of the aggregates"


def resolve_path(spec: str, field: str, want_dir: bool) -> Path:
    """A config path: ``shipped:<rel>`` inside mergeval/eval/shipped, else a path (``~`` expanded, cwd-relative)."""
    path = SHIPPED / spec.removeprefix(SHIPPED_PREFIX) if spec.startswith(SHIPPED_PREFIX) else Path(spec).expanduser()
    ok = path.is_dir() if want_dir else path.is_file()
    if not ok:
        kind = "directory" if want_dir else "file"
        raise UserError(
            field, f"no such {kind} '{spec}'", f"give an existing {kind} (or shipped:<path> inside {SHIPPED})"
        )
    return path.resolve()


def check_no_task_code(directory: Path, field: str) -> None:
    """A directory of the user's task YAMLs loads no Python: lm-eval imports and runs what ``!function`` names
    (a task's ``utils.process_docs``, a metric) as the task is loaded, so a directory from elsewhere runs code.
    Refused unless ``benchmark.allow_task_code=true`` says the user trusts it (as ``eval.allow_code_execution``
    does for the code a model writes)."""
    for yaml_file in sorted(directory.rglob("*.yaml")) + sorted(directory.rglob("*_yaml")):
        try:
            text = yaml_file.read_text(errors="replace")
        except OSError:
            continue  # lm-eval reports an unreadable file when it loads the directory
        found = re.search(r"!function\s+(\S+)", text)
        if found:
            raise UserError(
                field,
                f"{yaml_file} runs Python code when lm-eval loads it (!function {found.group(1)})",
                "read that code, then set benchmark.allow_task_code=true if you trust the directory",
            )


@dataclass(frozen=True)
class Row:
    """One line of scores: a task or a group, the metric reported for it, and whether aggregates count it."""

    name: str
    entry: str  # the benchmark.tasks name it is evaluated with
    kind: str  # "task" or "group"
    output_type: str | None  # multiple_choice, loglikelihood, loglikelihood_rolling, generate_until (None: group)
    metric: str  # "acc_norm,none", "exact_match,flexible-extract", ...
    metrics: tuple[str, ...]  # every key the row reports
    higher_is_better: bool
    digest: str  # what was evaluated: the task's config and data
    counted: bool  # an entry's own row with a higher-is-better metric: part of Macro-Gain and the rest
    num_fewshot: int | tuple[int, ...] = 0  # the count it is evaluated with (a group: its members', one if equal)
    generates: bool = False  # generate_until (a group: any member): only then can eval.gen_kwargs change it

    @property
    def listed(self) -> bool:
        return self.name == self.entry


class Suite:
    """The loaded tasks of a run and their rows; built once per run, shared by every model's evaluation."""

    def __init__(self, entries: list[str], rows: list[Row], loaded: dict, generated_dir: Path | None):
        # generated_dir: where mergeval wrote its generated tasks (YAML + JSONL), None when there are none
        self.entries, self.loaded, self.generated_dir = entries, loaded, generated_dir
        self.rows = {r.name: r for r in rows}

    @property
    def names(self) -> list[str]:
        """Every row, in table order: each entry, then its members."""
        return list(self.rows)

    @property
    def digests(self) -> dict[str, str]:
        return {name: r.digest for name, r in self.rows.items()}

    def counted(self) -> list[str]:
        return [r.name for r in self.rows.values() if r.counted]

    def excluded(self) -> list[str]:
        """Entries kept out of the aggregates because their metric is lower-is-better (e.g. perplexity)."""
        return [r.name for r in self.rows.values() if r.listed and not r.higher_is_better]

    def rows_of(self, entries: list[str]) -> list[str]:
        return [name for name, r in self.rows.items() if r.entry in entries]

    def subset(self, entries: list[str]) -> dict:
        """lm-eval's TaskDict for these entries only (their tasks and groups)."""
        keep = set(self.rows_of(entries)) | {t for e in entries for t in self.loaded["members"].get(e, [])}
        return {
            "tasks": {n: t for n, t in self.loaded["tasks"].items() if n in keep},
            "groups": {n: g for n, g in self.loaded["groups"].items() if n in keep},
            "group_map": {n: m for n, m in self.loaded["group_map"].items() if n in keep},
        }

    def task(self, name: str):
        return self.loaded["tasks"][name]

    def per_task(self, settings: Mapping) -> PerTask:
        """The store key's settings of every row, from the run's ``settings`` (eval/settings.py)."""
        return PerTask(
            settings, {name: {"num_fewshot": r.num_fewshot, "generates": r.generates} for name, r in self.rows.items()}
        )


def build_suite(bench, eval_cfg, cache: Path, split: str = "test", n_validation: int = 0) -> Suite:
    """Resolve, load and configure the benchmark's tasks (module docstring); UserError on any bad name or data."""
    entries = list(bench.tasks)
    if not entries:
        raise UserError("benchmark.tasks", "no tasks", "list lm-eval task names or mergeval_* generated tasks")
    if len(set(entries)) != len(entries):
        raise UserError("benchmark.tasks", "a task is listed twice", "list each task once")
    generated = [t for t in entries if t in GENERATED]
    others = [t for t in entries if t not in GENERATED]
    paths = []
    if generated:
        paths.append(write_tasks(generated, bench.n_items, cache, split=split, n_validation=n_validation))
    elif split != "test":
        raise UserError(
            "method.order",
            "ranking experts on a validation split needs mergeval's generated tasks",
            "give method.validation_scores or set method.order=given",
        )
    given = [resolve_path(p, f"benchmark.include_path[{i}]", want_dir=True) for i, p in enumerate(bench.include_path)]
    for i, (spec, path) in enumerate(zip(bench.include_path, given)):
        if not spec.startswith(SHIPPED_PREFIX) and not getattr(bench, "allow_task_code", False):
            check_no_task_code(path, f"benchmark.include_path[{i}]")
    paths += given
    _quiet_lm_eval()
    manager = _manager(paths, others + list(bench.data or {}), cache)
    unknown = [t for t in others if t not in manager.all_tasks]
    if unknown:
        near = difflib.get_close_matches(unknown[0], manager.all_tasks + list(GENERATED), n=3)
        raise UserError(
            "benchmark.tasks",
            f"unknown task '{unknown[0]}' (not generated, not in lm-eval's registry or benchmark.include_path)",
            f"did you mean one of {near}?"
            if near
            else "see `lm_eval ls tasks`, or add a directory of task YAMLs to benchmark.include_path",
        )
    _check_data_keys(bench, manager)
    if bench.data:  # the overriding YAMLs shadow the registry's by name, so groups use them too
        manager = _manager(paths + [_write_overrides(bench, manager, cache)], others + list(bench.data), cache)
    loaded: dict[str, dict] = {"tasks": {}, "groups": {}, "group_map": {}, "members": {}}
    for entry in entries:
        _load_entry(manager, entry, bench, loaded, bool(eval_cfg.allow_code_execution))
    stray = [t for t in bench.data or {} if t not in loaded["tasks"]]
    if stray:
        raise UserError(
            f"benchmark.data.{stray[0]}",
            f"'{stray[0]}' is neither in benchmark.tasks nor a member of a group there",
            "add it or drop its data",
        )
    _configure(loaded, bench, eval_cfg)
    generated_dir = paths[0] if generated else None
    leaf_digests: dict[str, str] = {}  # a group's members are hashed once, for the group row and their own
    rows = []
    for entry in entries:
        rows += _rows(entry, loaded, bench, generated_dir if entry in generated else None, leaf_digests)
    return Suite(entries, rows, loaded, generated_dir)


def _quiet_lm_eval() -> None:
    import datasets

    datasets.disable_progress_bars()
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _manager(paths: list[Path], others: list[str], cache: Path):
    """lm-eval's task index: only mergeval's and the user's directories when they hold every name (fast),
    else lm-eval's registry too (its index cached, eval/task_index.py). Later directories shadow earlier names."""
    from mergeval.eval.task_index import task_manager

    include = [str(p) for p in paths] or None
    local = task_manager(include, include_defaults=False, cache=cache)
    if all(t in local.all_subtasks for t in others):  # a group's members may live in the registry
        return local
    return task_manager(include, include_defaults=True, cache=cache)


def _check_data_keys(bench, manager) -> None:
    entries = list(bench.tasks)
    for task, splits in (bench.data or {}).items():
        if task in GENERATED:
            raise UserError(f"benchmark.data.{task}", "a generated task has its own data", "drop this override")
        if not splits:
            raise UserError(f"benchmark.data.{task}", "no files", "map split names to files, e.g. {test: file.jsonl}")
        if task not in manager.all_tasks:
            raise UserError(
                f"benchmark.data.{task}",
                f"unknown task '{task}'",
                "name a task of benchmark.tasks (or a member of a group there)",
            )
    for field in ("metrics", "fewshot"):
        for task in getattr(bench, field) or {}:
            if task not in entries:
                raise UserError(
                    f"benchmark.{field}.{task}", f"'{task}' is not in benchmark.tasks", f"use one of {entries}"
                )


def _write_overrides(bench, manager, cache: Path) -> Path:
    """A directory of one YAML per overridden task: its own YAML included, only the data source replaced."""
    files = {}
    for task, splits in bench.data.items():
        entry = manager.task_index[task]
        if entry.yaml_path is None or entry.kind.name not in ("TASK", "PY_TASK"):
            raise UserError(
                f"benchmark.data.{task}",
                "only a single task's data can be replaced, not a group's",
                "override each member task instead",
            )
        data = {
            split: str(resolve_path(f, f"benchmark.data.{task}.{split}", want_dir=False)) for split, f in splits.items()
        }
        # tag: null keeps the registry's tags (mmlu_stem_tasks, ...) whole: an override's inherited tag would
        # replace the tag's member list in this index. Absolute paths: datasets resolves relative ones against
        # the working directory, not the YAML.
        files[task] = {
            "include": str(entry.yaml_path),
            "task": task,
            "tag": None,
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": data, "cache_dir": str(datasets_cache(cache))},
        }
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    target = cache / "tasks" / "data_overrides" / digest
    if not target.exists():
        with atomic_dir(target) as tmp:
            for task, cfg in files.items():  # JSON is YAML: no quoting surprises in paths
                (tmp / f"{task}.yaml").write_text(json.dumps(cfg, indent=1) + "\n")
    return target


def _load_entry(manager, entry: str, bench, loaded: dict, allow_code: bool) -> None:
    """Load one entry (its data included) into ``loaded``; one-line errors for missing or mismatched data."""
    try:
        got = manager.load([entry])
    except UserError:
        raise
    except Exception as err:  # datasets raises many types for "not downloaded" / "offline" / "no such split"
        raise _data_error(entry, bench, err) from None
    clash = [t for t in got["tasks"] if t in loaded["tasks"]]
    if clash:
        owner = next(e for e, m in loaded["members"].items() if clash[0] in m or clash[0] == e)
        raise UserError(
            "benchmark.tasks",
            f"'{clash[0]}' is both in '{owner}' and in '{entry}'",
            "list a group or its members, not both",
        )
    for name, task in got["tasks"].items():
        if name in (bench.data or {}):  # registry data has the task's schema; only local files can differ
            _check_splits(name, task, list(bench.data[name]))
            _check_schema(name, task)
        if getattr(task, "UNSAFE_CODE", False) and not allow_code:
            raise UserError(
                "eval.allow_code_execution",
                f"'{name}' runs the code the model writes",
                "set eval.allow_code_execution=true on a sandboxed machine, or drop the task",
            )
    loaded["tasks"].update(got["tasks"])
    loaded["groups"].update(got.get("groups", {}))
    loaded["group_map"].update(got.get("group_map", {}))
    loaded["members"][entry] = list(got["tasks"]) + list(got.get("groups", {}))


def _data_error(entry: str, bench, err: Exception) -> UserError:
    reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".strip().rstrip(":")[:300]
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if entry in (bench.data or {}):
        if isinstance(chain[0], KeyError):  # the task's process_docs / templates read a column the files lack
            return UserError(
                f"benchmark.data.{entry}",
                f"the files have no column {chain[0]}, which the task reads",
                "give rows in the task's own schema (see its YAML and process_docs)",
            )
        if any(type(e).__name__ == "CastError" for e in chain):
            return UserError(
                f"benchmark.data.{entry}",
                "the files of its splits have different columns",
                "give every split rows of the same schema",
            )
        return UserError(
            f"benchmark.data.{entry}",
            f"cannot load the given files ({reason})",
            "give the split names the task evaluates (see its YAML) mapped to JSON-lines files",
        )
    return UserError(
        "benchmark.tasks",
        f"cannot load the data of '{entry}' ({reason})",
        f"run `python -m mergeval.check` to see what is missing and how to fetch it, or point the "
        f"task at local files with benchmark.data.{entry}",
    )


def _check_splits(name: str, task, given: list[str]) -> None:
    """Every split given in benchmark.data.<task> is one the task reads: a misspelt one (tset) was written into
    the override and never read, while the task went on evaluating its own test file."""
    reads = [s for s in (task.get_config(f"{k}_split") for k in ("test", "validation", "training", "fewshot")) if s]
    for split in given:
        if split not in reads:
            raise UserError(
                f"benchmark.data.{name}.{split}",
                f"{name} reads no split '{split}'",
                f"name the splits it reads: {', '.join(dict.fromkeys(reads))}",
            )


def _check_schema(name: str, task) -> None:
    """Render the first document of an overridden task the way the task will: other columns fail here."""
    try:
        docs = task.eval_docs
        doc = next(iter(docs))
        task.doc_to_text(doc)
        task.doc_to_target(doc)
        if task.get_config("output_type") == "multiple_choice":
            task.doc_to_choice(doc)
    except StopIteration:
        raise UserError(
            f"benchmark.data.{name}", f"'{name}' has no documents to evaluate", "give a split with at least one row"
        ) from None
    except Exception as err:
        raise UserError(
            f"benchmark.data.{name}",
            f"the data of '{name}' does not fit the task's schema ({type(err).__name__}: {str(err)[:200]})",
            "give the columns the task reads (see its YAML and process_docs)",
        ) from None


def _configure(loaded: dict, bench, eval_cfg) -> None:
    """Few-shot counts, the few-shot seed and generation kwargs, exactly as ``lm_eval`` applies its flags:
    ``benchmark.num_fewshot`` (all tasks) leaves a task whose own config says 0 at 0; ``benchmark.fewshot``
    (per entry; a group's count applies to its members) always applies; neither: the task's own count, else 0."""
    from mergeval.eval.harness import FEWSHOT_SEED

    per_entry = dict(bench.fewshot or {})
    entry_of = {m: e for e, members in loaded["members"].items() for m in members}
    gen_kwargs = dict(eval_cfg.gen_kwargs or {})
    for name, task in loaded["tasks"].items():
        own = task.get_config("num_fewshot")
        given = per_entry.get(entry_of.get(name))
        if given is not None:
            task.set_config(key="num_fewshot", value=int(given))
        elif bench.num_fewshot is not None and own != 0:
            task.set_config(key="num_fewshot", value=int(bench.num_fewshot))
        elif own is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
        field = (
            f"benchmark.fewshot.{entry_of.get(name)}"
            if given is not None
            else "benchmark.num_fewshot"
            if bench.num_fewshot is not None and own != 0
            else "benchmark.tasks"
        )
        _check_fewshot_pool(name, task, field)
        if gen_kwargs and task.get_config("output_type") == "generate_until":
            task.set_config(key="generation_kwargs", value=gen_kwargs, update=True)


def _check_fewshot_pool(name: str, task, field: str) -> None:
    """The task has the examples its few-shot count asks for (lm-eval draws one more from the evaluated split
    itself, and drops the question): else its sampler's ValueError ended the run as a traceback, at the first
    model's evaluation (the shipped medqa_4options has 4 training rows; benchmark.num_fewshot=5)."""
    k = int(task.get_config("num_fewshot") or 0)
    if k == 0:
        return
    sampler = getattr(task, "sampler", None)  # built with the task: its pool, already a list
    docs = sampler.df if sampler is not None else task.fewshot_docs()  # (fewshot_docs() processes them again)
    n = 0 if docs is None else len(docs)
    pool = task.get_config("fewshot_split") or task.get_config("training_split") or task.get_config("validation_split")
    same = pool == (task.get_config("test_split") or task.get_config("validation_split"))
    if n < k + same:
        raise UserError(
            field,
            f"{name} has {n} few-shot examples{' (one is the question itself)' if same else ''}, {k} asked",
            f"ask for at most {max(n - same, 0)} (benchmark.fewshot.<task> sets one task's)",
        )


def _task_metrics(task) -> list[str]:
    metrics = list(task.higher_is_better())
    filters = [f["name"] for f in task.get_config("filter_list") or []] or ["none"]
    return metric_keys(metrics, filters)


def _rows(entry: str, loaded: dict, bench, generated_dir: Path | None, leaf_digests: dict[str, str]) -> list[Row]:
    configured = dict(bench.metrics or {})
    rows = []
    group = loaded["groups"].get(entry)
    names = [entry] + ([m for m in loaded["members"][entry] if m != entry] if group is not None else [])
    for name in names:
        if name in loaded["tasks"]:
            task = loaded["tasks"][name]
            keys, hib = _task_metrics(task), task.higher_is_better()
            kind, output_type = "task", task.get_config("output_type")
            digest = task_digest(generated_dir, name) if generated_dir is not None else _leaf_digest(task, leaf_digests)
            leaves = [task]
        else:
            g = loaded["groups"][name]
            if not g.has_aggregation:
                continue  # lm-eval reports no score for it: its members are the rows
            leaves = g.get_all_tasks()
            keys = _group_metrics(g, leaves)
            hib = {}
            for leaf in leaves:
                hib = {**leaf.higher_is_better(), **hib}
            kind, output_type = "group", None
            digest = _hash(
                [json.dumps(g.to_dict(), sort_keys=True, default=str)]
                + sorted(_leaf_digest(t, leaf_digests) for t in leaves)
            )
        if not keys:
            continue
        chosen = configured.get(name) if name == entry else None
        metric = default_metric(keys) if chosen is None else normalize_key(chosen, keys)
        if metric is None:
            raise UserError(
                f"benchmark.metrics.{name}", f"'{chosen}' is not reported by {name}", f"choose one of {keys}"
            )
        higher = bool(hib.get(metric.split(",", 1)[0], True))
        counts = sorted({int(leaf.get_config("num_fewshot") or 0) for leaf in leaves})
        rows.append(
            Row(
                name,
                entry,
                kind,
                output_type,
                metric,
                tuple(keys),
                higher,
                digest,
                counted=name == entry and higher,
                num_fewshot=counts[0] if len(counts) == 1 else tuple(counts),
                generates=any(leaf.get_config("output_type") == "generate_until" for leaf in leaves),
            )
        )
    if not rows:
        raise UserError("benchmark.tasks", f"'{entry}' reports no metric", "choose a task or a group with scores")
    return rows


def _group_metrics(group, leaves) -> list[str]:
    keys = []
    for agg in group.aggregate_metric_list:
        filters = agg.filter_list
        if filters is None:  # lm-eval uses every filter its members report the metric under
            filters = sorted(
                {k.split(",", 1)[1] for leaf in leaves for k in _task_metrics(leaf) if k.split(",", 1)[0] == agg.metric}
            )
        keys += [f"{agg.metric},{f}" for f in ([filters] if isinstance(filters, str) else filters)]
    return keys


def _leaf_digest(task, known: dict[str, str]) -> str:
    if task.task_name not in known:
        known[task.task_name] = _config_digest(task)
    return known[task.task_name]


def _config_digest(task) -> str:
    """Hash of what a registry or directory task evaluates: its full config (functions by their source), and the
    bytes of any local data files (by content, so moving them keeps the digest)."""
    config = task.dump_config()
    if "cache_dir" in (config.get("dataset_kwargs") or {}):  # where datasets caches: not what is evaluated
        config = {**config, "dataset_kwargs": {k: v for k, v in config["dataset_kwargs"].items() if k != "cache_dir"}}
    if "config_source" in (config.get("metadata") or {}):  # the YAML file's path: where mergeval, lm-eval or the
        # cache is installed (a data override's directory is named by its data files' paths), not what is evaluated
        config = {**config, "metadata": {k: v for k, v in config["metadata"].items() if k != "config_source"}}
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    hashed = {split: _file_hash(Path(p)) for split, p in files.items()} if isinstance(files, dict) else files
    if files:
        config = {**config, "dataset_kwargs": {**config["dataset_kwargs"], "data_files": hashed}}
    return _hash([json.dumps(config, sort_keys=True, default=_render)])


def _render(value) -> str:
    import inspect

    try:
        return inspect.getsource(value)
    except (TypeError, OSError):
        return repr(value)


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else str(path)


def _hash(parts: list[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]
