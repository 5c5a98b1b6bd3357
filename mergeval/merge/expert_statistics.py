"""Calibration data and the per-expert statistics that data-aware merges need (Fisher merging, RegMean).

A modelset expert names its calibration data::

    experts:
      chem: {domain: chem_count, task: mergeval_chem_count,
             calibration: {task: chem_count, split: train, n: 64}}

``task`` is a generated domain (``chem_count``, ``unit_convert``), a generated
task (``mergeval_chem_count``, its lettered ``_mc`` twin asks the same items),
or any other lm-eval task (its own train / validation documents, never the split
it is scored on: ``eval/merge_examples.py``). For generated data
``split`` is ``train`` (the first ``n`` items of the domain's training stream:
what a zoo expert with ``train.seed=0`` was fine-tuned on, disjoint from every
evaluation item) or ``validation`` (the last ``n`` items of the task's held-out
pool, disjoint from the first ``benchmark.n_items`` test items; checked). The
test split is never used: it is what the merge is scored on. Each item is
rendered exactly as in fine-tuning (``zoo.finetune``): ``Question: q\\nAnswer: a``
plus end-of-sequence, and only the answer tokens count as the example's
log-likelihood.

Statistics (``KINDS``), computed from one expert with its own calibration data,
one model in memory at a time:

    fisher   F[p] = (1/n) sum_x (d/dp log p(answer_x | prompt_x))^2
             the diagonal empirical Fisher: one forward and one backward pass per
             example (batch 1), squared per-example gradients, every parameter.
    gram     G[m] = (1/T) sum_x X_m,x^T X_m,x
             for every nn.Linear m inside the model (lm_head excluded), X_m,x the
             (tokens x in_features) inputs of m on example x and T the total
             number of tokens: one forward pass per example (forward hooks).
             Linear layers fed the very same tensor (q/k/v, gate/up) share one
             matrix, stored once (``aliases``).
    localize g[p] = sum_x d/dp (-log p(answer_x | prompt_x) / |answer_x|) at the
             soft-masked model (Localize-and-Stitch's mask step; ``localize_gradient``),
             ``BATCH`` examples per forward and backward pass.

Each is cached under ``<cache>/statistics/<kind>-<key>/`` (``stats.safetensors``
and ``meta.json``, written atomically) with ``key`` = sha256 of (kind, model
fingerprint, data digest, n, STATS_VERSION[kind]): later runs and sweeps reuse it.
The merge reads it one tensor at a time (``read_stat``), so memory stays
bounded by one layer's statistics per expert.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import atomic_dir
from mergeval.methods.statistics import META_FILE, STATS_FILE, read_stat  # noqa: F401  (the layout the methods read)

# A statistic's implementation version, part of its cache key: raised when the same model and data give other
# numbers. localize 2: examples batched (the same sum, another float summation order).
STATS_VERSION = {"fisher": 1, "gram": 1, "localize": 2}
CUT_VERSION = 1  # the cached magnitude cuts (``magnitude_cut``)
BATCH = 16  # examples per forward + backward where a statistic sums over them (localize)
KINDS = ("fisher", "gram", "localize")
SPLITS = ("train", "validation")


# ---------------------------------------------------------------- data


def _domain_and_task(task: str, field: str) -> tuple[str | None, str] | None:
    """(training domain or None, held-out task name) of a generated calibration task; None for an lm-eval task
    (any other name, loaded when its examples are drawn: eval/merge_examples.py)."""
    from mergeval.eval.tasks import GENERATED, PREFIX, items_of
    from mergeval.models.zoo.domains import DOMAINS

    if task in DOMAINS:
        return task, PREFIX + task
    if task in GENERATED:
        cloze = items_of(task)
        domain = cloze.removeprefix(PREFIX)
        return (domain if domain in DOMAINS else None), cloze
    if not task.startswith(PREFIX):
        return None
    choices = sorted(DOMAINS) + sorted(GENERATED)
    raise UserError(
        f"{field}.task",
        f"unknown calibration task {task!r}",
        f"choose a generated domain or task ({', '.join(choices)}) or an lm-eval task",
    )


def check_calibration(cal, field: str, n_test: int) -> None:
    """The checks of one expert's calibration config that need no data (one line each)."""
    if cal.split == "test":
        raise UserError(
            f"{field}.split",
            "calibration never uses the test split (the items the merge is scored on)",
            f"set {field}.split=train or {field}.split=validation",
        )
    if cal.split not in SPLITS:
        raise UserError(f"{field}.split", f"unknown split {cal.split!r}", f"set {field}.split=train or validation")
    if not isinstance(cal.n, int) or cal.n < 1:
        raise UserError(f"{field}.n", f"must be a positive number of items, got {cal.n!r}", f"set e.g. {field}.n=64")
    if cal.task is None:
        raise UserError(
            f"{field}.task", "no calibration task", f"set {field}.task to a generated domain, e.g. chem_count"
        )
    generated = _domain_and_task(cal.task, field)
    if generated is None:  # an lm-eval task: its splits are checked when it is loaded
        return
    domain, name = generated
    if cal.split == "train" and domain is None:
        raise UserError(
            f"{field}.split",
            f"{cal.task} has no training split (its items are all held out)",
            f"set {field}.split=validation",
        )
    if cal.split == "validation":
        from mergeval.eval.tasks import POOL

        if cal.n + n_test > POOL[name]:
            raise UserError(
                f"{field}.n",
                f"{name} holds {POOL[name]} held-out items, fewer than {n_test} test + {cal.n} validation",
                f"lower {field}.n or benchmark.n_items",
            )


def calibration_items(cal, field: str, n_test: int, bench=None, eval_cfg=None, cache: Path | None = None) -> list[dict]:
    """The calibration items (module docstring); never the test split. An lm-eval task (loaded with the run's
    ``bench`` settings: include_path, data) gives ``{context, continuation}`` examples instead."""
    check_calibration(cal, field, n_test)
    generated = _domain_and_task(cal.task, field)
    if generated is None:
        if bench is None or cache is None:  # an lm-eval task is loaded with the run's settings and cache
            raise UserError(
                f"{field}.task",
                f"{cal.task} is not a generated domain or task",
                "name one of mergeval's generated domains",
            )
        from mergeval.eval.merge_examples import registry_examples

        return registry_examples(cal.task, cal.split, cal.n, bench, eval_cfg, cache, field)
    domain, name = generated
    if cal.split == "train":
        assert domain is not None, "check_calibration refuses the train split of a task without a training domain"
        from mergeval.models.zoo.domains import split_items
        from mergeval.models.zoo.experts import EVAL_POOL

        return split_items(domain, seed=0, n_train=cal.n, n_eval=EVAL_POOL, train_seed=0)[0]
    from mergeval.eval.tasks import task_items

    return task_items(name, n_test, "validation", cal.n)


def data_digest(items: list[dict]) -> str:
    """sha256 of the items as rendered for the model (prompt, answer), first 16 hex digits."""
    from mergeval.models.zoo.finetune import prompt

    if items and "context" in items[0]:  # an lm-eval task's examples
        rows = [[i["context"], i["continuation"]] for i in items]
        return hashlib.sha256(json.dumps({"rows": rows, "format": "lm-eval-1"}).encode()).hexdigest()[:16]
    rows = [[prompt(i["question"]), i["choices"][i["answer"]]] for i in items]
    return hashlib.sha256(json.dumps({"rows": rows, "format": 1}).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- statistics


def stats_key(kind: str, fingerprint: str, digest: str, n: int, point: dict | None = None) -> str:
    payload = {"kind": kind, "model": fingerprint, "data": digest, "n": n, "version": STATS_VERSION[kind]}
    if point:  # localize: where the gradient is taken (base fingerprint, magnitude cut, sigmoid bias)
        payload["point"] = {k: v for k, v in point.items() if k != "base_dir"}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def statistics_dir(
    kind: str,
    model_dir: Path,
    fingerprint: str,
    items: list[dict],
    cache: Path,
    label: str = "",
    point: dict | None = None,
) -> tuple[Path, bool]:
    """(the cached statistics directory, whether it was computed now); computed once per (model, data, n)."""
    digest = data_digest(items)
    target = cache / "statistics" / f"{kind}-{stats_key(kind, fingerprint, digest, len(items), point)}"
    if target.exists():
        return target, False
    print(
        f"mergeval: calibration: computing {kind} statistics of {label or model_dir.name} on {len(items)} items",
        flush=True,
    )
    tensors, meta = compute(kind, model_dir, items, point)
    from safetensors.torch import save_file

    with atomic_dir(target) as tmp:
        save_file(tensors, str(tmp / STATS_FILE), metadata={"format": "pt"})
        (tmp / META_FILE).write_text(
            json.dumps(
                {
                    "kind": kind,
                    "model": fingerprint,
                    "data": digest,
                    "n": len(items),
                    "version": STATS_VERSION[kind],
                    **meta,
                },
                indent=1,
            )
        )
    return target, True


def compute(kind: str, model_dir: Path, items: list[dict], point: dict | None = None):
    """(name -> float32 tensor, extra metadata) of one statistic of the model in ``model_dir``."""
    import torch
    from transformers import AutoTokenizer

    from mergeval.models.checkpoint import load_model

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, dtype=torch.float32)
    examples = [_example(tokenizer, item) for item in items]
    if kind == "localize":
        assert point is not None, "a localize statistic is taken at a point"
        return localize_gradient(model, Path(point["base_dir"]), point["cut"], point["sigmoid_bias"], examples)
    return fisher(model, examples) if kind == "fisher" else gram(model, examples)


def _example(tokenizer, item):
    """(ids, attention mask, labels) of one example, labels only on the answer tokens."""
    if "context" not in item:
        from mergeval.models.zoo.finetune import _batch  # the fine-tuning format: answer-only labels

        return _batch(tokenizer, [item])
    import torch

    start = len(tokenizer(item["context"])["input_ids"])  # lm-eval's loglikelihood: no end-of-sequence token
    full = tokenizer(item["context"] + item["continuation"])["input_ids"]
    ids = torch.tensor([full])
    labels = torch.full_like(ids, -100)
    labels[0, start:] = ids[0, start:]
    return ids, torch.ones_like(ids), labels


def answer_log_likelihood(model, ids, mask, labels, per_example_mean: bool = False):
    """sum over the answer tokens of log p(token | preceding tokens); ``per_example_mean``: the sum over the
    batch's rows of each row's mean over its own answer tokens. As in fine-tuning (models/zoo/finetune.py), the
    LM head runs only at the answer positions when the model exposes its trunk (``model.model``): the
    vocabulary projection is the costliest layer of a small model."""
    import torch

    targets = labels[:, 1:]
    scored = targets != -100
    trunk, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if trunk is not None and head is not None:
        hidden = trunk(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = head(hidden[:, :-1][scored]).float()
    else:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1][scored].float()
    if not per_example_mean:
        return -torch.nn.functional.cross_entropy(logits, targets[scored], reduction="sum")
    nll = torch.nn.functional.cross_entropy(logits, targets[scored], reduction="none")
    rows = scored.nonzero()[:, 0]  # each scored token's row, in the order boolean indexing flattens them
    return -(nll / scored.sum(1)[rows]).sum()


def _progress(examples, desc: str):
    from tqdm.auto import tqdm

    return tqdm(examples, desc=desc, unit="item", disable=None)  # a bar only on a terminal


def fisher(model, examples) -> tuple[dict, dict]:
    """F[p] = mean over examples of the squared gradient of the example's answer log-likelihood."""
    import torch

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    for ids, mask, labels in _progress(examples, "fisher (forward + backward per item)"):
        model.zero_grad(set_to_none=True)
        answer_log_likelihood(model, ids, mask, labels).backward()
        for n, p in params.items():
            if p.grad is not None:
                acc[n].add_(p.grad.float().square())
    model.zero_grad(set_to_none=True)
    return {n: (a / len(examples)).contiguous() for n, a in acc.items()}, {}


def localize_gradient(model, base_dir: Path, cut: float, bias: float, examples) -> tuple[dict, dict]:
    """g = sum_x grad L_x at the soft-masked model b + sigmoid(S0) * tau (tau = e - b; S0 = +bias where
    |tau| >= cut, else -bias), L_x the mean token cross-entropy of example x's answer: the gradient
    Localize-and-Stitch's mask step multiplies (see methods/masks.py)."""
    import torch

    from mergeval.merge.reader import CheckpointReader

    base = CheckpointReader(base_dir, "modelset.base")
    inside, outside = torch.sigmoid(torch.tensor(bias)).item(), torch.sigmoid(torch.tensor(-bias)).item()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in params.items():
            b = base.get(n).float()
            tau = p - b
            p.copy_(b + torch.where(tau.abs() >= cut, inside, outside) * tau)
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    # The gradient of a sum is the sum of the gradients: BATCH examples per backward pass, each example's
    # loss still divided by its own answer tokens (per_example_mean).
    for ids, mask, labels in _progress(padded_batches(examples, BATCH), "localize (forward + backward per batch)"):
        model.zero_grad(set_to_none=True)
        answer_log_likelihood(model, ids, mask, labels, per_example_mean=True).neg().backward()
        for n, p in params.items():
            if p.grad is not None:
                acc[n].add_(p.grad.float())
    model.zero_grad(set_to_none=True)
    return {n: a.contiguous() for n, a in acc.items()}, {"cut": cut, "sigmoid_bias": bias}


def padded_batches(examples, size: int):
    """Examples (ids, mask, labels; one row each) in right-padded batches of ``size``: a causal model's real
    tokens never see the padding after them, so each row scores as it does alone (up to float rounding)."""
    import torch

    for start in range(0, len(examples), size):
        chunk = examples[start : start + size]
        width = max(ids.shape[1] for ids, _, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=chunk[0][0].dtype)
        mask = torch.zeros((len(chunk), width), dtype=chunk[0][1].dtype)
        labels = torch.full((len(chunk), width), -100, dtype=chunk[0][2].dtype)
        for row, (i, m, lab) in enumerate(chunk):
            ids[row, : i.shape[1]], mask[row, : m.shape[1]], labels[row, : lab.shape[1]] = i[0], m[0], lab[0]
        yield ids, mask, labels


def gram(model, examples) -> tuple[dict, dict]:
    """G[m] = (1/T) sum of X^T X over the inputs X of each nn.Linear m (lm_head excluded); shared inputs once."""
    import torch

    linears = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head" and not n.endswith(".lm_head")
    }
    acc: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    live: dict[int, tuple[torch.Tensor, str]] = {}  # this forward's inputs (kept alive, so ids stay unique)
    tokens = 0

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0]
            seen = live.get(id(x))
            if seen is not None and seen[0] is x:
                aliases.setdefault(name, seen[1])
                return
            live[id(x)] = (x, name)
            flat = x.detach().reshape(-1, x.shape[-1]).float()
            g = flat.T @ flat
            acc[name] = acc[name].add_(g) if name in acc else g

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            for ids, mask, _ in _progress(examples, "gram (forward per item)"):
                live.clear()
                model(input_ids=ids, attention_mask=mask)
                tokens += int(mask.sum())
    finally:
        for h in handles:
            h.remove()
        live.clear()
    tensors = {f"{n}.weight": (g / tokens).contiguous() for n, g in acc.items() if n not in aliases}
    return tensors, {"tokens": tokens, "aliases": {f"{n}.weight": f"{o}.weight" for n, o in aliases.items()}}


# ---------------------------------------------------------------- a run's statistics


def fill_statistics(cfg, method_name: str, kind: str, method_cfg, models, cache: Path, base_dir: Path | None = None):
    """``method_cfg.statistics`` = each expert's statistics directory (computed once, then cached), in modelset
    order; returns (new method config, details for result.json). Refused with one line for an expert without
    calibration data."""
    import dataclasses

    details = {}
    paths: list[str] = []
    for info in models:
        if info.role == "base":
            continue
        expert = cfg.modelset.experts[info.role]
        field = f"modelset.experts.{info.role}.calibration"
        cal = expert.get("calibration") if hasattr(expert, "get") else getattr(expert, "calibration", None)
        if cal is None:
            raise UserError(
                field,
                f"method {method_name} needs calibration data for every expert",
                f"set {field}={{task: {expert.get('domain') or '<generated domain>'}, split: train, n: 64}}",
            )
        items = calibration_items(cal, field, cfg.benchmark.n_items, cfg.benchmark, cfg.eval, cache)
        point = None
        if kind == "localize":  # the gradient is taken at the expert's soft-masked model
            point = {
                "base": models[0].fingerprint,
                "base_dir": str(base_dir),
                "sigmoid_bias": method_cfg.sigmoid_bias,
                "cut": method_cfg.thresholds[len(paths)],
            }
        path, fresh = statistics_dir(kind, Path(info.path), info.fingerprint, items, cache, info.role, point)
        paths.append(str(path))
        details[info.role] = {
            "kind": kind,
            "task": cal.task,
            "split": cal.split,
            "n": cal.n,
            "data_digest": data_digest(items),
            "path": str(path),
            "computed": "this run" if fresh else "reused from the cache",
        }
    return dataclasses.replace(method_cfg, statistics=paths), {"statistics": details}


# ---------------------------------------------------------------- data-free: magnitude cuts (localize_stitch)


def kth_largest_delta(base_dir: Path, expert_dir: Path, k: int) -> float:
    """The k-th largest |e - b| over every floating-point tensor of a checkpoint pair, exactly, in two streamed
    passes with O(65536) memory: non-negative float32 values order as their bit patterns do, so a histogram of
    the high 16 bits finds the bucket of the k-th value and one of the low 16 bits inside it finds the value."""
    import torch

    from mergeval.merge.reader import CheckpointReader

    base, expert = CheckpointReader(base_dir, "modelset.base"), CheckpointReader(expert_dir, "modelset.experts")
    names = [n for n in base.names() if base.dtypes[n].is_floating_point]

    def bits(name):
        b, e = base.get(name).float(), expert.get(name).float()
        rows = min(b.shape[0], e.shape[0]) if b.dim() else None  # vocab policies: the rows both have
        d = (e[:rows] - b[:rows]) if rows is not None else e - b
        return d.abs().flatten().contiguous().view(torch.int32)

    high = torch.zeros(1 << 16, dtype=torch.int64)
    for n in names:
        high += torch.bincount(bits(n) >> 16, minlength=1 << 16)
    above = torch.flip(torch.cumsum(torch.flip(high, [0]), 0), [0])  # above[i]: entries with high bits >= i
    k = min(k, int(above[0]))
    bucket = int((above >= k).nonzero().max())
    rank = k - (int(above[bucket + 1]) if bucket + 1 < len(above) else 0)
    low = torch.zeros(1 << 16, dtype=torch.int64)
    for n in names:
        x = bits(n)
        low += torch.bincount(x[(x >> 16) == bucket] & 0xFFFF, minlength=1 << 16)
    above_low = torch.flip(torch.cumsum(torch.flip(low, [0]), 0), [0])
    value = (bucket << 16) | int((above_low >= rank).nonzero().max())
    return float(torch.tensor([value], dtype=torch.int32).view(torch.float32))


def magnitude_cut(
    base_dir: Path, base_fingerprint: str, expert_dir: Path, expert_fingerprint: str, k: int, cache: Path | None
) -> float:
    """``kth_largest_delta``, cached as ``<cache>/statistics/cut-<key>.json`` per (base, expert, k)."""
    if cache is None:
        return kth_largest_delta(base_dir, expert_dir, k)
    from mergeval.core.paths import atomic_write_text

    payload = {"kind": "cut", "base": base_fingerprint, "model": expert_fingerprint, "k": k, "version": CUT_VERSION}
    path = (
        cache
        / "statistics"
        / f"cut-{hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]}.json"
    )
    if path.exists():
        return json.loads(path.read_text())["cut"]
    cut = kth_largest_delta(base_dir, expert_dir, k)
    atomic_write_text(path, json.dumps({**payload, "cut": cut}))
    return cut


def fill_thresholds(method_cfg, base_dir: Path, models, cache: Path | None = None):
    """localize_stitch with scope=model: each expert's cut, the ceil(sparsity n)-th largest |e - b| over the
    model (n = its floating-point entries; cached per base, expert and k); returns (new config, details for
    result.json)."""
    import dataclasses
    import math

    from mergeval.merge.reader import CheckpointReader

    reader = CheckpointReader(base_dir, "modelset.base")
    n = sum(math.prod(reader.shapes[t]) for t in reader.names() if reader.dtypes[t].is_floating_point)
    k = max(1, math.ceil(method_cfg.sparsity * n))
    cuts = {
        m.role: magnitude_cut(base_dir, models[0].fingerprint, Path(m.path), m.fingerprint, k, cache)
        for m in models
        if m.role != "base"
    }
    return (
        dataclasses.replace(method_cfg, thresholds=list(cuts.values())),
        {"thresholds": cuts, "kept_per_expert": k, "entries": n},
    )
