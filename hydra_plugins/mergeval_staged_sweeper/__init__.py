"""mergeval's staged sweeper for Hydra: a plain ``-m`` sweep evaluated in stages (``hydra/sweeper=staged``).

Found by Hydra's plugin discovery (the ``hydra_plugins`` namespace package); the
sweeper and its structured config live in ``staged_sweeper.py``, the translation
of a sweep into a staged sweep in ``mergeval/staged/from_sweep.py``.
"""
