"""The model card (README.md) written beside a merged model: how it was made, from what.

It holds no timestamp, so merging the same inputs with the same config
reproduces the whole directory byte for byte, card included.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import yaml


def mergeval_version() -> str:
    try:
        return version("mergeval")
    except PackageNotFoundError:
        return "unknown"


def model_card(method: str, config: dict, inputs: list[dict], tokenizer_from: str) -> str:
    """Markdown: method, mergeval version, one row per input (role, source, path, fingerprint), the config as YAML."""
    rows = "\n".join(f"| {i.get('role', '')} | `{i.get('source', '')}` | `{i.get('path', '')}` | "
                     f"`{i.get('fingerprint', '')}` |" for i in inputs)
    return f"""---
library_name: transformers
tags:
- mergeval
- merge
---
# Merged model

Merged with mergeval {mergeval_version()} using the `{method}` method. config.json and
generation_config.json come from the base, the tokenizer from the {tokenizer_from}.

## Inputs

Fingerprint: blake2b over each tensor's name, dtype, shape and bytes (mergeval.models.fingerprint).

| role | source | path | fingerprint |
|---|---|---|---|
{rows}

## Merge configuration

```yaml
{yaml.safe_dump(config, sort_keys=False).rstrip()}
```
"""


def merge_config(cfg) -> dict:
    """The parts of a run config that determine a merge (for the card): method, modelset, seed, vocab_policy."""
    from omegaconf import OmegaConf

    full = OmegaConf.to_container(cfg, resolve=True)
    return {key: full.get(key) for key in ("method", "modelset", "seed", "vocab_policy")}
