"""Layer slices ("frankenmerges", mergekit's ``slices:``): a merged model stacked from layer ranges of models.

``modelset.slices`` lists output slices in order; each takes its layers from one or more sources
``{model: base | <expert name>, layer_range: [start, end)}`` whose ranges have the same length:

    output layers   the slices' layers one after the other: slice s holds the next len(s) layers;
                    output layer k of slice s is layer start + (k - offset of s) of each source
    inputs          position 0 is the slice's source from the base model (else its only source), the
                    others follow in listed order: the method merges them as base and experts
                    (passthrough: one source per slice; slerp, linear...: the same count in every slice)
    other tensors   as mergekit 0.1.5: the ones before the layers (embeddings) from the first slice's
                    sources, the ones after them (final norm, lm_head) from the last slice's
    depth t         per slice, as mergekit: i / (len - 1) for its i-th layer, 1 for a one-layer slice;
                    0 for the tensors outside the layers (mergekit's too)
    config.json     the base's, with num_hidden_layers the output's layer count and every per-layer list
                    (layer_types...) taken entry by entry from the source layers of position 0

The views below present each input position as a checkpoint under the output's tensor names, so the
plan and executor run unchanged (streamed to disk or into a live model).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mergeval.core.errors import UserError
from mergeval.merge.plan import BEFORE_LAYERS, count_layers, layer_of

FIELD = "modelset.slices"


@dataclass(frozen=True)
class Source:
    model: str  # "base" or an expert's modelset name
    start: int
    end: int  # exclusive


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) or hasattr(obj, "get") else getattr(obj, key, None)


def parse(slices: Iterable | None, models: Iterable[str], field: str = FIELD) -> list[list[Source]] | None:
    """The slices of a modelset (dicts, OmegaConf nodes or dataclasses), each a list of sources in input order
    (the base's source first), checked for all that needs no checkpoint; None when there are none."""
    slices = list(slices or [])
    if not slices:
        return None
    known = list(models)
    out: list[list[Source]] = []
    for s, entry in enumerate(slices):
        where = f"{field}[{s}]"
        raw = list(_get(entry, "sources") or [])
        if not raw:
            raise UserError(
                f"{where}.sources", "lists no sources", "give each slice - model: NAME, layer_range: [START, END]"
            )
        sources = []
        for j, src in enumerate(raw):
            at = f"{where}.sources[{j}]"
            model, layers = _get(src, "model"), _get(src, "layer_range")
            if model not in known:
                raise UserError(
                    f"{at}.model", f"'{model}' is not a model of the modelset", f"use one of: {', '.join(known)}"
                )
            layers = list(layers) if layers is not None and not isinstance(layers, (str, int)) else layers
            if (
                not isinstance(layers, list)
                or len(layers) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
            ):
                raise UserError(
                    f"{at}.layer_range",
                    f"must be two layer numbers [start, end), got {layers!r}",
                    "write layer_range: [0, 4] for layers 0 to 3",
                )
            if not 0 <= layers[0] < layers[1]:
                raise UserError(
                    f"{at}.layer_range",
                    f"[{layers[0]}, {layers[1]}) holds no layers",
                    "give 0 <= start < end (end is excluded)",
                )
            sources.append(Source(str(model), layers[0], layers[1]))
        lengths = {x.end - x.start for x in sources}
        if len(lengths) > 1:
            raise UserError(
                f"{where}.sources",
                f"the sources' layer ranges differ in length ({sorted(lengths)})",
                "give every source of a slice the same number of layers",
            )
        if len(sources) > 1:
            from_base = [x for x in sources if x.model == "base"]
            if len(from_base) != 1:
                raise UserError(
                    f"{where}.sources",
                    f"{len(sources)} sources with {len(from_base)} from the base model",
                    "include exactly one range of the base in every slice that merges several"
                    " sources (the method's base), or use one source per slice (passthrough)",
                )
            sources = from_base + [x for x in sources if x.model != "base"]
        if out and len(sources) != len(out[0]):
            raise UserError(
                f"{where}.sources",
                f"{len(sources)} sources but {FIELD}[0] has {len(out[0])}",
                "give every slice the same number of sources (the method merges the same inputs)",
            )
        out.append(sources)
    return out


def n_experts(slices: list[list[Source]]) -> int:
    """How many inputs besides position 0 the method merges in each slice."""
    return len(slices[0]) - 1


def output_layers(slices: list[list[Source]]) -> list[tuple[float, list[tuple[str, int]]]]:
    """Per output layer: (depth t, [(model, source layer) per input position])."""
    out = []
    for sources in slices:
        length = sources[0].end - sources[0].start
        for i in range(length):
            out.append((i / (length - 1) if length > 1 else 1.0, [(x.model, x.start + i) for x in sources]))
    return out


def check_ranges(slices: list[list[Source]], layer_counts: Mapping[str, int], field: str = FIELD) -> None:
    """Each source's range within its model's layers."""
    for s, sources in enumerate(slices):
        for j, x in enumerate(sources):
            count = layer_counts[x.model]
            if x.end > count:
                raise UserError(
                    f"{field}[{s}].sources[{j}].layer_range",
                    f"[{x.start}, {x.end}) reaches past '{x.model}', which has {count} layers (0 to {count - 1})",
                    f"give an end of at most {count}",
                )


class SlicedSource:
    """One input position of a sliced merge as a reader.py source: the output's tensor names, each read from
    the model and tensor it comes from."""

    def __init__(self, mapping: dict[str, tuple[Any, str]], label: str):
        self.mapping, self.label = mapping, label
        self.shapes = {n: src.shapes[name] for n, (src, name) in mapping.items()}
        self.dtypes = {n: src.dtypes[name] for n, (src, name) in mapping.items()}

    def names(self) -> list[str]:
        return list(self.mapping)

    def get(self, name: str) -> torch.Tensor:
        src, inner = self.mapping[name]
        return src.get(inner)

    def get_rows(self, name: str, r0: int, r1: int, check: bool = True, **kwargs) -> torch.Tensor:
        src, inner = self.mapping[name]
        return src.get_rows(inner, r0, r1, check=check, **kwargs)

    def check_rows(self, name: str, r0: int, r1: int, rows: torch.Tensor) -> torch.Tensor:
        src, inner = self.mapping[name]
        return src.check_rows(inner, r0, r1, rows)


def _renamed(name: str, layer: int) -> str:
    of = layer_of(name)
    assert of is not None, "only a layer's tensors are renamed"
    prefix = of[0]
    return f"{prefix.rsplit('.', 1)[0]}.{layer}{name[len(prefix) :]}"


def views(slices: list[list[Source]], sources: Mapping[str, Any]) -> tuple[list[SlicedSource], dict[int, float]]:
    """(one SlicedSource per input position, output layer -> depth t) over ``sources`` (model name -> reader.py
    source); checks every range, and that each position's tensors have the names and shapes of position 0's."""
    check_ranges(slices, {m: count_layers(src.shapes) for m, src in sources.items()})
    by_layer: dict[str, dict[int, list[str]]] = {}
    for m, src in sources.items():
        for name in src.shapes:
            of = layer_of(name)
            if of is not None:
                by_layer.setdefault(m, {}).setdefault(of[1], []).append(name)
    layers = output_layers(slices)
    positions = []
    for p in range(len(slices[0])):
        mapping: dict[str, tuple[Any, str]] = {}
        first, last = sources[slices[0][p].model], sources[slices[-1][p].model]
        for name in first.shapes:
            if layer_of(name) is None and any(key in name for key in BEFORE_LAYERS):
                mapping[name] = (first, name)
        for name in last.shapes:
            if layer_of(name) is None and not any(key in name for key in BEFORE_LAYERS):
                mapping[name] = (last, name)
        for k, (_, inputs) in enumerate(layers):
            model, layer = inputs[p]
            for name in by_layer[model][layer]:
                mapping[_renamed(name, k)] = (sources[model], name)
        positions.append(SlicedSource(dict(sorted(mapping.items())), sources[slices[0][p].model].label))
    for p, view in enumerate(positions[1:], start=1):
        names, base = set(view.shapes), set(positions[0].shapes)
        differ = sorted(names ^ base) or [n for n in sorted(names) if view.shapes[n] != positions[0].shapes[n]]
        if differ:
            raise UserError(
                f"{FIELD}",
                f"the sources at position {p} give {differ[0]} differently from position 0"
                f" ({'missing or extra' if names != base else 'another shape'})",
                "slice only models of the same architecture",
            )
    return positions, {k: t for k, (t, _) in enumerate(layers)}


def sliced_inputs(
    slices: list[list[Source]], base_dir, expert_dirs: Mapping[str, Any], vocab_policy: str = "error"
) -> tuple[SlicedSource, list[SlicedSource], dict[int, float]]:
    """(position 0's view, the other positions' views, output layer -> depth t) over the checkpoints: each
    model of the base's architecture (any layer count), the same tokenizer, every range within its model."""
    from pathlib import Path

    from mergeval.merge.reader import CheckpointReader
    from mergeval.models.checkpoint import _check_tokenizer, check_architecture, read_config

    if vocab_policy != "error":
        raise UserError(
            "vocab_policy",
            f"{vocab_policy} cannot be combined with {FIELD} (the embeddings come "
            "from the first slice's models and lm_head from the last slice's)",
            "slice models with the same vocabulary: vocab_policy=error",
        )
    base_cfg = read_config(Path(base_dir), "modelset.base")
    layers = {k: base_cfg[k] for k in ("num_hidden_layers",) if k in base_cfg}
    readers = {"base": CheckpointReader(Path(base_dir), "modelset.base")}
    for name, path in expert_dirs.items():
        field = f"modelset.experts.{name}"
        check_architecture(field, {**read_config(Path(path), field), **layers}, base_cfg)
        _check_tokenizer(field, Path(base_dir), Path(path))
        readers[str(name)] = CheckpointReader(Path(path), field)
    positions, layer_t = views(slices, readers)
    return positions[0], positions[1:], layer_t


def open_inputs(base_dir, named: Mapping[str, Any], vocab_policy: str, slices: list | None = None):
    """(base source, expert sources, layer depths or None) of a merge, checked compatible: the checkpoints
    themselves, or with ``slices`` one view per input position (``sliced_inputs``)."""
    from pathlib import Path

    from mergeval.merge.reader import CheckpointReader
    from mergeval.models.checkpoint import check_compatible

    if slices:
        return sliced_inputs(slices, base_dir, named, vocab_policy)
    check_compatible(Path(base_dir), dict(named), vocab_policy)
    base = CheckpointReader(Path(base_dir), "modelset.base")
    return base, [CheckpointReader(Path(p), f"modelset.experts.{n}") for n, p in named.items()], None


def sliced_config(config: dict, slices: list[list[Source]], configs: Mapping[str, dict] | None = None) -> dict:
    """config.json of the output: ``config`` (the base's) with num_hidden_layers the output's layer count and
    each per-layer list (one entry per layer: layer_types...) rebuilt entry by entry from position 0's source
    layers, read from that model's own config in ``configs`` (model name -> config.json; else the base's)."""
    layers = output_layers(slices)

    def holder_of(c: dict) -> dict:
        return c if "num_hidden_layers" in c or "text_config" not in c else c["text_config"]

    holder = holder_of(config)
    old = holder.get("num_hidden_layers")
    out = dict(config)
    target = out if holder is config else dict(holder)
    if holder is not config:
        out["text_config"] = target
    target["num_hidden_layers"] = len(layers)
    if not isinstance(old, int):
        return out
    for key, value in holder.items():
        if not isinstance(value, list) or len(value) != old or key == "architectures":
            continue
        per_layer = []
        for _, inputs in layers:
            model, layer = inputs[0]
            own = holder_of((configs or {}).get(model) or config)
            entries = own.get(key)
            if not isinstance(entries, list) or len(entries) != own.get("num_hidden_layers") or layer >= len(entries):
                raise UserError(
                    FIELD,
                    f"config.json's per-layer {key} of '{model}' does not give layer {layer}",
                    "slice models whose config.json lists every layer's entry",
                )
            per_layer.append(entries[layer])
        target[key] = per_layer
    return out


def _configs(dirs: Mapping[str, Any]) -> dict[str, dict]:
    import json
    from pathlib import Path

    return {m: json.loads((Path(d) / "config.json").read_text()) for m, d in dirs.items()}


def model_config(base_dir, slices: list[list[Source]], dirs: Mapping[str, Any]):
    """The transformers config of the sliced model (``sliced_config`` of the base's; ``dirs``: model name ->
    checkpoint directory)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    raw = json.loads((Path(base_dir) / "config.json").read_text())
    edited = sliced_config(raw, slices, _configs(dirs))
    kind = AutoConfig.for_model(raw["model_type"]).__class__
    return kind.from_dict(edited)


def rewrite_config(out_dir, slices: list[list[Source]], dirs: Mapping[str, Any]) -> None:
    """``out_dir``/config.json (written from the base's) made the sliced model's (``dirs``: model name ->
    checkpoint directory)."""
    import json
    from pathlib import Path

    path = Path(out_dir) / "config.json"
    config = sliced_config(json.loads(path.read_text()), slices, _configs(dirs))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_model(base_dir, slices: list[list[Source]], dirs: Mapping[str, Any], dtype: torch.dtype):
    """An (uninitialised-weights) causal LM of the sliced architecture in ``dtype``, for a merge to fill."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(base_dir, slices, dirs), dtype=dtype).eval()
