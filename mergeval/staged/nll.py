"""Per-token negative log-likelihoods of a causal LM on held-out answers (teacher forced, no generation).

A held-out item becomes one sequence, ``prompt(question) + " " + answer``,
tokenized exactly as the fine-tuning code and lm-eval split a context from its
continuation: the context's tokens, then the rest. Only the answer tokens are
scored: the prompt is the same for every candidate and carries no answer,
while the answer tokens are what a multiple-choice benchmark's log-likelihood
compares, so their perplexity is the closest cheap proxy of its accuracy. One
sequence is one forward pass (lm-eval spends one per choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mergeval.models.zoo.domains import Item
from mergeval.models.zoo.finetune import prompt

# The implementation version of token_nlls: raised whenever its values for the same model and sequences change,
# so a search study (whose pruning read them) is not resumed across it. 2: vocabulary logits only from the
# batch's first scored position (the same values in bfloat16 and in batches; a float32 row scored alone moved
# by float rounding, a matrix product over fewer rows).
NLL_VERSION = 2


@dataclass
class Spent:
    """What scoring cost: sequences through the model (forward passes), their tokens, and model calls (batches)."""

    forward_passes: int = 0
    tokens: int = 0
    batches: int = 0


def answer_sequences(tokenizer, items: list[Item]) -> list[tuple[list[int], int]]:
    """Per item: the token ids of prompt + " " + correct answer, and the index of the first answer token."""
    out = []
    for item in items:
        context = prompt(item["question"])
        start = len(tokenizer(context)["input_ids"])
        ids = tokenizer(context + " " + item["choices"][item["answer"]])["input_ids"]
        if not 1 <= start < len(ids):
            raise ValueError(f"cannot separate the answer tokens of {item['question']!r}")
        out.append((ids, start))
    return out


@torch.inference_mode()
def token_nlls(
    model,
    sequences: list[tuple[list[int], int]],
    batch_size: int,
    pad_id: int,
    device: str = "cpu",
    spent: Spent | None = None,
) -> list[list[float]]:
    """For each (ids, start): ``-ln p(ids[j] | ids[:j])`` for ``j = start .. len(ids)-1``, in input order.

    Sequences are batched longest first (less padding), right-padded with an
    attention mask, and scored with one forward pass each; ``spent`` (if given)
    is incremented by what this call ran. Vocabulary logits are computed from
    the batch's first scored position on (``logits_to_keep``, where the model
    takes it: the answers are a few tokens after a longer prompt, and the
    projection onto the vocabulary was a fifth of the pass), and the
    log-softmax runs in float32 on the scored positions only, whatever the
    model's dtype.
    """
    from mergeval.models.checkpoint import takes_logits_to_keep

    keeps = takes_logits_to_keep(model)
    spent = spent if spent is not None else Spent()
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
    result: list[list[float]] = [[] for _ in sequences]
    for lo in range(0, len(order), batch_size):
        rows = order[lo : lo + batch_size]
        width = max(len(sequences[i][0]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            seq = sequences[i][0]
            ids[r, : len(seq)] = torch.tensor(seq)
            mask[r, : len(seq)] = 1
        # position p predicts token p + 1: the answer tokens start..end-1 come from positions start-1..end-2;
        # the logits kept are those of positions first.. (first: the earliest of the batch's rows)
        first = min(sequences[i][1] for i in rows) - 1 if keeps else 0
        logits = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **({"logits_to_keep": width - first} if keeps else {}),
        ).logits
        for r, i in enumerate(rows):
            seq, start = sequences[i]
            logp = torch.log_softmax(logits[r, start - 1 - first : len(seq) - 1 - first].float(), dim=-1)
            targets = ids[r, start : len(seq)].to(logp.device)
            result[i] = (-logp.gather(1, targets[:, None])[:, 0]).tolist()
        spent.forward_passes += len(rows)
        spent.tokens += int(mask.sum())
        spent.batches += 1
    return result
