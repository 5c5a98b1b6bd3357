"""An ``lm_eval`` command line's results file stored as one model's evaluation, so runs reuse it.

    python -m mergeval.results import RESULTS --model SOURCE [OVERRIDES...]

RESULTS is a ``results_<time>.json`` written by ``lm_eval --output_path`` (or
the directory holding exactly one); its ``samples_<task>_<time>.jsonl``
beside it are read when present. SOURCE is the evaluated model as a modelset
names it (a directory, ``zoo:tiny``, ``hf:org/name``); its content
fingerprint keys the evaluation. OVERRIDES compose the same config as
``python -m mergeval OVERRIDES``: its benchmark gives the tasks, their
digests and metrics, and its ``eval`` and ``benchmark`` settings the store
key (eval/settings.py), so a later run with those overrides finds the
evaluation and reports the model "reused from the results store".

Nothing is stored unless the file matches what that run would evaluate; the
first difference is one line naming the field (exit 2):

- settings (``config`` of the file): backend (``--model hf`` is
  ``eval.backend=hflm``, ``vllm`` is ``vllm``; a file mergeval exported
  names its scorer in ``mergeval_backend``), dtype (``model_args``),
  batch size, device, limit, generation kwargs, chat template, system
  instruction, multi-turn few-shot, few-shot seed (1234), bootstrap
  iterations (100000) and the lm-eval version;
- per task: ``versions``, ``n-shot``, ``n-samples`` (effective), the task's
  recorded ``configs`` entry (every prompt, target, split, metric and filter
  key; where the data lives is compared by content instead: each sample's
  ``doc`` against the benchmark's document of that ``doc_id`` when samples are
  present, else the bytes of local data files, else hub data set name,
  subset and revision);
- the model: when ``model_args.pretrained`` is a directory here, its
  fingerprint must be SOURCE's.

Tasks of the file outside the benchmark are skipped (listed); tasks of the
benchmark missing from the file are left for a run to evaluate. Samples of
multiple-choice tasks become mergeval's samples file (per-choice
log-likelihoods and gold index, eval/samples.py), so calibration and
consistency work on the imported evaluation too.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.eval.harness import BOOTSTRAP_ITERS, FEWSHOT_SEED

BACKENDS = {"hf": "hflm", "vllm": "vllm"}  # lm_eval --model -> eval.backend
_LOCATION_KEYS = {
    "task",
    "task_alias",
    "tag",
    "group",
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "metadata",
    "num_fewshot",
    "unsafe_code",
}  # compared otherwise (data) or separately (n-shot)


def find_files(path: Path) -> tuple[Path, dict[str, Path]]:
    """The results file and {task: samples file} written with it (same timestamp, same directory)."""
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"))
        if len(found) != 1:
            raise UserError(
                "RESULTS",
                f"{path} holds {len(found)} lm_eval results files",
                "give the path of one results_<time>.json",
            )
        path = found[0]
    if not path.is_file():
        raise UserError("RESULTS", f"no such file {path}", "give a results_<time>.json written by lm_eval")
    stamp = path.stem.removeprefix("results_")
    samples = {}
    for file in path.parent.glob(f"samples_*_{stamp}.jsonl"):
        samples[file.name.removeprefix("samples_").removesuffix(f"_{stamp}.jsonl")] = file
    return path, samples


def read_results(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            "RESULTS", f"cannot read {path} as JSON ({err})", "give a results file written by lm_eval"
        ) from None
    if not isinstance(data, dict) or not all(k in data for k in ("results", "config", "versions", "n-shot")):
        raise UserError(
            "RESULTS",
            f"{path} is not an lm_eval results file (no results/config/versions/n-shot)",
            "give a results_<time>.json written by lm_eval --output_path",
        )
    return data


def model_args(config: dict) -> dict:
    """``config.model_args`` as a dict (lm_eval records a dict, older versions the ``k=v,k=v`` string)."""
    args = config.get("model_args") or {}
    if isinstance(args, str):
        args = dict(part.split("=", 1) for part in args.split(",") if "=" in part)
    return args


def file_settings(data: dict) -> dict:
    """What the file records, under the names of mergeval's settings (eval/settings.py) and config fields."""
    config, args = data["config"], model_args(data["config"])
    dtype = str(args.get("dtype") or config.get("model_dtype") or "").removeprefix("torch.")
    return {
        "eval.backend": config.get("mergeval_backend") or BACKENDS.get(config.get("model"), config.get("model")),
        "eval.dtype": dtype or None,
        "eval.batch_size": config.get("batch_size"),
        "eval.device": config.get("device"),
        "benchmark.limit": config.get("limit"),
        "eval.gen_kwargs": config.get("gen_kwargs") or {},
        "eval.apply_chat_template": data.get("chat_template") is not None,
        "eval.system_instruction": data.get("system_instruction"),
        "eval.fewshot_as_multiturn": bool(data.get("fewshot_as_multiturn")),
        "fewshot_seed": config.get("fewshot_seed"),
        "bootstrap_iters": config.get("bootstrap_iters"),
        "lm_eval": data.get("lm_eval_version"),
    }


def check_settings(data: dict, cfg) -> None:
    """UserError at the first recorded setting that differs from what the run config would use."""
    from importlib.metadata import version

    got = file_settings(data)
    want = {
        "eval.backend": cfg.eval.backend,
        "eval.dtype": cfg.eval.dtype,
        "eval.batch_size": cfg.eval.batch_size,
        "eval.device": cfg.eval.device,
        "benchmark.limit": cfg.benchmark.limit,
        "eval.gen_kwargs": dict(cfg.eval.gen_kwargs or {}),
        "eval.apply_chat_template": bool(cfg.eval.apply_chat_template),
        "eval.system_instruction": cfg.eval.system_instruction,
        "eval.fewshot_as_multiturn": bool(cfg.eval.fewshot_as_multiturn),
        "fewshot_seed": FEWSHOT_SEED,
        "bootstrap_iters": BOOTSTRAP_ITERS,
        "lm_eval": version("lm_eval"),
    }
    for field, expected in want.items():
        if not _same(got[field], expected):
            fix = (
                f"import and run with {field}={got[field]}" if "." in field else f"run lm_eval with {field} {expected}"
            )
            if field not in ("eval.backend", "lm_eval") and "." in field:
                fix += f", or rerun lm_eval with {expected!r}"
            raise UserError(field, f"the results file has {got[field]!r}, the run would use {expected!r}", fix)


def _same(a, b) -> bool:
    """Equal as recorded: numbers and their strings alike (lm_eval writes batch_size "1"), dicts by JSON."""
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    return a == b or (a is not None and b is not None and str(a) == str(b))


def check_task(data: dict, name: str, task, docs: list, samples: list[dict] | None) -> None:
    """UserError when task ``name`` of the file is not what the benchmark's ``task`` evaluates on ``docs``."""
    field = f"RESULTS.{name}"
    own_version = (task.get_config("metadata") or {}).get("version")
    if not _same(data["versions"].get(name), own_version):
        raise UserError(
            f"versions.{name}",
            f"the results file has version {data['versions'].get(name)!r}, the "
            f"benchmark's task is version {own_version!r}",
            "evaluate the same task version with lm_eval, or let mergeval evaluate it",
        )
    shots = task.get_config("num_fewshot") or 0
    if not _same(data["n-shot"].get(name), shots):
        raise UserError(
            f"n-shot.{name}",
            f"the results file has {data['n-shot'].get(name)}-shot, the run would use {shots}-shot",
            f"run lm_eval with --num_fewshot {shots}, or set benchmark.num_fewshot / benchmark.fewshot.{name} to match",
        )
    effective = (data.get("n-samples", {}).get(name) or {}).get("effective")
    if effective != len(docs):
        raise UserError(
            f"n-samples.{name}",
            f"the results file scored {effective} documents, the run would score {len(docs)}",
            "evaluate the same split, data and limit",
        )
    recorded = (data.get("configs") or {}).get(name)
    if recorded is None:
        raise UserError(
            f"configs.{name}",
            "the results file does not record the task's config",
            "give the results file lm_eval wrote, unedited",
        )
    ours = task.dump_config()
    for key in sorted((set(recorded) | set(ours)) - _LOCATION_KEYS):
        if not _same(_plain(recorded.get(key)), _plain(ours.get(key))):
            raise UserError(
                f"configs.{name}.{key}",
                "the results file's task differs from the benchmark's "
                f"({_short(recorded.get(key))} vs {_short(ours.get(key))})",
                "evaluate the benchmark's own task definition with lm_eval",
            )
    _check_data(field, recorded, ours, docs, samples)


def _plain(value):
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_data(field: str, recorded: dict, ours: dict, docs: list, samples: list[dict] | None) -> None:
    """The documents are the benchmark's: by the samples' docs, else local files' bytes, else hub identity."""
    if samples is not None:
        for row in samples:
            doc_id = row.get("doc_id")
            if (
                not isinstance(doc_id, int)
                or not 0 <= doc_id < len(docs)
                or _plain(row.get("doc")) != _plain(docs[doc_id])
            ):
                raise UserError(
                    field,
                    f"the samples' document {doc_id} is not the benchmark's",
                    "evaluate the benchmark's data with lm_eval",
                )
        return
    theirs, mine = _data_files(recorded), _data_files(ours)
    if mine or theirs:
        for split, path in mine.items():
            other = theirs.get(split)
            if other is None or not Path(other).is_file():
                raise UserError(
                    field,
                    f"cannot verify the data: the {split} file lm_eval read ({other}) is not here",
                    "import with the samples (lm_eval --log_samples) or where the files are",
                )
            if _sha(Path(other)) != _sha(Path(path)):
                raise UserError(
                    field,
                    f"lm_eval read a different {split} file ({other})",
                    "evaluate the benchmark's data with lm_eval",
                )
        return
    for key in ("dataset_path", "dataset_name"):
        if recorded.get(key) != ours.get(key):
            raise UserError(
                field,
                f"lm_eval read {key} {recorded.get(key)!r}, the benchmark reads {ours.get(key)!r}",
                "evaluate the benchmark's data set with lm_eval",
            )
    revision = [(c.get("dataset_kwargs") or {}).get("revision") for c in (recorded, ours)]
    if revision[0] != revision[1]:
        raise UserError(
            field,
            f"lm_eval read revision {revision[0]!r}, the benchmark reads {revision[1]!r}",
            "evaluate the same revision",
        )


def _data_files(config: dict) -> dict[str, str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    return {k: v for k, v in files.items() if isinstance(v, str)} if isinstance(files, dict) else {}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mergeval_samples(task, rows: list[dict]) -> list[dict]:
    """lm_eval's logged multiple-choice samples as mergeval's: {doc_id, lls (per choice), gold}."""
    from mergeval.eval.samples import gold_index

    return [
        {
            "doc_id": r["doc_id"],
            "lls": [float(resp[0]) for resp in r["filtered_resps"]],
            "gold": gold_index(task, r["doc"]),
        }
        for r in sorted(rows, key=lambda r: r["doc_id"])
    ]


def import_results(cfg, results: Path, model_spec: str) -> dict:
    """Check the file against the run config ``cfg`` and store it (module docstring). Returns
    {model, fingerprint, stored: {task: score}, skipped: [tasks], missing: [tasks], samples: path or None}."""
    from mergeval.core.outcome import ModelInfo
    from mergeval.core.paths import cache_root
    from mergeval.core.runtime import apply_offline
    from mergeval.eval import samples as samples_io
    from mergeval.eval.harness import _row_score
    from mergeval.eval.settings import eval_settings
    from mergeval.eval.suite import build_suite
    from mergeval.models.fingerprint import fingerprint, model_identity
    from mergeval.models.zoo.sources import resolve_source
    from mergeval.results.store import open_store, record_models, settings_hash

    apply_offline(cfg.offline)
    cache = cache_root(cfg.cache_dir)
    path, sample_files = find_files(results)
    data = read_results(path)
    check_settings(data, cfg)
    model_dir = resolve_source(model_spec, "--model", cache, cfg.offline)
    weights = fingerprint(model_dir, cache / "fingerprints.json", "--model")
    # lm_eval evaluated it with its own config and tokenizer: the scores are stored under that identity (a run
    # reuses them for an expert whose tokenizer files are the base's, as a run evaluates it with the base's)
    fp = model_identity(weights, model_dir)
    pretrained = model_args(data["config"]).get("pretrained")
    if (
        isinstance(pretrained, str)
        and Path(pretrained).expanduser().is_dir()
        and Path(pretrained).expanduser().resolve() != model_dir
    ):
        theirs = fingerprint(Path(pretrained).expanduser().resolve(), cache / "fingerprints.json", "RESULTS")
        if theirs != weights:
            raise UserError(
                "--model",
                f"the results are of {pretrained} (fingerprint {theirs}), not of {model_spec} ({weights})",
                "give the model lm_eval evaluated",
            )
    suite = build_suite(cfg.benchmark, cfg.eval, cache)
    names = [n for n in suite.names if n in data["results"]]
    if not names:
        raise UserError(
            "RESULTS",
            f"none of the benchmark's tasks ({', '.join(suite.names)}) is in {path.name}",
            "compose the benchmark the file was evaluated on (+experiment=..., benchmark.tasks=...)",
        )
    task_dict = suite.subset(suite.entries)
    kept: dict[str, list[dict]] = {}
    logged: dict[str, list[dict]] = {}  # lm_eval's sample rows: each item's metrics (the store's item outcomes)
    for name in names:
        if name not in suite.loaded["tasks"]:
            continue  # a group: its members are checked
        task = suite.task(name)
        docs = list(task.eval_docs)
        docs = docs[: int(cfg.benchmark.limit) if cfg.benchmark.limit and cfg.benchmark.limit >= 1 else None]
        rows = read_samples(sample_files[name]) if name in sample_files else None
        check_task(data, name, task, docs, rows)
        if rows is not None:
            logged[name] = rows
        if rows is not None and task.get_config("output_type") == "multiple_choice":
            kept[name] = mergeval_samples(task, rows)
    out = {"results": data["results"], "n-samples": data.get("n-samples", {}), "samples": logged}
    scores = {name: _row_score(out, name, suite.rows[name].metric, task_dict).stored() for name in names}
    settings, digests = suite.per_task(eval_settings(cfg)), {n: suite.digests[n] for n in names}
    store = open_store(cfg, cache)
    record_models(store, [ModelInfo("imported", model_spec, fp, str(model_dir), weights=weights)])
    kept_path = None
    if kept:
        kept_path = str(samples_io.write(samples_io.path_for(cache, fp, settings_hash(settings.run), digests), kept))
    store.put_scores(fp, digests, settings, scores, samples_path=kept_path)
    return {
        "model": model_spec,
        "fingerprint": fp,
        "file": str(path),
        "stored": scores,
        "samples": kept_path,
        "skipped": [t for t in data["results"] if t not in suite.rows],
        "missing": [n for n in suite.names if n not in data["results"]],
    }


def _number(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def main(argv: list[str]) -> int:
    """``python -m mergeval.results import RESULTS --model SOURCE [OVERRIDES...]``; 0, or 2 with one line."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m mergeval.results import", description="Store an lm_eval results file as one model's evaluation."
    )
    parser.add_argument("results", help="results_<time>.json written by lm_eval (or the directory holding it)")
    parser.add_argument("--model", required=True, help="the evaluated model: a directory, zoo:NAME or hf:ORG/NAME")
    parser.add_argument("overrides", nargs="*", help="the run's config overrides, e.g. +experiment=tiny")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = compose_run_config(args.overrides)
        done = import_results(cfg, Path(args.results).expanduser(), args.model)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return 2
    print(
        f"imported {len(done['stored'])} task(s) of {done['model']} (fingerprint {done['fingerprint']}) "
        f"from {done['file']}"
    )
    for name, s in done["stored"].items():
        print(f"  {name}: {s['metric']} = {_number(s['value'])} ± {_number(s['stderr'])} (n={s['n']})")
    if done["samples"]:
        print(f"  samples: {done['samples']}")
    for label in ("skipped", "missing"):
        if done[label]:
            what = "not in the benchmark" if label == "skipped" else "not in the file (a run evaluates them)"
            print(f"  {label}: {', '.join(done[label])} ({what})")
    return 0


def compose_run_config(overrides: list[str]):
    """The config ``python -m mergeval OVERRIDES`` would run with."""
    from hydra import compose, initialize_config_module

    from mergeval.run.config import register_configs

    register_configs()
    try:
        with initialize_config_module("mergeval.run.conf", version_base="1.3"):
            return compose("config", overrides=list(overrides))
    except Exception as err:  # noqa: BLE001  Hydra's composition errors: an unknown key, a bad value
        words = " ".join(line.strip() for line in f"{err} {err.__cause__ or ''}".splitlines() if line.strip())
        raise UserError("OVERRIDES", words, "give overrides `python -m mergeval` accepts") from None
