"""How data-aware methods read the calibration statistics that ``mergeval.merge.expert_statistics`` computed.

A statistics directory holds ``stats.safetensors`` (one tensor per parameter name, or per shared key) and
``meta.json`` (``aliases``: parameter name -> the shared key, e.g. the q, k and v projections' one Gram
matrix). The methods read one tensor at a time from it while they merge; computing and caching the
statistics is ``mergeval.merge.expert_statistics``'s, a layer above the methods.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

STATS_FILE, META_FILE = "stats.safetensors", "meta.json"


@lru_cache(maxsize=64)
def _aliases(directory: str) -> dict[str, str]:
    return json.loads((Path(directory) / META_FILE).read_text()).get("aliases", {})


def read_stat(directory: str, name: str):
    """One statistic tensor (``name`` is the parameter's name; a shared Gram matrix is found by alias), or None."""
    from safetensors import safe_open

    key = _aliases(directory).get(name, name)
    with safe_open(str(Path(directory) / STATS_FILE), "pt") as f:
        return f.get_tensor(key) if key in f.keys() else None
