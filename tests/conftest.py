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


# What a cache holds that is costly to build and never changes once built: converted and zoo models, fine-tuned
# experts, lm-eval's registry index. Under pytest-xdist (the suite runs with two workers, pyproject's addopts) the workers share these
# (every build is an atomic rename, and two processes building the same one is tested in test_concurrency),
# while each worker keeps its own results store, fingerprints and samples, so no test sees another's runs.
SHARED_CACHE_PARTS = ("models", "experts", "lm_eval_index")


# The modules that take minutes, collected first (with --no-loadscope-reorder they also start first; by
# default xdist hands out modules by their number of tests, which measured faster: see pyproject's addopts).
SLOW_MODULES = ("test_reproductions_mini.py", "test_sweeps_scale.py", "test_registry_tasks.py",
                "test_quickstart_e2e.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a module is kept


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
    from mergeval.zoo.tiny import zoo_dir

    return zoo_dir("tiny", cache)
