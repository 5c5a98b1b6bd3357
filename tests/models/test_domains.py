"""The expert domains: adding one never changes the others' data or cached experts; every domain has its task.

Pure data checks (no model), about a second.
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from mergeval.eval.tasks import GENERATED, POOL, task_items
from mergeval.models.zoo.domains import DOMAIN_VERSION, DOMAINS, QUICKSTART_DOMAINS, split_items
from mergeval.models.zoo.experts import expert_key


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


# Measured on the generators as they were before any domain was added (commit 6a7e412): the quickstart's
# training and evaluation items, and the cache keys of its experts (from SmolLM2's blake2b fingerprint, the scheme
# then; 30 x 16 steps).
@pytest.mark.parametrize(
    "domain,items,key",
    [("chem_count", "8555b15b6700f95f", "083227aebcb0fa3c"), ("unit_convert", "c122b81e7b05a213", "c62889da09b2faea")],
)
def test_quickstart_domains_keep_their_items_and_expert_keys(domain, items, key):
    assert digest(list(split_items(domain, 0, 480, 500))) == items
    train = SimpleNamespace(steps=30, batch_size=16, lr=5e-5, seed=0, dtype="bfloat16")  # bf16 autocast
    assert expert_key("e9bbcdac5085b7d65c7873f55f4770aa", domain, train) == key
    assert domain in QUICKSTART_DOMAINS


def test_every_domain_has_a_version_and_a_task_in_both_formats():
    assert set(DOMAIN_VERSION) == set(DOMAINS) and len(DOMAINS) >= 5
    for domain in DOMAINS:
        assert {f"mergeval_{domain}", f"mergeval_{domain}_mc"} <= set(GENERATED)


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_validation_and_test_splits_are_disjoint(domain):
    name = f"mergeval_{domain}"
    test = {i["question"] for i in task_items(name, 100)}
    validation = task_items(name, 100, split="validation", n_validation=50)
    assert len(validation) == 50 and not test & {i["question"] for i in validation}
    assert POOL[name] == 500


def test_competing_domains_ask_the_same_questions_in_opposite_directions():
    # unit_convert multiplies by 10^k and unit_reduce divides on the same question form: their skills compete
    up, _ = split_items("unit_convert", 0, 50, 10)
    down, _ = split_items("unit_reduce", 0, 50, 10)
    assert all(i["question"].startswith("Convert ") for i in up + down)
    ratio = {round(float(i["question"].split()[1]) / float(i["choices"][i["answer"]].split()[0]), 6) for i in down}
    assert ratio <= {10.0**p for p in range(0, 5)} and len(ratio) > 1
