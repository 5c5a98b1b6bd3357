"""Evaluation: generated lm-eval tasks and the lm-eval-harness adapter for in-memory models."""
