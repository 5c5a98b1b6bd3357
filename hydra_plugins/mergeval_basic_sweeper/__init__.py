"""mergeval's default sweeper for Hydra: Hydra's basic sweeper, with ``hydra.sweeper.params`` read as the command
line is (``basic_sweeper.py``). Found by Hydra's plugin discovery (the ``hydra_plugins`` namespace package)."""
