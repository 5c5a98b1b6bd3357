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


def model_card(method: str, method_version: int, config: dict, inputs: list[dict], tokenizer_from: str) -> str:
    """Markdown: method and its implementation version (``MergeMethod.version``: the same inputs, config and seed
    give the same bits only at the same version), mergeval version, one row per input (role, source, path,
    fingerprint), the config as YAML."""
    rows = "\n".join(
        f"| {i.get('role', '')} | `{i.get('source', '')}` | `{i.get('path', '')}` | "
        f"`{i.get('weights') or i.get('fingerprint', '')}` |"
        for i in inputs
    )  # the tensors' fingerprint
    return f"""---
library_name: transformers
tags:
- mergeval
- merge
---
# Merged model

Merged with mergeval {mergeval_version()} using the `{method}` method, implementation version {method_version}.
config.json and generation_config.json come from the base, the tokenizer from the {tokenizer_from}.

## Inputs

Fingerprint: BLAKE3 (128 bits) over each tensor's name, dtype, shape and bytes (mergeval.models.fingerprint).

| role | source | path | fingerprint |
|---|---|---|---|
{rows}

## Merge configuration

```yaml
{yaml.safe_dump(config, sort_keys=False).rstrip()}
```
"""


def evaluation_section(scores: dict[str, dict[str, dict]], roles: list[str]) -> str:
    """Markdown: one row per task, one column per model, each cell ``value ± stderr`` of the task's metric (the
    metric lm-eval reported and the run shows; ``-`` where lm-eval gives no stderr) and the items scored."""
    lines = [
        "## Evaluation",
        "",
        "Scored by mergeval's run (lm-eval tasks; value ± standard error, n items).",
        "",
        "| task | metric | n | " + " | ".join(roles) + " |",
        "|---|---|---|" + "---|" * len(roles),
    ]
    for task, by_role in scores.items():
        first = next(iter(by_role.values()))
        cells = [_cell(by_role.get(role)) for role in roles]
        lines.append(f"| {task} | {first['metric']} | {first['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(score: dict | None) -> str:
    if score is None:
        return ""
    stderr = "-" if score.get("stderr") is None else f"{score['stderr']:.4f}"
    return f"{score['value']:.4f} ± {stderr}"


def add_evaluation(card_path, scores: dict[str, dict[str, dict]], roles: list[str]) -> None:
    """Append the evaluation table to a saved merge's model card (README.md), atomically."""
    from pathlib import Path

    from mergeval.core.paths import atomic_write_text

    path = Path(card_path)
    atomic_write_text(path, path.read_text().rstrip("\n") + "\n\n" + evaluation_section(scores, roles))


def merge_config(cfg) -> dict:
    """The parts of a run config that determine a merge (for the card): method, modelset, seed, vocab_policy,
    tokenizer_source when set."""
    from mergeval.core.plain import plain_dict

    full = plain_dict(cfg, resolve=True)
    keys = ("method", "modelset", "seed", "vocab_policy") + (
        ("tokenizer_source",) if full.get("tokenizer_source") else ()
    )
    return {key: full.get(key) for key in keys}
