"""Foundations every layer shares: user errors, paths and atomic files, process ownership, run-time
switches, the default precision, provenance and a run's outcome as plain data. Imports nothing else of mergeval.
"""
