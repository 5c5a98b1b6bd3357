"""Token-aligned vocabularies: experts with different tokenizers merged token by token (``tokenizer_source``).

``tokenizer_source`` names the tokenizer the merged model gets; each model's embedding and lm_head rows are then
moved to that vocabulary's ids by token string before the method sees them, so a token's row is merged with the
rows of the same token in the other models whatever id each model gave it:

    base      the base's tokenizer: tokens the base lacks are dropped from every model
    union     the base's tokenizer extended by every token of the experts' it lacks: first the experts'
              ordinary tokens, then their added (special) tokens, each expert in modelset order and each
              token in the order of its ids there; the base's ids are kept
    <name>    the tokenizer of the expert of that name in the modelset

A model that lacks a token of the merged vocabulary gets a stand-in row there, as mergekit 0.1.5 builds it:
the row of the one model that has the token when only one does; else the base's row when the base has it
(a zero task vector for that expert); else the mean of the rows of the models that have it; zeros when no
model has it. The stand-in rows then enter the method like any other (mergekit does not exclude them).
An expert's ids at or beyond its vocab_size (a tokenizer larger than its embedding) count as absent (the
base's, or the chosen model's, are an error); embedding rows without a token (padding beyond the tokenizer)
are dropped. The merged model's config.json gets the
merged vocabulary's size, and its tokenizer files are that tokenizer's (union: written by transformers).

An expert without tokenizer files is taken to use the base's tokenizer, as in mergekit. Only the
vocabulary tensors (``VOCAB_SUFFIXES``, rows = the model's vocab_size) are aligned, and held in memory for
every model while the merge runs; everything else streams as usual.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mergeval.core.errors import UserError
from mergeval.merge.reader import RowChecks, check_finite
from mergeval.models.checkpoint import read_config, vocab_size
from mergeval.models.fingerprint import TOKENIZER_FILES

VOCAB_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "wte.weight", "embed_out.weight", "word_embeddings.weight")
POLICIES = ("base", "union")


def check_tokenizer_source(source: str | None, experts, vocab_policy: str = "error") -> None:
    """A one-line error for a tokenizer_source that names no model, or that is combined with a vocab_policy."""
    if source is None:
        return
    if source not in POLICIES and source not in experts:
        names = ", ".join([*POLICIES, *experts])
        raise UserError(
            "tokenizer_source",
            f"'{source}' is neither base, union nor an expert of the modelset",
            f"use one of: {names}",
        )
    if vocab_policy != "error":
        raise UserError(
            "tokenizer_source",
            f"aligns the vocabularies by token, and vocab_policy={vocab_policy} aligns them by row",
            "drop one of the two (vocab_policy=error is the default)",
        )


def _has_tokenizer(model_dir: Path) -> bool:
    return (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()


def _load(model_dir: Path, label: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), use_fast=True)
    except (OSError, ValueError, TypeError) as err:
        raise UserError(
            label,
            f"its tokenizer in '{model_dir}' does not load ({str(err).splitlines()[0]})",
            "give the model a tokenizer transformers can load, or merge without tokenizer_source",
        ) from None


def _token_ids(tokenizer, rows: int) -> dict[str, int]:
    """token -> id of the tokens that have an embedding row (id < rows)."""
    return {tok: i for tok, i in tokenizer.get_vocab().items() if i < rows}


def _union(base_tokenizer, others: list) -> Any:
    """The base's tokenizer (a fresh copy) with every token of ``others`` it lacks added: ordinary tokens first,
    then added tokens (their first settings), as mergekit's union orders them."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        base_tokenizer.save_pretrained(tmp)
        out = AutoTokenizer.from_pretrained(tmp, use_fast=True)
    have = set(out.get_vocab())
    plain: list[str] = []
    added: dict[str, Any] = {}  # token -> its AddedToken
    for tokenizer, rows in others:
        special = {info.content: info for i, info in tokenizer.added_tokens_decoder.items() if i < rows}
        for tok, _ in sorted(_token_ids(tokenizer, rows).items(), key=lambda kv: kv[1]):
            if tok in special:
                added.setdefault(tok, special[tok])
            elif tok not in have and tok not in plain:
                plain.append(tok)
    plain = [tok for tok in plain if tok not in added]
    for tok in plain:
        out.add_tokens(tok)
    for info in added.values():
        if info.content not in have:
            out.add_tokens(info)
    return out


class Vocabulary:
    """The merged vocabulary: its tokenizer, its size, and for each model (role ``base`` or an expert's name)
    the row each merged id takes from it (-1: the model lacks that token)."""

    def __init__(self, base_dir: Path, experts: Mapping[str, Path], source: str):
        dirs = {"base": Path(base_dir), **{name: Path(p) for name, p in experts.items()}}
        labels = {"base": "modelset.base", **{name: f"modelset.experts.{name}" for name in experts}}
        if not _has_tokenizer(dirs["base"]):
            raise UserError(
                "modelset.base",
                f"'{dirs['base']}' has no tokenizer, which tokenizer_source needs",
                "give the base its tokenizer files",
            )
        found: dict[str, Any] = {}  # role -> its tokenizer, None where it has none
        rows: dict[str, int | None] = {}
        for role, path in dirs.items():
            found[role] = _load(path, labels[role]) if _has_tokenizer(path) else None
            rows[role] = vocab_size(read_config(path, labels[role]))
        tokenizers = {role: tok or found["base"] for role, tok in found.items()}
        self.source_dir: Path | None = None  # a directory whose tokenizer files are the output's, or None
        if source == "union":
            self.tokenizer = _union(
                tokenizers["base"], [(tokenizers[r], rows[r] or len(tokenizers[r])) for r in experts]
            )
        else:
            role = "base" if source == "base" else source
            self.tokenizer = tokenizers[role]
            self.source_dir = dirs[role] if _has_tokenizer(dirs[role]) else dirs["base"]
        vocab = self.tokenizer.get_vocab()
        self.size = len(vocab)
        if vocab and max(vocab.values()) >= self.size:
            raise UserError(
                "tokenizer_source",
                f"the {source} tokenizer's ids are not 0..{self.size - 1}",
                "choose a tokenizer whose ids have no gaps",
            )
        for role in {"base", "base" if source in POLICIES else source}:  # kept whole: every id needs a row
            have, embedding_rows = len(tokenizers[role].get_vocab()), rows[role]
            if embedding_rows is not None and have > embedding_rows:
                raise UserError(
                    labels[role],
                    f"its tokenizer has {have} tokens but only {embedding_rows} embedding rows",
                    "give it a tokenizer without the tokens beyond its vocab_size",
                )
        self.rows = {}
        for role, tokenizer in tokenizers.items():
            ids = _token_ids(tokenizer, rows[role] or len(tokenizer))
            perm = torch.full((self.size,), -1, dtype=torch.long)
            for tok, i in vocab.items():
                perm[i] = ids.get(tok, -1)
            self.rows[role] = perm
        self.model_rows = rows

    def save(self, out_dir: Path) -> Path:
        """Write the tokenizer files into ``out_dir`` (copied from the model they come from when there is one)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.source_dir is None:
            self.tokenizer.save_pretrained(str(out_dir))
        else:
            for name in TOKENIZER_FILES:
                if (self.source_dir / name).exists():
                    shutil.copy2(self.source_dir / name, out_dir / name)
        return out_dir


def align(tensors: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """role -> one vocabulary tensor of each model with the merged vocabulary's rows (``Vocabulary.rows``), a
    model's missing tokens given the stand-in rows of the module docstring; computed in float32, returned in
    the base's dtype. ``tensors`` and ``rows`` have the same roles, ``base`` first."""
    roles = list(tensors)
    size = len(rows["base"])
    own, present = {}, {}
    for role in roles:
        perm, t = rows[role], tensors[role].float()
        have = perm >= 0
        out = torch.zeros((size, *t.shape[1:]), dtype=torch.float32)
        out[have] = t[perm[have]]
        own[role], present[role] = out, have
    count = torch.stack([present[r] for r in roles]).sum(0)
    total = torch.zeros_like(own["base"])
    for role in roles:  # a model without the token adds zero rows: the sum is over the models that have it
        total = total + own[role]
    shape = (-1,) + (1,) * (total.dim() - 1)
    stand_in = torch.where(present["base"].view(shape), own["base"], total / count.clamp(min=1).view(shape))
    dtype = tensors["base"].dtype
    return {r: torch.where(present[r].view(shape), own[r], stand_in).to(dtype) for r in roles}


class AlignedSource(RowChecks):
    """A reader.py source whose vocabulary tensors are replaced by aligned ones (held in memory)."""

    def __init__(self, inner, aligned: Mapping[str, torch.Tensor]):
        self.inner, self.aligned = inner, dict(aligned)
        self.label, self.where, self._finite = inner.label, inner.where, set()
        self.shapes = {**inner.shapes, **{n: tuple(t.shape) for n, t in self.aligned.items()}}
        self.dtypes = {**inner.dtypes, **{n: t.dtype for n, t in self.aligned.items()}}

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.aligned:
            return self.inner.get(name)
        return check_finite(self.aligned[name], self.label, name, self.where)

    def get_rows(self, name: str, r0: int, r1: int, check: bool = True) -> torch.Tensor:
        if name not in self.aligned:
            return self.inner.get_rows(name, r0, r1, check=check)
        rows = self.aligned[name][r0:r1].contiguous()
        return self.check_rows(name, r0, r1, rows) if check else rows


def vocab_names(source, model_rows: int | None) -> list[str]:
    """The vocabulary tensors of a source: VOCAB_SUFFIXES with as many rows as its vocab_size."""
    return [
        n
        for n in source.names()
        if n.endswith(VOCAB_SUFFIXES)
        and len(source.shapes[n]) >= 2
        and (model_rows is None or source.shapes[n][0] == model_rows)
    ]


def aligned_sources(vocab: Vocabulary, base, experts: list, roles: list[str]) -> tuple[AlignedSource, list]:
    """The base and expert sources (expert ``i`` is modelset role ``roles[i]``) with their vocabulary tensors
    aligned to ``vocab``."""
    names = vocab_names(base, vocab.model_rows["base"])
    sources = {"base": base, **dict(zip(roles, experts))}
    for role, src in sources.items():
        least = vocab.model_rows[role] or 0
        missing = [
            n
            for n in names
            if n not in src.shapes or src.shapes[n][1:] != base.shapes[n][1:] or src.shapes[n][0] < least
        ]
        if missing:
            raise UserError(
                src.label,
                f"has no vocabulary tensor {missing[0]} of the base's width with a row per token of its vocab_size",
                "merge only checkpoints of the same architecture",
            )
    done: dict[str, dict[str, torch.Tensor]] = {role: {} for role in sources}
    for name in names:
        for role, tensor in align({r: s.get(name) for r, s in sources.items()}, vocab.rows).items():
            done[role][name] = tensor
    wrapped = {role: AlignedSource(src, done[role]) for role, src in sources.items()}
    return wrapped["base"], [wrapped[r] for r in roles]
