"""Foundations every layer shares: user errors, paths and atomic files, process ownership, run-time
switches, the default precision, provenance, a run's outcome and a config node as plain data. Imports nothing
else of mergeval.
"""
