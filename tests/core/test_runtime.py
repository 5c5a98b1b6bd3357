"""release_memory: every model a run releases is freed at once, and nothing is left out of the collector's reach."""

from __future__ import annotations

import gc
import weakref


def test_a_run_frees_each_model_it_releases(tmp_path, monkeypatch, tiny_dir, cache):
    """In a real run (merge, then base and experts evaluated in turn), no model the run loaded or built is
    alive after the release that follows it."""
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
    cfg = compose_run_config(
        [
            "+experiment=tiny",
            "benchmark.n_items=4",
            "modelset.train.steps=1",
            "eval.dtype=float32",
            f"store.path={tmp_path / 'store.sqlite'}",
        ]
    )
    app.run(cfg, tmp_path / "job")
    assert len(releases) >= 3  # the merge, the base and at least one expert, each released in turn
    assert all(all(freed) for freed in releases), releases
    assert gc.get_freeze_count() == 0
