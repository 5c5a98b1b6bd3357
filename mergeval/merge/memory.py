"""In-memory merges: the same plan and executor as the streaming merge, without writing a checkpoint.

``merge_tensors`` merges tensors already in memory into a dict (what a run
evaluates); ``merge_into_model`` reads the checkpoints lazily and writes each
merged tensor straight into a live model's parameters (a sweep needs no
second copy of the weights); ``save_merged`` writes a merge kept in memory
as a model directory with the streaming writer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mergeval.core.errors import UserError
from mergeval.core.paths import atomic_dir
from mergeval.merge.card import model_card
from mergeval.merge.execute import Blocks, output_shapes, placement, run_plan
from mergeval.merge.plan import build_plan, check_plan
from mergeval.merge.reader import CheckpointReader, MemorySource
from mergeval.merge.slices import build_model, n_experts, open_inputs, rewrite_config
from mergeval.merge.vocab import keep_base_rows, vocab_rows
from mergeval.merge.writer import DEFAULT_SHARD_SIZE, ShardWriter, copy_model_files, output_specs
from mergeval.methods import MergeMethod


def merge_tensors(
    method: MergeMethod,
    cfg: Any,
    base: Mapping[str, torch.Tensor],
    experts: list[Mapping[str, torch.Tensor]] | Mapping[str, Mapping[str, torch.Tensor]],
    seed: int,
    progress: bool = True,
    vocab_policy: str = "error",
    dirs: Mapping[str, Path] | None = None,
    blocks: bool = True,
    device=None,
) -> dict[str, torch.Tensor]:
    """merged[name] = method.merge(base[name], [e[name] for e in experts], unit cfg, Draws(seed, name)),
    or the layer's tensors from method.merge_layer for layer methods (see plan.py for units and rules).

    ``experts`` is a list or a mapping modelset name -> tensors; ``dirs`` (role -> checkpoint directory, "base"
    included) only names where a bad tensor came from, as the streaming merge does. ``blocks=False`` merges
    every tensor whole (the reference the row blocks are held to). ``device``: where to merge (``merge.device``:
    a device name, or an ``execute.Device``; None or cpu: on the CPU), the results on the CPU either way."""
    named = experts.items() if isinstance(experts, Mapping) else enumerate(experts)
    dirs = dirs or {}
    b = MemorySource(base, "modelset.base", dirs.get("base"))
    es = [MemorySource(e, f"modelset.experts.{k}", dirs.get(str(k))) for k, e in named]
    return merge_sources(method, cfg, b, es, seed, progress, vocab_policy, blocks, device=device)


def merge_sources(
    method: MergeMethod,
    cfg: Any,
    b,
    es: list,
    seed: int,
    progress: bool = False,
    vocab_policy: str = "error",
    blocks: bool = True,
    prepared: dict | None = None,
    device=None,
) -> dict[str, torch.Tensor]:
    """:func:`merge_tensors` of reader.py sources: tensors in memory (``MemorySource``) or checkpoints read a
    tensor or row block at a time (``CheckpointReader``: only the merge is held, not its inputs).
    ``prepared``: a dict to pass again with the same sources (run_plan: TIES' cuts computed once per density)."""
    rows = vocab_rows(b.shapes, [e.shapes for e in es], [e.label for e in es], vocab_policy)
    plan = build_plan(method, cfg, b.dtypes)
    check_plan(method, plan, len(es))
    plan = keep_base_rows(plan, rows, vocab_policy)
    out = {}
    # large tensors in row blocks, as a run's and merge_to_disk's merges take them (the same bits as the whole
    # tensor: tests/merge/test_rows.py), so they get the compiled kernels and every core; merged whole, a large tensor
    # runs on one worker while the others idle
    for name, merged in run_plan(
        plan, method, b, es, seed, rows, progress, blocks=blocks, prepared=prepared, device=placement(device)
    ):
        if isinstance(merged, Blocks):
            whole = torch.empty(b.shapes[name], dtype=b.dtypes[name])
            copy_blocks(merged, whole)
            merged = whole
        out[name] = merged
    return out


def copy_blocks(blocks: Blocks, target: torch.Tensor) -> None:
    """Each merged row block copied into its rows of ``target`` (cast to its dtype), in order as it comes.

    Here the consuming thread copies (the writer has the workers write: writer.ShardWriter._write_in_place):
    copying into a live model's tensors from the workers gains no speed (benchmarks/live_merge.py compares
    the two), and a worker still finishing a block after
    an interruption would change the caller's model after the merge had stopped."""
    rows = target.view(target.shape[0], -1)
    for (r0, r1), block in zip(blocks.spans, blocks):
        rows[r0:r1].copy_(block.reshape(r1 - r0, -1))


def merge_into_model(
    model: torch.nn.Module,
    method: MergeMethod,
    cfg: Any,
    base_dir: Path,
    expert_dirs: list[Path] | Mapping[str, Path],
    seed: int = 0,
    vocab_policy: str = "error",
    progress: bool = False,
    slices: list | None = None,
    device=None,
) -> torch.nn.Module:
    """Overwrite ``model``'s weights (a model built from ``base_dir``) with the merge of the checkpoints.

    Memory: the model plus one unit's inputs, or for a large tensor of a method with a row-chunked form
    (TIES, DARE) a few row blocks of each input, rather than a whole tensor of every input at once, which
    grows with the number of experts (benchmarks/live_merge.py measures the peak). The model keeps its dtype (merging
    runs in float32 per unit; results are cast on copy). vocab_policy=truncate
    changes shapes and needs a model of the truncated size: merge to disk instead. ``slices``: layer slices
    (merge/slices.py; the model must have their architecture: ``slices.build_model``).
    ``device``: where each unit is merged (``merge_tensors``); the model stays where it is.
    """
    named = {
        str(k): Path(p)
        for k, p in (expert_dirs.items() if isinstance(expert_dirs, Mapping) else enumerate(expert_dirs))
    }
    method.validate(cfg, n_experts(slices) if slices else len(named))
    base, experts, layer_t = open_inputs(base_dir, named, vocab_policy, slices)
    rows = vocab_rows(base.shapes, [e.shapes for e in experts], [e.label for e in experts], vocab_policy)
    plan = build_plan(method, cfg, base.dtypes, layer_t)
    check_plan(method, plan, len(experts))
    plan = keep_base_rows(plan, rows, vocab_policy)
    state = model.state_dict()  # shares storage with the parameters (tied weights share one tensor)
    for name, shape in output_shapes(plan, base.shapes, rows).items():
        if name not in state:
            raise ValueError(f"checkpoint tensor {name} is not in the model's state dict")
        if tuple(state[name].shape) != shape:
            raise UserError(
                "vocab_policy",
                f"the merge gives {name} shape {list(shape)} but the live model has {list(state[name].shape)}",
                "merge to disk (python -m mergeval.merge) for truncate, or keep the base's rows: vocab_policy=base",
            )
    with torch.no_grad():
        for name, merged in run_plan(
            plan, method, base, experts, seed, rows, progress, blocks=True, device=placement(device)
        ):
            if isinstance(merged, Blocks):  # a large tensor merged a row block at a time: each block into its rows
                copy_blocks(merged, state[name])
            else:
                state[name].copy_(merged)
    return model


class CheckpointView(Mapping):
    """A live model's weights as its checkpoint holds them: the checkpoint's tensor names (tied weights once)
    and dtypes. Each tensor is cast when read, so hashing or writing the view never holds a second copy."""

    def __init__(self, model: torch.nn.Module, dtypes: Mapping[str, torch.dtype]):
        self.state, self.dtypes = model.state_dict(), dict(dtypes)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[name].detach().to(self.dtypes[name])

    def __iter__(self):
        return iter(self.dtypes)

    def __len__(self) -> int:
        return len(self.dtypes)


def merge_live(
    method: MergeMethod,
    cfg: Any,
    base_dir: Path,
    expert_dirs: Mapping[str, Path],
    seed: int,
    vocab_policy: str = "error",
    dtype: torch.dtype = torch.float32,
    slices: list | None = None,
    device=None,
) -> tuple[torch.nn.Module, CheckpointView]:
    """The merge as a model built from the base, each merged tensor streamed into its parameters (memory: one
    model plus one unit's inputs, whatever the number of experts), and its checkpoint view.

    The model is in ``dtype`` (the one it will be evaluated in) where every floating tensor of the base's
    checkpoint has that dtype, else in float32. Each merged tensor is rounded to its checkpoint dtype before
    it is stored (run_plan), so either holds it exactly; a bfloat16 checkpoint evaluated in bfloat16 (a GPU,
    a CPU with AMX) then needs half the memory of the float32 model it used to build. ``slices``: layer
    slices (merge/slices.py): the model is built with their layer count. ``device``: where each unit is merged
    (``merge.device``; the model is built and filled on the CPU)."""
    from mergeval.models.checkpoint import load_model

    if slices:
        dtypes = open_inputs(base_dir, expert_dirs, vocab_policy, slices)[0].dtypes
    else:
        dtypes = CheckpointReader(base_dir, "modelset.base").dtypes
    floating = {d for d in dtypes.values() if d.is_floating_point}
    live = dtype if floating == {dtype} else torch.float32
    dirs = {"base": base_dir, **{str(k): v for k, v in expert_dirs.items()}}
    model = build_model(base_dir, slices, dirs, live) if slices else load_model(Path(base_dir), dtype=live)
    model = merge_into_model(
        model, method, cfg, base_dir, expert_dirs, seed, vocab_policy, progress=True, slices=slices, device=device
    )
    return model, CheckpointView(model, dtypes)


def save_merged(
    tensors: Mapping[str, torch.Tensor],
    base_dir: Path,
    out_dir: Path,
    method: MergeMethod,
    card: dict,
    shard_size: int = DEFAULT_SHARD_SIZE,
    out_dtype: str | None = None,
    slices: list | None = None,
    model_dirs: Mapping[str, Path] | None = None,
) -> Path:
    """Write in-memory merged tensors as a model directory (atomic; config and tokenizer from the base).

    ``card``: ``{"config": dict, "inputs": [{role, source, path, fingerprint}]}`` for README.md.
    ``out_dtype``: the dtype name floating tensors are written in (None: as they are).
    ``slices``: the merge's layer slices (merge/slices.py), whose config.json it writes from ``model_dirs``
    (model name -> checkpoint directory, "base" included).
    """
    specs = output_specs({n: (tuple(tensors[n].shape), tensors[n].dtype) for n in sorted(tensors)}, out_dtype)
    text = model_card(method.name, method.version, card.get("config", {}), card.get("inputs", []), "base")
    with atomic_dir(Path(out_dir)) as tmp:
        writer = ShardWriter(tmp, specs, shard_size)
        try:
            for name in specs:
                writer.write(name, tensors[name].to(specs[name][1]))
            writer.finish()
        finally:
            writer.close()
        copy_model_files(tmp, Path(base_dir), Path(base_dir), out_dtype=out_dtype)
        if slices:
            rewrite_config(tmp, slices, model_dirs or {"base": base_dir})
        (tmp / "README.md").write_text(text)
    return Path(out_dir)
