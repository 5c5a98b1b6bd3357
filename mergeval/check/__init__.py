"""``python -m mergeval.check``: what a run needs, whether this machine has it, what it costs."""
