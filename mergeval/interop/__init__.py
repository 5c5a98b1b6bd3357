"""Formats of other tools, in and out: mergekit merge configurations (``mergekit_config``)."""
