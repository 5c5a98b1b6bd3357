"""mergeval: merge LLM checkpoints and evaluate the merges, reproducibly."""

__version__ = "0.1.0"
