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


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mergeval-cache")
    os.environ["MERGEVAL_CACHE"] = str(path)  # subprocesses started by tests inherit it
    return path


@pytest.fixture(scope="session")
def tiny_dir(cache) -> Path:
    from mergeval.zoo.tiny import zoo_dir

    return zoo_dir("tiny", cache)
