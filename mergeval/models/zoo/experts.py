"""Domain experts that mergeval fine-tunes from a modelset's base and caches.

An expert's cache key is the base's fingerprint, the domain, the domain's data
version (``DOMAIN_VERSION``) and the training settings: change any and a new expert is built; otherwise the
cached one is reused. Building writes to a temporary directory renamed into
place, so an interrupted build never leaves a half-written expert.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import atomic_dir, one_builder
from mergeval.models.safetensors_io import cached_build_usable
from mergeval.models.zoo.domains import DOMAIN_VERSION, DOMAINS, split_items

# The held-out evaluation items the training pool must avoid (the benchmark's n_items
# never exceeds this; see eval/tasks.py).
EVAL_POOL = 500


def train_dtype(train) -> str:
    """The fine-tuning's compute precision: ``train.dtype``, or the machine's default when the settings have none."""
    from mergeval.core.precision import auto_dtype

    return getattr(train, "dtype", None) or auto_dtype("cpu")


def expert_key(base_fingerprint: str, domain: str, train) -> str:
    settings = dict(
        base=base_fingerprint,
        domain=domain,
        data=DOMAIN_VERSION[domain],
        steps=train.steps,
        batch_size=train.batch_size,
        lr=train.lr,
        seed=train.seed,
    )
    if train_dtype(train) != "bfloat16":  # bfloat16 autocast is how every expert was trained before: same keys
        settings["dtype"] = train_dtype(train)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def expert_dir(base_dir: Path, base_fingerprint: str, domain: str, train, cache: Path, field: str) -> Path:
    if domain not in DOMAINS:
        raise UserError(field, f"unknown training domain '{domain}'", f"choose one of: {', '.join(sorted(DOMAINS))}")
    if train.steps < 1 or train.batch_size < 1 or not train.lr > 0:
        raise UserError("modelset.train", "steps, batch_size and lr must be positive", "fix modelset.train")
    if train_dtype(train) not in ("bfloat16", "float32"):
        raise UserError("modelset.train.dtype", f"unknown dtype '{train_dtype(train)}'", "use bfloat16 or float32")
    target = cache / "experts" / f"{domain}-{expert_key(base_fingerprint, domain, train)}"
    if cached_build_usable(target, field):
        return target
    with one_builder(target, f"expert '{domain}'") as build:
        if build:
            _build(base_dir, base_fingerprint, domain, train, target)
    return target


def _build(base_dir: Path, base_fingerprint: str, domain: str, train, target: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from mergeval.models.checkpoint import load_model
    from mergeval.models.zoo.finetune import finetune

    train_items, _ = split_items(
        domain, seed=0, n_train=train.steps * train.batch_size, n_eval=EVAL_POOL, train_seed=train.seed
    )
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = load_model(base_dir, dtype=torch.float32)
    losses = finetune(
        model,
        tokenizer,
        train_items,
        train.steps,
        train.batch_size,
        train.lr,
        train.seed,
        desc=f"building expert '{domain}'",
        dtype=train_dtype(train),
    )
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "mergeval-expert.json").write_text(
            json.dumps(
                dict(
                    base_fingerprint=base_fingerprint,
                    domain=domain,
                    data_version=DOMAIN_VERSION[domain],
                    train=dict(
                        steps=train.steps,
                        batch_size=train.batch_size,
                        lr=train.lr,
                        seed=train.seed,
                        dtype=train_dtype(train),
                    ),
                    first_loss=losses[0],
                    last_loss=losses[-1],
                ),
                indent=2,
            )
        )
