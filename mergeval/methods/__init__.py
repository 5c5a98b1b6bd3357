# ruff: noqa: I001  (the registration order below matters)
"""Merge methods: a registry from config name to a pure per-tensor function.

A method is a ``MergeMethod``: its config dataclass (the Hydra schema of
``conf/method/<name>.yaml``), a ``validate`` step that checks hyperparameters
before any tensor is read, and ``merge(base, experts, cfg, gen)`` which takes
one tensor of the base and the matching tensor of each expert (and ``gen``, the
tensor's random draws: ``draws.Draws``) and returns the merged tensor. Methods
never see files, models or configs of other tensors.
"""

from mergeval.methods.registry import METHODS, MergeMethod, get_method

# Each family registers its methods when imported (the registry imports none of them: no import cycle), in this
# order: the pipeline's stages name the others, and rows adds the row-block forms of methods registered before.
from mergeval.methods import curriculum, geometric, hierarchical, passthrough, sparsify, task_vector  # noqa: F401
from mergeval.methods import data_aware, masks  # noqa: F401
from mergeval.methods import pipeline  # noqa: F401
from mergeval.methods import rows  # noqa: F401

__all__ = ["METHODS", "MergeMethod", "get_method"]
