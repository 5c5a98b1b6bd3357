"""mergeval's basic sweeper for Hydra: Hydra's own, reading ``hydra.sweeper.params`` as mergeval reads a command line."""
