"""The cached lm-eval registry index (mergeval/eval/task_index.py) is the index lm-eval builds itself."""

from __future__ import annotations

import json
import os


def test_the_cached_index_is_lm_evals_own_and_a_second_manager_reads_it(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager, _index

    from mergeval.eval import task_index
    from mergeval.eval.task_index import task_manager

    task_index._LOADED.clear()
    mine = tmp_path / "mine"  # a user's directory shadowing a registry task and adding one
    mine.mkdir()
    (mine / "hellaswag.yaml").write_text(
        json.dumps(
            {
                "task": "hellaswag",
                "dataset_path": "json",
                "output_type": "multiple_choice",
                "doc_to_text": "x",
                "doc_to_target": 0,
                "doc_to_choice": ["a", "b"],
            }
        )
    )
    (mine / "my_task.yaml").write_text(json.dumps({"task": "my_task", "include": "hellaswag.yaml"}))
    include, cache = [str(mine)], tmp_path / "cache"

    theirs = TaskManager(include_path=include)
    built = []
    plain_build = _index.TaskIndex.build
    monkeypatch.setattr(
        _index.TaskIndex,
        "build",
        staticmethod(lambda paths, **kw: built.append([str(p) for p in paths]) or plain_build(paths, **kw)),
    )
    first = task_manager(include, include_defaults=True, cache=cache)
    assert len(built) == 2 and built[1] == include  # the registry, then the user's directory
    task_index._LOADED.clear()  # as a new process: from the cache on disk
    second = task_manager(include, include_defaults=True, cache=cache)
    assert built[2:] == [include]  # the registry came from the cache
    assert len(list((cache / "lm_eval_index").glob("*.pickle"))) == 1
    for ours in (first, second):
        assert ours.task_index == theirs.task_index
        assert (ours.all_tasks, ours.all_groups, ours.all_tags) == (
            theirs.all_tasks,
            theirs.all_groups,
            theirs.all_tags,
        )
    assert second.task_index["hellaswag"].yaml_path == mine / "hellaswag.yaml"
    assert second.task_index["my_task"].cfg["doc_to_choice"] == ["a", "b"]  # its include resolved
    (stored,) = (cache / "lm_eval_index").glob("*.pickle")
    stored.unlink()
    task_manager(include, include_defaults=True, cache=cache)  # the same process: neither built nor read again
    assert built[3:] == [include] and not stored.exists()


def test_the_key_changes_when_a_yaml_changes_and_a_damaged_file_is_rebuilt(tmp_path):
    from mergeval.eval.task_index import _load_or_build as _registry_index
    from mergeval.eval.task_index import _registry_key

    reg = tmp_path / "registry"
    (reg / "a").mkdir(parents=True)
    (reg / "a" / "t.yaml").write_text(json.dumps({"task": "t1", "dataset_path": "json"}))
    key = _registry_key(reg)
    assert _registry_key(reg) == key
    st = os.stat(reg / "a" / "t.yaml")
    os.utime(reg / "a" / "t.yaml", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert _registry_key(reg) != key
    (reg / "a" / "u.yaml").write_text(json.dumps({"task": "t2", "dataset_path": "json"}))
    cache = tmp_path / "cache"
    assert set(_registry_index(reg, cache)) == {"t1", "t2"}
    (stored,) = (cache / "lm_eval_index").glob("*.pickle")
    stored.write_bytes(b"not a pickle")
    assert set(_registry_index(reg, cache)) == {"t1", "t2"}
    assert stored.read_bytes() != b"not a pickle"


def test_without_the_registry_nothing_is_cached(tmp_path):
    from mergeval.eval.task_index import task_manager

    task_manager([str(tmp_path)], include_defaults=False, cache=tmp_path)
    assert not (tmp_path / "lm_eval_index").exists()
