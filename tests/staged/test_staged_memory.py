"""A staged sweep's memory: promoted candidates' weights kept between stages (mergeval/staged/kept.py), and the
constituents held in memory or read from their files a block at a time (staged/pipeline.py's Models)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergeval.staged.kept import KeptMerges, available_memory
from mergeval.staged.selection import promote
from tests.staged.test_staged import compose_staged

keys = st.lists(st.sampled_from([0.1, 0.5, 0.5, 1.0, 2.0, float("inf")]), min_size=1, max_size=10)


@given(keys, st.integers(1, 5), st.integers(0, 6))
def test_what_is_kept_is_the_best_that_fit_in_promotes_order(values, capacity, slots):
    labels = [f"c{i}" for i in range(len(values))]
    kept = KeptMerges(capacity, budget_bytes=slots * 10)
    copies = []
    for label, key in zip(labels, values):
        kept.offer(label, key, 10, lambda label=label: copies.append(label) or {"w": label})
        assert len(kept) <= min(capacity, slots) and kept.nbytes <= slots * 10
    best = promote(dict(zip(labels, values)), labels, min(capacity, slots), higher_is_better=False)
    assert sorted(label for label in labels if label in kept) == sorted(best)
    assert all(kept.get(label) == {"w": label} for label in best)
    assert set(best) <= set(copies)  # a candidate is copied only when it enters


def test_nothing_is_kept_without_room_and_retain_drops_the_rest():
    none = KeptMerges(4, budget_bytes=9)
    none.offer("a", 0.0, 10, lambda: pytest.fail("copied a candidate that cannot fit"))
    assert len(none) == 0 and none.get("a") is None
    kept = KeptMerges(4, budget_bytes=100)
    for label, key in [("a", 1.0), ("b", 0.5), ("c", 2.0)]:
        kept.offer(label, key, 10, lambda label=label: {"w": label})
    assert kept.peak_bytes == 30
    kept.retain(["b", "x"])
    assert "b" in kept and "a" not in kept and kept.nbytes == 10
    kept.retain([])
    assert len(kept) == 0 and kept.nbytes == 0 and kept.peak_bytes == 30


def test_available_memory_is_a_positive_byte_count():
    assert available_memory() > 2**20


def test_a_kept_candidate_is_the_same_model_bit_for_bit_as_merging_it_again(cache):
    """In bfloat16 (the cast from the float32 merge matters), after another candidate overwrote the live model."""
    from mergeval.core.paths import cache_root
    from mergeval.models.zoo.resolve import resolve_models
    from mergeval.staged.pipeline import Models
    from mergeval.staged.plan import make_plan

    cfg = compose_staged(f"cache_dir={cache}")
    plan = make_plan(cfg.staged, list(cfg.modelset.experts))
    base_dir, expert_dirs, _ = resolve_models(cfg, cache_root(cfg.cache_dir))
    models = Models(cfg, base_dir, expert_dirs, torch.bfloat16)
    models.kept = KeptMerges(4, 2**40)
    first, second = plan.candidates[0], plan.candidates[-1]
    models.live(models.merged(first))
    models.keep(first.label, 0.0)
    models.live(models.merged(second))
    from_kept = {k: v.clone() for k, v in models.candidate(first).state_dict().items()}
    assert models.merges_run == 2  # the kept candidate was not merged again
    models.kept.retain([])
    again = models.candidate(first).state_dict()
    assert models.merges_run == 3
    assert from_kept.keys() == again.keys()
    for name, tensor in again.items():
        assert tensor.dtype == from_kept[name].dtype and torch.equal(tensor, from_kept[name]), name


def test_constituents_read_from_their_files_merge_to_the_same_bits(cache, monkeypatch):
    """Where the constituents do not fit in memory each merge reads them from the files: the same merges."""
    from mergeval.core.paths import cache_root
    from mergeval.merge import execute
    from mergeval.merge.reader import CheckpointReader, MemorySource
    from mergeval.models.zoo.resolve import resolve_models
    from mergeval.staged import pipeline
    from mergeval.staged.plan import make_plan

    monkeypatch.setattr(execute, "BLOCK_MIN", 2)  # every matrix in row blocks of about 300 entries, too
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    cfg = compose_staged(f"cache_dir={cache}")
    plan = make_plan(cfg.staged, list(cfg.modelset.experts))
    base_dir, expert_dirs, _ = resolve_models(cfg, cache_root(cfg.cache_dir))
    loaded = pipeline.Models(cfg, base_dir, expert_dirs, torch.float32)
    monkeypatch.setattr(pipeline, "CONSTITUENTS_IN_MEMORY", 0.0)
    lazy = pipeline.Models(cfg, base_dir, expert_dirs, torch.float32)
    assert loaded.in_memory and all(isinstance(s, MemorySource) for s in loaded.sources)
    assert not lazy.in_memory and all(isinstance(s, CheckpointReader) for s in lazy.sources)
    assert len(lazy.sources) == 1 + len(expert_dirs)
    for cand in plan.candidates:
        a, b = loaded.merged(cand), lazy.merged(cand)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), cand.label


@pytest.fixture(scope="module")
def both(cache):
    """The tiny staged sweep with and without kept weights, every evaluation run (eval.force)."""
    from mergeval.staged.pipeline import run_staged

    return [
        run_staged(compose_staged(f"cache_dir={cache}", "eval.force=true", f"staged.keep_memory={share}"))
        for share in (0.25, 0.0)
    ]


def test_keeping_weights_changes_no_result_and_saves_the_later_stages_merges(both):
    kept, again = both
    assert [c.fingerprint for c in kept.candidates] == [c.fingerprint for c in again.candidates]
    for a, b in zip(kept.candidates, again.candidates):
        assert (a.perplexity, a.stage2, a.stage3) == (b.perplexity, b.stage2, b.stage3), a.label
    assert (kept.stage2, kept.stage3, kept.pick) == (again.stage2, again.stage3, again.pick)
    n = len(kept.candidates)
    assert kept.merges == {
        "kept_between_stages": len(kept.stage2),
        "merged": n,
        "constituents_in_memory": True,
        "kept_bytes_peak": kept.merges["kept_bytes_peak"],
    }
    assert kept.merges["kept_bytes_peak"] > 0
    assert again.merges == {
        "kept_between_stages": 0,
        "merged": n + len(again.stage2) + len(again.stage3),
        "constituents_in_memory": True,
        "kept_bytes_peak": 0,
    }
