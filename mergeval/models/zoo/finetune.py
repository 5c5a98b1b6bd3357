"""Fine-tune a causal LM on generated question/answer items (answer-only loss).

Only the answer tokens (and the end-of-sequence token) carry loss, and the LM
head is applied only at those positions: the vocabulary projection is the
costliest layer of a small model, and skipping it elsewhere roughly halves a
step on the CPU. Matrix products run in bfloat16 autocast where the CPU has
bfloat16 kernels, else in float32 (``dtype``; mergeval/core/precision.py); the
weights and the optimizer state stay float32, so the task vectors keep their
small deltas.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from mergeval.models.zoo.domains import Item


def prompt(question: str) -> str:
    """The one prompt format shared by training and the lm-eval tasks."""
    return f"Question: {question}\nAnswer:"


def _batch(tokenizer, items: list[Item]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, starts = [], []
    for item in items:
        context = tokenizer(prompt(item["question"]))["input_ids"]
        full = tokenizer(prompt(item["question"]) + " " + item["choices"][item["answer"]])["input_ids"]
        seqs.append(full + [tokenizer.eos_token_id])
        starts.append(len(context))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id or 0)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for row, (seq, start) in enumerate(zip(seqs, starts)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, start : len(seq)] = torch.tensor(seq[start:])
    return ids, mask, labels


def finetune(
    model,
    tokenizer,
    items: list[Item],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    desc: str = "fine-tuning",
    dtype: str = "bfloat16",
) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps, matrix products in ``dtype`` (bfloat16: autocast;
    float32: none); returns the loss of each step."""
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    bar = tqdm(range(steps), desc=desc, unit="step")
    for step in bar:
        ids, mask, labels = _batch(tokenizer, items[step * batch_size : (step + 1) * batch_size])
        with torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext():
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            targets = labels[:, 1:]
            scored = targets != -100
            logits = model.lm_head(hidden[:, :-1][scored]).float()
            loss = torch.nn.functional.cross_entropy(logits, targets[scored])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
