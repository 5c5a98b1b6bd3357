"""release_memory inside a run's ``survivors_frozen`` scope: later collections skip what survived the last one,
yet every released model is freed at once, and nothing stays out of the collector's reach after the run."""

from __future__ import annotations

import gc
import weakref

from mergeval.core import runtime
from mergeval.core.runtime import release_memory, survivors_frozen


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_cycle_made_after_a_release_is_freed_by_the_next():
    before = gc.get_freeze_count()
    with survivors_frozen():
        release_memory()
        made = Node()
        gone = weakref.ref(made)
        del made
        release_memory()
        assert gone() is None
    assert gc.get_freeze_count() == before


def test_a_survivor_that_dies_later_waits_for_the_scope_s_end():
    """What survived a release is skipped until the run's end (its state lives that long), then collected."""
    with survivors_frozen():
        survivor = Node()
        kept = weakref.ref(survivor)
        release_memory()  # survivor is alive here, so it is frozen
        del survivor
        release_memory()
        assert kept() is not None  # skipped: this is what makes the collections cheap
    gc.collect()
    assert kept() is None  # back in the collector's reach after the scope


def test_outside_a_run_release_memory_freezes_nothing():
    before = gc.get_freeze_count()
    Node()
    release_memory()
    assert gc.get_freeze_count() == before


def test_nested_scopes_unfreeze_only_at_the_outermost_end():
    with survivors_frozen():
        with survivors_frozen():
            release_memory()
        assert runtime._FREEZE_SURVIVORS and gc.get_freeze_count() > 0
    assert not runtime._FREEZE_SURVIVORS and gc.get_freeze_count() == 0


def test_a_run_frees_each_model_it_releases(tmp_path, monkeypatch, tiny_dir, cache):
    """In a real run (merge, then base and experts evaluated in turn), no model the run loaded or built is
    alive after the release that follows it: freezing the survivors never keeps a model."""
    from mergeval.merge import memory
    from mergeval.models import checkpoint
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    loaded: list[weakref.ref] = []  # every model the run loads (a constituent) or builds (the merge)
    real_load, real_merge, real_release = checkpoint.load_model, memory.merge_live, app.release_memory

    def load_model(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model

    def merge_live(*args, **kwargs):
        model, view = real_merge(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model, view

    releases = []

    def checked_release():
        real_release()
        releases.append([ref() is None for ref in loaded])

    monkeypatch.setattr(checkpoint, "load_model", load_model)  # _execute imports both when it runs
    monkeypatch.setattr(memory, "merge_live", merge_live)
    monkeypatch.setattr(app, "release_memory", checked_release)
    cfg = compose_run_config(["+experiment=tiny", "benchmark.n_items=4", "modelset.train.steps=1",
                              "eval.dtype=float32", f"store.path={tmp_path / 'store.sqlite'}"])
    app.run(cfg, tmp_path / "job")
    assert len(releases) >= 3  # the merge, the base and at least one expert, each released in turn
    assert all(all(freed) for freed in releases), releases
    assert gc.get_freeze_count() == 0
