"""Merge methods: a registry from config name to a pure per-tensor function.

A method is a ``MergeMethod``: its config dataclass (the Hydra schema of
``conf/method/<name>.yaml``), a ``validate`` step that checks hyperparameters
before any tensor is read, and ``merge(base, experts, cfg, gen)`` which takes
one tensor of the base and the matching tensor of each expert and returns the
merged tensor. Methods never see files, models or configs of other tensors.
"""

from mergeval.methods.registry import METHODS, MergeMethod, get_method

__all__ = ["METHODS", "MergeMethod", "get_method"]
