"""SharedPrefixLM (eval/scorer.py) gives lm-eval's HFLM log-likelihoods with each context computed once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from mergeval.eval.scorer import SharedPrefixLM, _choice_mask
from mergeval.models.checkpoint import load_model

PAIRS = [  # varied context lengths, multi-token and one-token choices, a context ending in a space
    (
        "Question: How many O atoms are in one molecule of Ca10Cl4O5?\nAnswer:",
        [" 10 atoms", " 7 atoms", " 5", " 6 atoms"],
    ),
    ("Question: Convert 834 m to mm.\nAnswer:", [" 834 mm", " 8340 mm", " 834000 mm", " 8340000 mm"]),
    ("Question: Convert 3 kg to g.\nAnswer: ", ["3000 g", "30 g"]),
    ("Q:", [" A", " B", " C", " D"]),
    ("", [" Question", " Answer"]),  # empty context: lm-eval scores it after its prefix token
]


@pytest.fixture(scope="module")
def lms(tiny_dir):
    from transformers import AutoTokenizer

    model, tok = load_model(tiny_dir, None, torch.float32), AutoTokenizer.from_pretrained(tiny_dir)
    return (
        HFLM(pretrained=model, tokenizer=tok, batch_size=4),
        SharedPrefixLM(pretrained=model, tokenizer=tok, batch_size=2),
    )


def requests(pairs) -> list[Instance]:
    return [
        Instance("loglikelihood", {}, (ctx, cont), j, ("t", d, 1))
        for d, (ctx, conts) in enumerate(pairs)
        for j, cont in enumerate(conts)
    ]


def test_same_loglikelihoods_as_hflm(lms):
    hflm, shared = lms
    reqs = requests(PAIRS)
    want, got = hflm.loglikelihood(reqs, disable_tqdm=True), shared.loglikelihood(reqs, disable_tqdm=True)
    assert len(got) == len(reqs)
    for (w, w_greedy), (g, g_greedy) in zip(want, got):
        assert g == pytest.approx(w, abs=1e-4)
        assert g_greedy == w_greedy


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 9),
    vocab=st.sampled_from([1, 7, 64, 1000, 49152]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_log_softmax_of_the_predicted_positions_alone_gives_the_same_bits(rows, cols, vocab, dtype, seed, data):
    # _score_rows takes the float32 log-softmax of only the positions that predict a choice token: each position's
    # values must be those of the log-softmax of the whole [rows, kept columns, vocabulary] block it replaced
    logits = (torch.randn(rows, cols, vocab, generator=torch.Generator().manual_seed(seed)) * 8).to(dtype)
    n = data.draw(st.integers(1, 12))
    at = (
        torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=n, max_size=n))),
        torch.tensor(data.draw(st.lists(st.integers(0, cols - 1), min_size=n, max_size=n))),
    )
    whole = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    alone = torch.log_softmax(logits[at], dim=-1, dtype=torch.float32)
    assert torch.equal(alone, whole[at])
    assert torch.equal(alone.argmax(-1), whole[at].argmax(-1))


def test_fewer_token_positions_than_one_sequence_per_choice(lms):
    _, shared = lms
    before = shared.forward_tokens
    shared.loglikelihood(requests(PAIRS[:2]), disable_tqdm=True)
    fed = shared.forward_tokens - before
    per_choice = sum(len(shared.tok_encode(ctx + c)) - 1 for ctx, conts in PAIRS[:2] for c in conts)
    assert 0 < fed < per_choice / 2  # the contexts dominate and are fed once instead of four times


def test_too_long_rows_take_hflms_truncating_path(lms, monkeypatch):
    hflm, shared = lms
    reqs = requests(PAIRS[:1])
    want = hflm.loglikelihood(reqs, disable_tqdm=True)
    monkeypatch.setattr(type(shared), "max_length", property(lambda self: 20))  # the packed row no longer fits
    monkeypatch.setattr(type(hflm), "max_length", property(lambda self: 20))
    got, truncated = shared.loglikelihood(reqs, disable_tqdm=True), hflm.loglikelihood(reqs, disable_tqdm=True)
    assert [g for g, _ in got] == pytest.approx([t for t, _ in truncated], abs=1e-4)
    assert [g for g, _ in got] != pytest.approx([w for w, _ in want], abs=1e-4)  # truncation did happen


@settings(max_examples=15)
@given(
    st.lists(st.sampled_from([c for _, conts in PAIRS[:2] for c in conts]), min_size=1, max_size=5, unique=True),
    st.sampled_from([1, 2, 8]),
)
def test_a_choice_does_not_see_the_others(lms, conts, batch):
    """A choice's score is the same whichever other choices share its row, and whatever the batch."""
    _, shared = lms
    shared.batch_size_per_gpu = batch  # what HFLM's batch_size property reads
    ctx = PAIRS[0][0]
    together = shared.loglikelihood(requests([(ctx, conts)]), disable_tqdm=True)
    alone = [shared.loglikelihood(requests([(ctx, [c])]), disable_tqdm=True)[0] for c in conts]
    assert [g for g, _ in together] == pytest.approx([a for a, _ in alone], abs=1e-4)


def test_mask_keeps_choices_apart():
    seg = torch.tensor([[-1, 0, 0, 1, 1, 2]])  # pad, two context tokens, choice 1 (2 tokens), choice 2 (1 token)
    m = _choice_mask(seg)[0]
    assert m[0].tolist() == [True, False, False, False, False, False]  # padding sees only itself
    assert m[4].tolist() == [False, True, True, True, True, False]  # choice 1: context and itself, causally
    assert m[5].tolist() == [False, True, True, False, False, True]  # choice 2 never sees choice 1
    assert not m[1, 2]  # the context is causal


def test_harness_backends_agree(tiny_dir, tmp_path):
    """The whole lm-eval path on a generated task: the same accuracy with either backend."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from mergeval.eval.harness import Harness
    from mergeval.eval.suite import build_suite
    from mergeval.run.config import BenchmarkConfig, EvalConfig

    tasks = ["mergeval_chem_count", "mergeval_general_facts"]
    suite = build_suite(
        OmegaConf.structured(BenchmarkConfig(name="t", tasks=tasks, n_items=24, num_fewshot=0)),
        OmegaConf.structured(EvalConfig()),
        tmp_path,
    )
    model, tok = load_model(tiny_dir, None, torch.float32), AutoTokenizer.from_pretrained(tiny_dir)
    scores, lls = {}, {}
    for backend in ("hflm", "shared_prefix"):
        harness = Harness(suite, tasks, 8, None, backend)
        scores[backend] = harness.score(model, tok)
        lls[backend] = [ll for t in tasks for row in harness.samples[t] for ll in row["lls"]]
    assert scores["hflm"] == scores["shared_prefix"]
    assert lls["shared_prefix"] == pytest.approx(lls["hflm"], abs=1e-4)


def test_batches_never_mix_tasks(lms, monkeypatch):
    """In bfloat16 a row's rounding depends on its batch (shape, padding), so a task's scores must not
    depend on the other tasks of the run: each task's requests are batched on their own."""
    _, shared = lms
    calls = []
    original = SharedPrefixLM._loglikelihood_tokens

    def spy(self, reqs, *args, **kwargs):
        calls.append({ctx for (ctx, _), _, _ in reqs})
        return original(self, reqs, *args, **kwargs)

    monkeypatch.setattr(SharedPrefixLM, "_loglikelihood_tokens", spy)

    def reqs(task, pairs):
        return [
            Instance("loglikelihood", {}, (ctx, cont), j, (task, d, 1))
            for d, (ctx, conts) in enumerate(pairs)
            for j, cont in enumerate(conts)
        ]

    alone = reqs("a", PAIRS[:2])
    mixed = reqs("b", PAIRS[2:4]) + alone
    assert shared.loglikelihood(mixed, disable_tqdm=True)[-len(alone) :] == shared.loglikelihood(
        alone, disable_tqdm=True
    )
    task_a, task_b = {ctx for ctx, _ in PAIRS[:2]}, {ctx for ctx, _ in PAIRS[2:4]}
    assert calls[:2] == [task_b, task_a] or calls[:2] == [task_a, task_b]
