"""lm-eval-harness on models held in memory: every output type, the metric each row reports.

``HFLM(pretrained=<model object>)`` wraps a live model, so a merge is scored
without being written to disk. By default the model is wrapped in
``SharedPrefixLM`` (eval/scorer.py), an HFLM that runs each question's context
once for all its choices; its generation (``generate_until``) and rolling
log-likelihoods are HFLM's own code, batched as HFLM batches them.
``eval.backend=hflm`` uses lm-eval's HFLM as is; ``eval.backend=vllm`` writes
the model once to a temporary directory and serves it through lm-eval's vLLM
backend (GPU machines with vllm installed). lm-eval's own request cache is
never used: it is keyed without the model and would hand one checkpoint's
answers to another.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mergeval.core.errors import UserError
from mergeval.eval.samples import collect

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FEWSHOT_SEED = 1234  # lm-eval's default few-shot sampling seed, fixed so runs are comparable
BOOTSTRAP_ITERS = 100000  # lm-eval evaluate()'s default, which mergeval uses
BACKENDS = ("shared_prefix", "hflm", "vllm")


@dataclass(frozen=True)
class TaskScore:
    """One row's result: the reported metric, every metric the row has (``key -> [value, stderr]``) and, for
    each metric that is a mean over items, every item's value (``key -> {"ids": [..], "values": [..]}``: the
    outcomes paired comparisons need, metrics/paired.py)."""

    metric: str
    value: float
    stderr: float | None  # None where lm-eval gives none (perplexities, a single item)
    n: int
    metrics: dict[str, list]
    items: dict[str, dict] | None = None

    def as_dict(self) -> dict:
        """The reported metric, with its items where it has them (``items``: None otherwise)."""
        return {
            "metric": self.metric,
            "value": self.value,
            "stderr": self.stderr,
            "n": self.n,
            "items": (self.items or {}).get(self.metric),
        }

    def stored(self) -> dict:
        """What the results store keeps: ``as_dict`` with every metric and every metric's items."""
        return {**self.as_dict(), "metrics": self.metrics, "items_by_metric": self.items}


def check_backend(backend: str, device: str) -> None:
    """One line, before any work, for a backend or device this machine cannot serve."""
    if backend not in BACKENDS:
        raise UserError("eval.backend", f"unknown backend '{backend}'", f"use one of {', '.join(BACKENDS)}")
    if device.startswith("cuda") or backend == "vllm":
        import torch

        if not torch.cuda.is_available():
            field = "eval.device" if device.startswith("cuda") else "eval.backend"
            raise UserError(
                field,
                f"{'vllm needs' if backend == 'vllm' else device + ' needs'} a CUDA GPU, and torch sees none here",
                "run on a GPU machine, or set eval.device=cpu eval.backend=shared_prefix",
            )
    if backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise UserError(
                "eval.backend", "vllm is not installed", "pip install vllm, or use eval.backend=shared_prefix"
            ) from None


class Harness:
    """The rows of some benchmark entries; ``score`` evaluates one model on all of them."""

    @classmethod
    def for_run(cls, cfg, suite, entries: list[str], limit: int | None) -> Harness:
        """The harness a run's config asks for (eval.batch_size, eval.backend, prompting settings)."""
        return cls(suite, entries, cfg.eval.batch_size, limit, cfg.eval.backend, prompting(cfg.eval))

    def __init__(
        self,
        suite,
        entries: list[str],
        batch_size: int,
        limit: int | None,
        backend: str = "shared_prefix",
        prompting: dict | None = None,
    ):
        self.suite, self.entries, self.rows = suite, entries, suite.rows_of(entries)
        self.task_dict = suite.subset(entries)
        self.batch_size, self.limit, self.backend = batch_size, limit, backend
        self.prompting = prompting or {}

    def score(self, model, tokenizer, samples: dict[str, list[int]] | None = None) -> dict[str, TaskScore]:
        """Scores per row. ``samples`` (task -> item indices; needs ``limit=None``) scores only those items.
        Afterwards ``self.requests`` holds the requests run per task (cost accounting) and ``self.samples``
        each multiple-choice item's per-choice log-likelihoods and gold index (eval/samples.py)."""
        from lm_eval.evaluator import evaluate

        lm, cleanup = _language_model(self.backend, model, tokenizer, self.batch_size)
        try:
            out = evaluate(
                lm=lm,
                task_dict=self.task_dict,
                limit=self.limit,
                samples=samples,
                log_samples=True,
                verbosity="ERROR",
                **self.prompting,
            )
        finally:
            cleanup()
        tasks = self.task_dict["tasks"]
        self.requests = {name: len(task.instances) for name, task in tasks.items()}
        self.samples = collect(tasks, [n for n, t in tasks.items() if t.get_config("output_type") == "multiple_choice"])
        return {name: _row_score(out, name, self.suite.rows[name].metric, self.task_dict) for name in self.rows}


def prompting(eval_cfg) -> dict:
    """The settings lm-eval's evaluate() takes (chat template, system instruction, multi-turn few-shot, code runs)."""
    if eval_cfg.allow_code_execution:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # the code_eval metric's own opt-in
    return {
        "apply_chat_template": bool(eval_cfg.apply_chat_template),
        "system_instruction": eval_cfg.system_instruction,
        "fewshot_as_multiturn": bool(eval_cfg.fewshot_as_multiturn),
        "confirm_run_unsafe_code": bool(eval_cfg.allow_code_execution),
    }


def _row_score(out: dict, name: str, metric: str, task_dict: dict) -> TaskScore:
    res = out["results"][name]
    metrics: dict[str, list] = {}
    for key, value in res.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
            continue
        m, f = key.split(",", 1)
        stderr = res.get(f"{m}_stderr,{f}")
        metrics[key] = [
            float(value),
            float(stderr) if isinstance(stderr, (int, float)) and not math.isnan(stderr) else None,
        ]
    if metric not in metrics:
        raise RuntimeError(f"lm-eval reported no {metric} for {name} (got {sorted(metrics)})")
    if name in task_dict["tasks"]:
        n = int(out["n-samples"][name]["effective"])
    else:
        n = sum(int(out["n-samples"][t.task_name]["effective"]) for t in task_dict["groups"][name].get_all_tasks())
    value, stderr = metrics[metric]
    return TaskScore(metric, value, stderr, n, metrics, _item_outcomes(out, name, task_dict, metrics))


def _item_outcomes(out: dict, name: str, task_dict: dict, metrics: dict[str, list]) -> dict[str, dict]:
    """metric key -> {"ids", "values"}: each item's value, for every metric whose reported value is the mean of
    its items' (acc, acc_norm, exact_match, ...; not corpus-level ones such as bleu, f1 over a corpus or
    perplexity, whose items are not numbers or do not average to the score). A group's items are its tasks'
    items in order, ids ``"task/doc_id"``, kept where the group's value is their plain mean (weighted by size)."""
    if name in task_dict["tasks"]:
        parts = [(name, out.get("samples", {}).get(name, []), False)]
    else:
        parts = [
            (t.task_name, out.get("samples", {}).get(t.task_name, []), True)
            for t in task_dict["groups"][name].get_all_tasks()
        ]
    per: dict[str, tuple[list, list]] = {}
    for task, logged, prefixed in parts:
        for sample in sorted(logged, key=lambda s: s["doc_id"]):
            for metric in sample.get("metrics", []):
                value = sample.get(metric)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    continue
                ids, values = per.setdefault(f"{metric},{sample['filter']}", ([], []))
                ids.append(f"{task}/{sample['doc_id']}" if prefixed else sample["doc_id"])
                values.append(int(value) if float(value).is_integer() else float(value))
    kept = {}
    for key, (ids, values) in per.items():
        reported = metrics.get(key, [None])[0]
        if (
            reported is not None
            and values
            and math.isclose(math.fsum(values) / len(values), reported, rel_tol=1e-6, abs_tol=1e-9)
        ):
            kept[key] = {"ids": ids, "values": values}
    return kept


def _language_model(backend: str, model, tokenizer, batch_size: int):
    """(lm-eval LM, cleanup) for the backend: the live model wrapped, or (vllm) a temporary copy on disk."""
    from lm_eval.models.huggingface import HFLM

    if backend == "vllm":
        return _vllm(model, tokenizer)
    from mergeval.eval.scorer import SharedPrefixLM

    lm = (SharedPrefixLM if backend == "shared_prefix" else HFLM)(
        pretrained=model, tokenizer=tokenizer, batch_size=batch_size
    )
    return lm, lambda: None


def _vllm(model, tokenizer):
    """lm-eval's vLLM backend over the model written once to a temporary directory (removed afterwards)."""
    import shutil
    import tempfile

    from lm_eval.models.vllm_causallms import VLLM

    tmp = tempfile.mkdtemp(prefix="mergeval-vllm-")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        lm = VLLM(pretrained=tmp, dtype=dtype, batch_size="auto", seed=0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return lm, lambda: shutil.rmtree(tmp, ignore_errors=True)
