"""Out-of-core merge: checkpoint directories in, a merged checkpoint directory out, bounded memory.

Reads each input tensor lazily, merges one unit (tensor or layer) at a time,
streams the results into sharded safetensors inside a temporary sibling of the
output directory, and renames it into place only when everything (tensors,
index, config, tokenizer, model card) is written. An interrupted or failed
merge leaves no output directory. Peak memory: about (inputs + outputs) x the
largest unit, plus the method's working copies of one unit (benchmarks/merge_memory.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mergeval.core.errors import UserError
from mergeval.core.paths import atomic_dir
from mergeval.merge.card import model_card
from mergeval.merge.execute import output_shapes, placement, run_plan
from mergeval.merge.plan import build_plan, check_plan
from mergeval.merge.slices import n_experts, open_inputs, rewrite_config
from mergeval.merge.tokens import Vocabulary, aligned_sources, check_tokenizer_source
from mergeval.merge.vocab import keep_base_rows, vocab_rows
from mergeval.merge.writer import DEFAULT_SHARD_SIZE, ShardWriter, cast_to, copy_model_files, output_specs
from mergeval.methods import MergeMethod
from mergeval.models.checkpoint import check_vocab_policy, compat_policy, read_config, vocab_size


def merge_to_disk(
    method: MergeMethod,
    method_cfg: Any,
    base_dir: Path,
    expert_dirs: list[Path] | Mapping[str, Path],
    out_dir: Path,
    seed: int = 0,
    vocab_policy: str = "error",
    shard_size: int = DEFAULT_SHARD_SIZE,
    card: dict | None = None,
    progress: bool = False,
    out_dtype: str | None = None,
    tokenizer_source: str | None = None,
    slices: list | None = None,
    device=None,
) -> Path:
    """Merge the checkpoints in ``base_dir`` and ``expert_dirs`` into a new directory ``out_dir``.

    ``expert_dirs``: a list, or a mapping name -> directory (the names appear in
    errors as ``modelset.experts.<name>`` and in the model card). ``card``:
    optional ``{"config": dict, "inputs": [{role, source, path, fingerprint}]}``
    for the model card; by default the card records the method config, seed and
    vocab_policy, and the inputs' paths and fingerprints (computed here).
    ``out_dtype``: the dtype name floating tensors are written in (None: the base's).
    ``tokenizer_source``: base, union or an expert's name: the vocabularies aligned by token (tokens.py).
    ``slices``: ``merge.slices.parse``'s layer slices (a frankenmerge; config.json gets their layer count).
    ``device``: where each unit (or row block) is merged (``merge.device``: a device name or an
    ``execute.Device``; None or cpu: the CPU); one at a time, so the device holds one unit, not the model.
    Every check (config, rules at every tensor, shapes, vocabularies, the output
    path) runs before the first tensor is read.
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    named = {
        str(k): Path(v)
        for k, v in (expert_dirs.items() if isinstance(expert_dirs, Mapping) else enumerate(expert_dirs))
    }
    check_vocab_policy(vocab_policy)
    check_tokenizer_source(tokenizer_source, named, vocab_policy)
    if slices and tokenizer_source is not None:
        raise UserError(
            "tokenizer_source",
            "cannot be combined with modelset.slices yet",
            "merge the slices with the base's tokenizer (tokenizer_source=null)",
        )
    method.validate(method_cfg, n_experts(slices) if slices else len(named))
    if out_dir.exists():
        raise UserError("output", f"'{out_dir}' already exists", "choose a new directory or remove that one")
    base, experts, layer_t = open_inputs(base_dir, named, compat_policy(vocab_policy, tokenizer_source), slices)
    vocab = None
    if tokenizer_source is not None:  # every input's vocabulary tensors in the merged vocabulary's rows
        vocab = Vocabulary(base_dir, named, tokenizer_source)
        base, experts = aligned_sources(vocab, base, experts, list(named))
    rows = vocab_rows(base.shapes, [e.shapes for e in experts], [e.label for e in experts], vocab_policy)
    plan = build_plan(method, method_cfg, base.dtypes, layer_t)
    check_plan(method, plan, len(experts))
    plan = keep_base_rows(plan, rows, vocab_policy)
    specs = output_specs({n: (s, base.dtypes[n]) for n, s in output_shapes(plan, base.shapes, rows).items()}, out_dtype)
    tokenizer_role, tokenizer_dir, out_vocab = output_tokenizer(base_dir, named, vocab_policy if rows else "error")
    if vocab is not None:
        tokenizer_role, out_vocab = f"tokenizer_source={tokenizer_source}", vocab.size
    card = card or {}
    config = card.get("config") or {
        "method": dataclasses.asdict(method_cfg)
        if dataclasses.is_dataclass(method_cfg) and not isinstance(method_cfg, type)
        else dict(method_cfg),
        "seed": seed,
        "vocab_policy": vocab_policy,
        **({"tokenizer_source": tokenizer_source} if tokenizer_source else {}),
    }
    inputs = card.get("inputs") or _input_rows(base_dir, named)
    text = model_card(method.name, method.version, config, inputs, tokenizer_role)
    with atomic_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, specs, shard_size)
        try:
            for name, tensor in run_plan(
                plan, method, base, experts, seed, rows, progress, blocks=True, device=placement(device)
            ):
                writer.write(name, cast_to(tensor, specs[name][1]))
            writer.finish()
        finally:
            writer.close()
        if vocab is not None:
            tokenizer_dir = vocab.save(tmp / ".tokenizer")
        copy_model_files(tmp, base_dir, tokenizer_dir, out_vocab, out_dtype)
        if vocab is not None:
            shutil.rmtree(tokenizer_dir)
        if slices:
            rewrite_config(tmp, slices, {"base": base_dir, **named})
        (tmp / "README.md").write_text(text)
    return out_dir


def output_tokenizer(base_dir: Path, experts: Mapping[str, Path], policy: str) -> tuple[str, Path, int | None]:
    """(role, directory, vocab_size to write or None) of the tokenizer the output gets.

    error / union: the base's (union keeps the base's vocabulary). truncate: the
    input with the smallest vocab_size (the base on a tie), whose ids all exist
    in the truncated embeddings; config.json gets that vocab_size.
    """
    if policy != "truncate":
        return "base", base_dir, None
    best = ("base", base_dir, vocab_size(read_config(base_dir)))
    for name, path in experts.items():
        v = vocab_size(read_config(path))
        if v is not None and (best[2] is None or v < best[2]):
            best = (f"expert {name}", path, v)
    return best


def _input_rows(base_dir: Path, experts: Mapping[str, Path]) -> list[dict]:
    from mergeval.models.fingerprint import fingerprint

    return [
        {"role": role, "source": str(path), "path": str(path), "fingerprint": fingerprint(path)}
        for role, path in [("base", base_dir), *experts.items()]
    ]
