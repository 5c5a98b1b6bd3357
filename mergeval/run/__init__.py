"""One run and its command line: the config schema and presets (``conf``), the checks done before
anything runs, the orchestration of ``python -m mergeval`` and the sweeps' bookkeeping.
"""
