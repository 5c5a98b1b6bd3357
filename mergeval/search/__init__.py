"""Merge-recipe search: ``python -m mergeval.search`` tunes a method's coefficients with Optuna.

The trials are scored on a **validation split** of the benchmark's generated
tasks (held-out items disjoint from the test items, ``eval/tasks.py``), each in
the stages of ``mergeval/staged`` (perplexity of held-out answers, then a
fraction of the validation items, then the rest), and a trial that falls
behind at a stage is pruned. Only after tuning are the best recipe and the
method's default scored on the **test split**, reported separately.

- ``config``: the ``search`` section's schema and the search's Hydra schema;
- ``space``: the search space (parameter -> range / log / choices), validated up front;
- ``study``: the Optuna study in the results store's database (resumable), samplers, the stage pruner;
- ``trials``: one trial evaluated stage by stage, and its cost;
- ``run``: the whole search, ``report``: its terminal lines and ``search.json``.
"""
