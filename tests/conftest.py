"""Shared fixtures: one cache directory per test session, and the tiny zoo model in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# No wall-clock limits in tests: the machines are shared and noisy, so hypothesis' per-example deadline is off.
# The default profile is derandomized, so the suite (and CI) draws the same examples every run and a planted
# bug is caught every time or never; MERGEVAL_HYPOTHESIS=explore draws fresh, ten times as many examples.
settings.register_profile("mergeval", deadline=None, derandomize=True)
settings.register_profile("explore", deadline=None, max_examples=1000)
settings.load_profile("explore" if os.environ.get("MERGEVAL_HYPOTHESIS") == "explore" else "mergeval")


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker (and every process a test starts, which inherits the environment) gets
    its share of the cores as torch's thread count. torch otherwise starts one OpenMP thread per core in every
    process, and two workers' processes on two cores then spin-wait for each other: two forced re-evaluations
    at once took 253 s with 2 threads each against 108 s with 1 each (one alone: about 65 s). joblib's and
    Ray's launchers do the same for their jobs. A thread count the user set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    share = str(max(1, (os.cpu_count() or 1) // workers))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = share
    import sys

    if "torch" in sys.modules:  # already imported by a plugin: its pool is sized, resize it
        sys.modules["torch"].set_num_threads(int(share))


_share_the_cores()


# What a cache holds that is costly to build and never changes once built: converted and zoo models, fine-tuned
# experts, lm-eval's registry index. Under pytest-xdist (the suite runs with two workers, pyproject's addopts) the workers share these
# (every build is an atomic rename, and two processes building the same one is tested in test_concurrency),
# while each worker keeps its own results store, fingerprints and samples, so no test sees another's runs.
SHARED_CACHE_PARTS = ("models", "experts", "lm_eval_index")


# The modules that take minutes, collected first; with pyproject's --no-loadscope-reorder they also start first,
# so the longest (the reproductions) overlaps the rest of the suite on the other worker. Their tests are marked
# ``slow``: ``python -m pytest -m "not slow"`` is the inner loop.
SLOW_MODULES = (
    "test_reproductions_mini.py",
    "test_sweeps_scale.py",
    "test_registry_tasks.py",
    "test_quickstart_e2e.py",
    "test_default_scorer_parity.py",
    "test_lm_eval_results.py",
    "test_benchmarks_smoke.py",
    "test_first_hour.py",
    "test_docs.py",
    "test_faults.py",
    "test_store_postgres.py",
    "test_concurrency.py",
    # mergekit's own command lines (mergekit-yaml, mergekit-multi) beside whole runs: the full suite's
    "test_mergekit_multi.py",
    "test_tokenizer_source.py",
    "test_slices.py",
    # mypy over the whole package: about a minute on a fresh checkout (its cache makes a rerun take seconds)
    "test_types.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)

    def order(item) -> float:
        # The reproductions' later groups (test_reproductions_mini.py) come after the other slow modules: by then
        # the first group has built the experts they share, so neither worker waits for the other.
        if item.path.name == SLOW_MODULES[0] and item.cls is not None and not getattr(item.cls, "first", True):
            return len(rank) - 0.5
        return rank.get(item.path.name, len(rank))

    items.sort(key=order)  # stable: order within a module is kept


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mergeval-cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "mergeval-shared-cache"
        for part in SHARED_CACHE_PARTS:
            (shared / part).mkdir(parents=True, exist_ok=True)
            (path / part).symlink_to(shared / part, target_is_directory=True)
    os.environ["MERGEVAL_CACHE"] = str(path)  # subprocesses started by tests inherit it
    return path


@pytest.fixture(scope="session")
def tiny_dir(cache) -> Path:
    from mergeval.models.zoo.tiny import zoo_dir

    return zoo_dir("tiny", cache)


def pytest_sessionfinish(session):
    from tests.child import close_all

    close_all()  # the zygotes (tests/child.py) would also end when this process does: their stdin closes
