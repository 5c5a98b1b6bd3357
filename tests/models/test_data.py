"""The generated data: deterministic, held-out items never trained on, well-formed choices."""

from __future__ import annotations

import pytest

from mergeval.core.errors import UserError
from mergeval.eval.tasks import GENERATED, task_digest, write_tasks
from mergeval.models.zoo.domains import DOMAINS, eval_items, split_items
from mergeval.models.zoo.general import general_items


def well_formed(items):
    for item in items:
        choices = item["choices"]
        assert 0 <= item["answer"] < len(choices) and len(set(choices)) == len(choices)
        for a in choices:  # a choice that prefixes another would always win the log-likelihood
            assert not any(b != a and b.startswith(a) for b in choices), (item, a)


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_domain_items_are_deterministic_disjoint_and_well_formed(domain):
    train, held_out = split_items(domain, seed=0, n_train=300, n_eval=200)
    again_train, again_held_out = split_items(domain, seed=0, n_train=300, n_eval=200)
    assert train == again_train and held_out == again_held_out
    assert not {i["question"] for i in train} & {i["question"] for i in held_out}
    assert len({i["question"] for i in held_out}) == 200
    assert eval_items(domain, 50) == held_out[:50]  # a smaller benchmark is a prefix of the larger one
    well_formed(train + held_out)


def test_general_items_are_deterministic_distinct_and_well_formed():
    items = general_items(0, 200)
    assert items == general_items(0, 200)
    assert len({i["question"] for i in items}) == 200
    well_formed(items)


def test_tasks_are_written_with_absolute_paths_and_are_content_addressed(cache):
    names = sorted(GENERATED)
    task_dir = write_tasks(names, 30, cache)
    for name in names:
        yaml = (task_dir / f"{name}.yaml").read_text()
        assert str(task_dir / f"{name}.jsonl") in yaml
        assert len((task_dir / f"{name}.jsonl").read_text().splitlines()) == 30
    assert write_tasks(names, 30, cache) == task_dir
    other = write_tasks(names, 31, cache)
    assert other != task_dir and task_digest(other, names[0]) != task_digest(task_dir, names[0])


def test_a_copied_cache_points_its_tasks_at_itself_and_keeps_their_digests(tmp_path):
    """A copy of a cache once read its task data from the original's files (the YAMLs name them by absolute
    path) and, its digests changed, evaluated every model again."""
    import shutil

    names = ["mergeval_chem_count", "mergeval_unit_convert"]
    first = write_tasks(names, 12, tmp_path / "a")
    digests = {n: task_digest(first, n) for n in names}
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")  # the copy must not need the original
    copied = write_tasks(names, 12, tmp_path / "b")
    for name in names:
        yaml = (copied / f"{name}.yaml").read_text()
        assert str(copied / f"{name}.jsonl") in yaml and str(tmp_path / "a") not in yaml
        assert task_digest(copied, name) == digests[name]


@pytest.mark.parametrize(
    "names,n,field", [(["nope"], 10, "benchmark.tasks"), (["mergeval_chem_count"], 0, "benchmark.n_items")]
)
def test_bad_task_settings(cache, names, n, field):
    with pytest.raises(UserError) as err:
        write_tasks(names, n, cache)
    assert err.value.field == field
