"""Staged evaluation of a sweep: the evaluation guide's three-stage workflow.

Stage 1 ranks every candidate merge by perplexity on held-out task text
(``heldout``, ``nll``), stage 2 runs a fraction of each benchmark task on the
best ``stage1_keep``, stage 3 completes the benchmark on the best
``stage3_keep``; ``pipeline`` runs them, ``cost`` counts what each spent,
``report`` writes ``staged.json`` and the terminal tables.
"""
