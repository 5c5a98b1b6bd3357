"""The shared-prefix scorer against lm-eval's HFLM in bfloat16, mergeval's default ``eval.dtype``.

Measured on the tiny zoo model: against ``HFLM(softmax_dtype="float32")`` (the log-softmax in float32, as our
scorer takes it) every choice's log-likelihood agrees within 4.3e-5 * |ll| on these pairs at batch sizes 1-8,
and within 8.3e-5 * |ll| over 600 generated items (3 tasks x 200, batch 32) with no item's answer changed;
``scorer.LL_TOLERANCE["bfloat16"]`` = max(2.5e-4, 2.5e-4 * |ll|) keeps a 3x margin. HFLM's default takes the
log-softmax in bfloat16, rounding each token's log-probability to 8 significant bits (-11.719 -> -11.75): up
to 4.1e-3 * |ll| from ours here (a rounding is at most 2^-8 = 3.9e-3 relative, summed over tokens), which
flipped 53 of 600 near-tied items of the untrained tiny model; we bound that by 2^-7 * |ll|.
"""

from __future__ import annotations

import pytest
import torch
from lm_eval.models.huggingface import HFLM

from mergeval.eval.scorer import LL_TOLERANCE, SharedPrefixLM, within_tolerance
from mergeval.models.checkpoint import load_model
from tests.eval.test_scorer import PAIRS, requests


@pytest.fixture(scope="module")
def bf16(tiny_dir):
    from transformers import AutoTokenizer

    return load_model(tiny_dir, None, torch.bfloat16), AutoTokenizer.from_pretrained(tiny_dir)


def loglikelihoods(lm) -> list[tuple[float, bool]]:
    return lm.loglikelihood(requests(PAIRS), disable_tqdm=True)


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_bf16_loglikelihoods_agree_with_hflm_within_the_stated_tolerance(bf16, batch):
    model, tok = bf16
    assert next(model.parameters()).dtype == torch.bfloat16
    want = loglikelihoods(HFLM(pretrained=model, tokenizer=tok, batch_size=4, softmax_dtype="float32"))
    got = loglikelihoods(SharedPrefixLM(pretrained=model, tokenizer=tok, batch_size=batch))
    assert len(got) == len(want) == sum(len(c) for _, c in PAIRS)
    for (w, w_greedy), (g, g_greedy) in zip(want, got):
        assert within_tolerance(g, w, "bfloat16"), (g, w, abs(g - w) / abs(w))
        assert g_greedy == w_greedy
    # the same answer to every question: the best choice is the same
    for i, (_, conts) in enumerate(PAIRS):
        start = sum(len(c) for _, c in PAIRS[:i])
        rows = range(start, start + len(conts))
        assert max(rows, key=lambda j: got[j][0]) == max(rows, key=lambda j: want[j][0])


def test_bf16_is_tested_against_a_tolerance_that_bfloat16_rounding_would_break(bf16):
    """HFLM's default (log-softmax in bfloat16) differs from us by its rounding of every token's log-probability:
    within 2^-7 * |ll|, but beyond the stated float32-softmax tolerance, so the tolerance above has teeth."""
    model, tok = bf16
    default = loglikelihoods(HFLM(pretrained=model, tokenizer=tok, batch_size=4))
    ours = loglikelihoods(SharedPrefixLM(pretrained=model, tokenizer=tok, batch_size=2))
    assert all(abs(g - w) <= 2**-7 * abs(w) for (w, _), (g, _) in zip(default, ours))
    assert not all(within_tolerance(g, w, "bfloat16") for (w, _), (g, _) in zip(default, ours))
    assert LL_TOLERANCE["bfloat16"][1] < 2**-8  # tighter than one bfloat16 rounding
