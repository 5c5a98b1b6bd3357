"""mergeval's Ray launcher for Hydra: a sweep's jobs as Ray tasks (``hydra/launcher=ray``).

Found by Hydra's plugin discovery (the ``hydra_plugins`` namespace package); the
launcher class and its structured config live in ``ray_launcher.py``. Ray itself
is imported only when a sweep uses the launcher, so Hydra's plugin scan works
without Ray installed.
"""
