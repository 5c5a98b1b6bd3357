"""Multiple-choice log-likelihoods with each question's context computed once.

lm-eval's ``HFLM`` scores a question with k choices as k sequences
``context + choice``, so the (usually much longer) context goes through the
model k times, and it computes vocabulary logits at every position. ``SharedPrefixLM``
is an ``HFLM`` whose log-likelihood requests are packed one question per row::

    [left pad][context][choice 1 minus last token][choice 2 minus last token]...[right pad]

with a 4-D attention mask: context tokens attend causally to the context; the
tokens of choice j attend to the whole context and causally to choice j's own
earlier tokens, never to another choice; position ids restart after the
context for every choice. Each choice thus sees exactly the sequence HFLM gives
it, and ``log P(choice_j | context) = sum_t log softmax(logits at the position
before token t)[token t]``, the first token predicted from the context's last
position. Rows are left-padded so every context ends in the same column and
vocabulary logits are computed only from that column on (``logits_to_keep``).

Everything else is lm-eval's: tokenization (``_encode_pair``, so the token ids
are HFLM's), task loading, few-shot contexts, metrics and aggregation. The
forward passes differ only in the shape of the matrix products, so scores agree
with ``HFLM`` up to floating-point rounding: in float32 within ``LL_TOLERANCE``
per choice with the same answers (tests/eval/test_scorer.py; SmolLM2-135M too); in
bfloat16 each rounds its own way, on a real model as much as bfloat16 moves
answers from float32 (a few percent of items; see ``ACCURACY_TOLERANCE``);
``eval.backend=hflm`` runs lm-eval's own ``HFLM``. The log-softmax is taken in
float32 whatever the model's dtype (``HFLM(softmax_dtype="float32")``; HFLM's
default rounds each token's log-probability to the model's dtype, in bfloat16 to
8 significant bits, which flips near-tied choices). A request that would not
fit ``max_length`` goes to HFLM's own path, which left-truncates it the way
lm-eval does.

Batches never mix tasks (HFLM's do): in bfloat16 a row's rounding depends on the
shape and padding of its batch, so mixing would make a task's score depend on
which other tasks share the run. Per task, the same items, model and batch size
give the same log-likelihoods whatever else the run scores.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from typing import cast

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

Request = tuple[tuple[str, str], list[int], list[int]]  # ((context, continuation), context ids, continuation ids)

# |ours - HFLM's| per choice log-likelihood ll, as max(absolute, relative * |ll|), against HFLM with the
# log-softmax in float32, same model and dtype.
# float32: the backends differ only by float32 rounding; the bound keeps about a 3x margin over the largest
# difference benchmarks/scoring_backends.py finds on the tiny zoo model and SmolLM2-135M, where no answer
# changes and accuracies are equal.
# bfloat16: the two backends multiply in different shapes, so each rounds its own way, and the rounding
# grows with depth. LL_TOLERANCE["bfloat16"] bounds the tiny zoo model (2 layers, no answer changed) in
# tests/eval/test_scorer_bf16.py, not real models: on a deeper one (SmolLM2-135M's 30 layers) a choice can differ
# by a large fraction of a nat and some answers flip. bfloat16 itself moves about as many answers from float32
# in either backend: two bfloat16 evaluations agree only that far. ACCURACY_TOLERANCE["bfloat16"] is that
# effect per task, 0.06 (a 1% bound holds on the tiny model but not on SmolLM2); use float32 for an exact
# comparison.
LL_TOLERANCE = {"float32": (1e-4, 0.0), "bfloat16": (2.5e-4, 2.5e-4)}
ACCURACY_TOLERANCE = {"float32": 0.0, "bfloat16": 0.06}


def within_tolerance(ours: float, theirs: float, dtype: str) -> bool:
    """Whether two log-likelihoods of one choice agree within ``LL_TOLERANCE[dtype]``."""
    absolute, relative = LL_TOLERANCE[dtype]
    return abs(ours - theirs) <= max(absolute, relative * abs(theirs))


class SharedPrefixLM(HFLM):
    """HFLM whose ``_loglikelihood_tokens`` computes each distinct context once (module docstring).

    ``batch_size`` is the number of questions (rows) per forward pass, each with all its choices.
    ``self.forward_tokens`` counts the token positions fed to the model (cost accounting).
    """

    forward_tokens = 0

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each task's requests batched on their own, so a task's scores do not depend on which other
        tasks share the run: in bfloat16 the rounding of a row depends on its batch's shape and padding."""
        by_task: dict[str | None, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_task[req.task_name].append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for idx in by_task.values():
            for i, answer in zip(idx, super().loglikelihood([requests[i] for i in idx], disable_tqdm)):
                results[i] = answer
        return cast(list[tuple[float, bool]], results)  # every request is in one task's batch

    @cached_property
    def _keeps_logits(self) -> bool:
        """Whether the model's forward takes ``logits_to_keep`` (recent transformers causal LMs do); asked once."""
        from mergeval.models.checkpoint import takes_logits_to_keep

        return takes_logits_to_keep(self.model)

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)  # context ids -> request indices
        too_long = []
        for i, (_, context_ids, _cont) in enumerate(requests):
            groups[tuple(context_ids)].append(i)
        fitting: dict[tuple[int, ...], list[int]] = {}
        for ctx, idx in groups.items():
            if len(ctx) + sum(len(requests[i][2]) - 1 for i in idx) > self.max_length:
                too_long.extend(idx)
            else:
                fitting[ctx] = idx
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # Longest rows first (like HFLM): padding within a batch stays small and memory errors come early.
        order = sorted(fitting.items(), key=lambda kv: -(len(kv[0]) + sum(len(requests[i][2]) for i in kv[1])))
        size = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 32)
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, answer in zip((i for _, idx in chunk for i in idx), self._score_rows(chunk, requests)):
                results[i] = answer
        if too_long:
            for i, answer in zip(
                too_long, super()._loglikelihood_tokens([requests[i] for i in too_long], disable_tqdm, override_bs)
            ):
                results[i] = answer
        for (request_str, _, _), answer in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return cast(list[tuple[float, bool]], results)  # every request is fitting or too long

    def _score_rows(self, chunk: list[tuple[tuple[int, ...], list[int]]], requests: list[Request]):
        """(log-likelihood, is_greedy) for every request of the chunk's rows, in row then request order."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ctx_end = max(len(ctx) for ctx, _ in chunk)  # every context ends in column ctx_end - 1
        rows = []
        for ctx, idx in chunk:
            tokens = list(ctx)
            positions = list(range(len(ctx)))
            segment = [0] * len(ctx)  # 0 = context, j = choice j, -1 = padding
            for j, i in enumerate(idx, start=1):
                body = requests[i][2][:-1]  # the last token is predicted, never fed
                tokens += body
                positions += range(len(ctx), len(ctx) + len(body))
                segment += [j] * len(body)
            lead = ctx_end - len(ctx)
            rows.append(([pad] * lead + tokens, [0] * lead + positions, [-1] * lead + segment, lead))
        width = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        seg = torch.full((len(rows), width), -1, dtype=torch.long)
        for r, (tok, p, s, _) in enumerate(rows):
            ids[r, : len(tok)], pos[r, : len(p)], seg[r, : len(s)] = torch.tensor(tok), torch.tensor(p), torch.tensor(s)
        mask = _choice_mask(seg)
        self.forward_tokens += int((seg >= 0).sum())
        dtype = next(self.model.parameters()).dtype
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
        keep = width - ctx_end + 1  # vocabulary logits only from the context's end on, where choices are predicted
        with torch.no_grad():
            out = self.model(
                input_ids=ids.to(self.device),
                position_ids=pos.to(self.device),
                attention_mask=additive[:, None].to(self.device),
                **({"logits_to_keep": keep} if self._keeps_logits else {}),
            )
        # Each choice token is predicted from one (row, kept column): 0 (the context's end) for its first token,
        # then the column of its own previous token. Only those positions get a float32 log-softmax (HFLM's
        # values: each position's log-softmax is computed on its own, so leaving out the others, padding
        # included, changes no bit; tests/eval/test_scorer.py), not the [rows, kept columns, vocabulary] block.
        at_row: list[int] = []
        at_col: list[int] = []
        targets: list[int] = []
        spans: list[tuple[int, int]] = []
        for r, (_, idx) in enumerate(chunk):
            offset = 1  # kept column of this choice's first fed token
            for i in idx:
                cont = requests[i][2]
                spans.append((len(targets), len(cont)))
                at_row += [r] * len(cont)
                at_col += [0, *range(offset, offset + len(cont) - 1)]
                targets += cont
                offset += len(cont) - 1
        logits = out.logits[:, -keep:]
        at = (torch.tensor(at_row, device=logits.device), torch.tensor(at_col, device=logits.device))
        logprobs = F.log_softmax(logits[at], dim=-1, dtype=self.softmax_dtype or torch.float32)  # [positions, V]
        target = torch.tensor(targets, device=logprobs.device)
        picked = logprobs.gather(1, target[:, None]).cpu()  # [positions, 1]
        greedy = (logprobs.argmax(-1) == target).cpu()
        for start, n in spans:
            yield float(picked[start : start + n].sum()), bool(greedy[start : start + n].all())


def _choice_mask(seg: torch.Tensor) -> torch.Tensor:
    """[rows, T, T] booleans: query q may attend key k (module docstring). Padding attends only to itself,
    so no softmax row is empty."""
    t = seg.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    q, k = seg[:, :, None], seg[:, None, :]
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))
    return allowed | torch.eye(t, dtype=torch.bool)
