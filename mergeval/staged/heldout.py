"""Held-out text for the first stage: items of each task's generator that are neither test nor training items.

Why these are disjoint:

- A generated domain task (``mergeval_chem_count``, ``mergeval_unit_convert``)
  tests a prefix of ``eval_items(domain, ·)`` (``benchmark.n_items`` items,
  at most ``EVAL_POOL``), and ``zoo.experts`` trains each expert on
  ``split_items(...)``, which skips every question among the first
  ``EVAL_POOL`` evaluation items. The held-out text is drawn from a third
  stream of the same generator (its own seed string), with every question of
  the whole evaluation pool (a superset of any benchmark's test items) and
  every question of the configured training set (``modelset.train``, exactly
  as ``zoo.experts`` draws it) removed, and duplicates dropped.
- ``mergeval_general_facts`` tests ``general_items(0, n_items)``; the held-out
  text is the rest of that finite pool (351 questions at DATA_VERSION 1): every question of the
  test items is removed. No expert trains on general questions.

An expert given by ``source`` was trained on data mergeval cannot see, so for
its domain the held-out text is only guaranteed to be disjoint from the test items.
"""

from __future__ import annotations

import random

from mergeval.core.errors import UserError
from mergeval.eval.tasks import GENERATED, PREFIX, items_of
from mergeval.models.zoo.domains import DOMAINS, Item, eval_items, split_items
from mergeval.models.zoo.experts import EVAL_POOL

GENERAL_TASK = "mergeval_general_facts"
MAX_DRAWS_PER_ITEM = 50  # a domain whose question space is nearly used up fails fast instead of looping


def task_domain(task: str) -> str | None:
    """The generated training domain a task measures (in either format), or None (general knowledge)."""
    name = items_of(task).removeprefix(PREFIX)
    return name if name in DOMAINS else None


def domain_heldout(domain: str, n: int, train_draws: int, train_seed: int) -> list[Item]:
    """``n`` distinct items of ``domain`` outside its evaluation pool and outside its training items."""
    excluded = {item["question"] for item in eval_items(domain, EVAL_POOL)}
    if train_draws > 0:
        train, _ = split_items(domain, seed=0, n_train=train_draws, n_eval=EVAL_POOL, train_seed=train_seed)
        excluded |= {item["question"] for item in train}
    rng = random.Random(f"{domain}-heldout-0")
    out: list[Item] = []
    for _ in range(MAX_DRAWS_PER_ITEM * n):
        item = DOMAINS[domain](rng)
        if item["question"] not in excluded:
            excluded.add(item["question"])
            out.append(item)
            if len(out) == n:
                return out
    raise UserError(
        "staged.heldout_items",
        f"only {len(out)} held-out {domain} items found outside the test and training items",
        "lower staged.heldout_items",
    )


def general_heldout(n: int, n_items: int) -> list[Item]:
    """Up to ``n`` general questions that are not among the benchmark's ``n_items`` test questions."""
    from mergeval.models.zoo.general import CATEGORIES, general_items

    pool = general_items(0, sum(len(rows) for tables in CATEGORIES.values() for rows, _ in tables))
    tested = {item["question"] for item in GENERATED[GENERAL_TASK](n_items)}
    left = [item for item in pool if item["question"] not in tested]
    if not left:
        raise UserError(
            "benchmark.n_items",
            f"the general pool has no question left outside the {n_items} test questions",
            "lower benchmark.n_items to leave held-out text for stage 1",
        )
    return left[:n]


def heldout_items(tasks: list[str], n: int, n_items: int, trained_domains: set[str], train) -> dict[str, list[Item]]:
    """Per benchmark task, its held-out items (``n`` each; fewer for general_facts if its pool runs short).

    ``trained_domains``: the domains zoo experts are fine-tuned on with ``train``
    (``modelset.train``); their training items are excluded.
    """
    out = {}
    for task in tasks:
        domain = task_domain(task)
        if domain is not None:
            draws = train.steps * train.batch_size if domain in trained_domains else 0
            out[task] = domain_heldout(domain, n, draws, train.seed)
        elif items_of(task) == GENERAL_TASK:
            out[task] = general_heldout(n, n_items)
        else:
            raise UserError(
                "benchmark.tasks",
                f"no held-out text is defined for task '{task}'",
                "drop it from benchmark.tasks for staged evaluation",
            )
    return out
