"""Reading, writing and comparing Hugging Face checkpoint directories.

A checkpoint here is a directory with ``config.json``, ``*.safetensors`` and a
tokenizer. Merging works on the checkpoint's tensors (what the safetensors
files hold, so tied weights appear once), not on a module's state dict.
"""

from __future__ import annotations

import filecmp
import functools
import inspect
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from mergeval.core.errors import UserError
from mergeval.models.safetensors_io import REFETCH, check_checkpoint, read_config, shard_files  # noqa: F401


def tensor_shapes(model_dir: Path, label: str = "modelset") -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the checked safetensors headers only (no tensor data)."""
    return check_checkpoint(model_dir, label)


def load_tensors(model_dir: Path, label: str = "modelset") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (its files checked first: a damaged one is a one-line error)."""
    check_checkpoint(model_dir, label)
    tensors: dict[str, torch.Tensor] = {}
    for path in shard_files(model_dir, label):
        try:
            tensors.update(load_file(str(path)))
        except Exception as err:  # noqa: BLE001  the file changed since it was checked (safetensors' own error)
            raise UserError(label, f"cannot read '{path}' ({err})", REFETCH) from err
    return tensors


# What must agree for two checkpoints to be merged tensor by tensor: equal shapes alone do not prove it (6 heads
# of 8 dims and 4 heads of 12 give the same projections, but the merge would mix unrelated heads).
ARCHITECTURE_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
)


def architecture(config: dict) -> dict:
    """The fields of ARCHITECTURE_FIELDS a config has (``text_config`` of multimodal configs included), with
    ``head_dim`` derived as hidden_size / num_attention_heads where the config leaves it out and
    ``num_key_value_heads`` defaulting to the attention heads, as transformers does. RoPE settings are read
    from both spellings: ``rope_theta``/``rope_scaling`` (transformers 4) and ``rope_parameters`` (5), where a
    ``rope_type`` of ``default`` means no scaling."""
    merged = {**(config.get("text_config") or {}), **config}
    arch = {k: merged[k] for k in ARCHITECTURE_FIELDS if k in merged}
    rope = dict(merged.get("rope_parameters") or {})
    if "rope_theta" in rope:
        arch.setdefault("rope_theta", rope.pop("rope_theta"))
    if rope and rope.get("rope_type", "default") != "default":
        arch.setdefault("rope_scaling", rope)
    if arch.get("rope_scaling") is None or (arch.get("rope_scaling") or {}).get("rope_type") == "default":
        arch.pop("rope_scaling", None)
    heads = arch.get("num_attention_heads")
    if heads and "hidden_size" in arch:
        arch.setdefault("head_dim", arch["hidden_size"] // heads)
        arch.setdefault("num_key_value_heads", heads)
    return arch


VOCAB_POLICIES = ("error", "truncate", "union", "base")
VOCAB_FIX = (
    "merge models that share the base's tokenizer, or set vocab_policy=base (the base's embeddings and "
    "head as they are: experts padded beyond the base), truncate (all to the smallest vocabulary) or union "
    "(the base's vocabulary; the base's rows for tokens an expert lacks)"
)


def check_vocab_policy(policy: str) -> None:
    if policy not in VOCAB_POLICIES:
        raise UserError("vocab_policy", f"unknown policy '{policy}'", f"use one of: {', '.join(VOCAB_POLICIES)}")


def compat_policy(vocab_policy: str, tokenizer_source: str | None) -> str:
    """The vocab_policy ``check_compatible`` checks under: with a tokenizer_source the vocabularies are aligned by
    token (merge/tokens.py), so differing vocabularies and tokenizers are expected (truncate refuses neither)."""
    return "truncate" if tokenizer_source else vocab_policy


def vocab_size(config: dict) -> int | None:
    """``vocab_size`` of a model config (top level, or in ``text_config`` for multimodal configs)."""
    return config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))


def vocab_tensors(
    base_shapes: dict[str, tuple[int, ...]],
    shapes: dict[str, tuple[int, ...]],
    base_vocab: int | None,
    vocab: int | None,
) -> dict[str, tuple[int, ...]]:
    """The tensors whose shapes differ from the base's only because the vocabularies differ.

    A tensor is one when it has rows = the model's vocab_size in each model (dim 0:
    embeddings, lm_head) and otherwise the base's shape. Returns name -> its shape here.
    """
    return {
        name: shape
        for name, shape in shapes.items()
        if name in base_shapes
        and shape != base_shapes[name]
        and len(shape) >= 2
        and shape[1:] == base_shapes[name][1:]
        and shape[0] == vocab
        and base_shapes[name][0] == base_vocab
    }


def check_architecture(field: str, config: dict, base_config: dict) -> None:
    """A UserError naming the first architecture field (ARCHITECTURE_FIELDS) in which ``config`` differs from the
    base's; model_type, hidden_size and num_hidden_layers must be there in both or in neither."""
    arch, base_arch = architecture(config), architecture(base_config)
    for key in ARCHITECTURE_FIELDS:
        if (
            key in arch
            and key in base_arch
            and arch[key] != base_arch[key]
            or key in ("model_type", "hidden_size", "num_hidden_layers")
            and arch.get(key) != base_arch.get(key)
        ):
            raise UserError(
                field,
                f"{key} is {arch.get(key)!r} but the base has {base_arch.get(key)!r}",
                "merge only models of the base's architecture (fine-tuned from the same base)",
            )


def check_compatible(base_dir: Path, others: dict[str, Path], vocab_policy: str = "error") -> None:
    """Fail before merging if an expert's architecture or any tensor shape differs from the base.

    Vocabulary differences (vocab_size and the embedding / lm_head rows) are an
    error naming the tensors and shapes unless ``vocab_policy`` is truncate or
    union; union also refuses an expert with more rows than the base.
    """
    check_vocab_policy(vocab_policy)
    base_cfg, base_shapes = read_config(base_dir, "modelset.base"), tensor_shapes(base_dir, "modelset.base")
    for name, path in others.items():
        field = f"modelset.experts.{name}"
        cfg = read_config(path, field)
        check_architecture(field, cfg, base_cfg)
        shapes = tensor_shapes(path, field)
        missing, extra = sorted(set(base_shapes) - set(shapes)), sorted(set(shapes) - set(base_shapes))
        if missing or extra:
            which = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
            raise UserError(
                field, f"tensor names differ from the base ({which})", "merge only checkpoints of the same architecture"
            )
        vocab = vocab_tensors(base_shapes, shapes, vocab_size(base_cfg), vocab_size(cfg))
        for tensor, shape in shapes.items():
            if shape != base_shapes[tensor] and tensor not in vocab:
                raise UserError(
                    field,
                    f"tensor {tensor} has shape {list(shape)} but the base has {list(base_shapes[tensor])}",
                    "merge only checkpoints with identical shapes",
                )
        if vocab or vocab_size(cfg) != vocab_size(base_cfg):
            check_vocab(field, vocab, base_shapes, vocab_size(base_cfg), vocab_size(cfg), vocab_policy)
        if vocab_policy == "error":
            _check_tokenizer(field, base_dir, path)


# The parts of tokenizer.json that decide which ids a text becomes; not padding or truncation (the evaluation
# sets its own) nor the decoder.
TOKENIZING = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor")


def _tokenizing(model_dir: Path) -> dict | None:
    """TOKENIZING's parts of ``model_dir``'s tokenizer.json; None without a readable one (a model without its
    own tokenizer is evaluated with the base's, which is what it means; a damaged one fails where it loads)."""
    path = model_dir / "tokenizer.json"
    try:
        stat = path.stat()
    except OSError:
        return None
    return _tokenizing_file(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _tokenizing_file(path: str, size: int, mtime_ns: int) -> dict | None:
    """Read once per file version: the base's is compared with every expert's, and a run checks the experts
    twice (given ones before any expert is built, then all), and parsing a multi-megabyte file is not free."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return {key: doc.get(key) for key in TOKENIZING} if isinstance(doc, dict) else None


def _check_tokenizer(field: str, base_dir: Path, path: Path) -> None:
    """Every model of a run is evaluated with the base's tokenizer: an expert that ships another one (same
    vocabulary size, other tokens or rules) would be scored on ids it was never trained on.

    Files with the same bytes are the same tokenizer: comparing bytes, far cheaper than parsing the JSON,
    keeps the check out of a merge's fixed cost, since experts usually carry the base's file unchanged."""
    same_file = (base_dir / "tokenizer.json", path / "tokenizer.json")
    if all(f.is_file() for f in same_file) and filecmp.cmp(*same_file, shallow=False):
        return
    theirs, base = _tokenizing(path), _tokenizing(base_dir)
    if theirs is None or base is None or theirs == base:
        return
    parts = [key for key in TOKENIZING if theirs[key] != base[key]]
    raise UserError(
        field,
        f"its tokenizer differs from the base's ({', '.join(parts)} in tokenizer.json), and "
        "every model is evaluated with the base's",
        "merge models that share the base's tokenizer, or "
        "set vocab_policy=union or truncate to merge across vocabularies anyway",
    )


def check_vocab(
    field: str,
    vocab: dict[str, tuple[int, ...]],
    base_shapes: dict[str, tuple[int, ...]],
    base_vocab: int | None,
    other_vocab: int | None,
    policy: str,
) -> None:
    listed = ", ".join(f"{t} {list(s)} vs the base's {list(base_shapes[t])}" for t, s in sorted(vocab.items()))
    if policy == "error":
        raise UserError(
            field,
            f"vocabulary differs from the base: vocab_size {other_vocab} vs {base_vocab}"
            + (f"; {listed}" if listed else ""),
            VOCAB_FIX,
        )
    if policy == "union" and other_vocab is not None and base_vocab is not None and other_vocab > base_vocab:
        raise UserError(
            field,
            f"has a larger vocabulary than the base ({other_vocab} > {base_vocab}"
            + (f"; {listed}" if listed else "")
            + "), which vocab_policy=union cannot keep",
            "use vocab_policy=truncate, or make the model with the largest vocabulary the base",
        )


def load_model(
    model_dir: Path,
    tensors: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    label: str = "modelset",
):
    """The causal LM in ``model_dir`` in ``dtype``; with ``tensors`` (e.g. a merge kept in memory) loaded over
    its weights. A directory transformers cannot load (a config it rejects, damaged files) is a one-line error
    for ``label``.

    Without ``tensors`` the weights are read straight into ``dtype``: the same bits as reading them in float32
    and casting (each tensor is rounded once either way; the final ``to`` casts the buffers transformers makes
    in float32, as before), without a float32 copy of a bfloat16 model in memory on the way."""
    from transformers import AutoModelForCausalLM

    model = _transformers_load(
        AutoModelForCausalLM, model_dir, label, dtype=torch.float32 if tensors is not None else dtype
    )
    if tensors is not None:
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"tensors not in {model_dir}'s architecture: {result.unexpected_keys[:3]}")
    return model.to(dtype).eval()


def takes_logits_to_keep(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (an int: vocabulary logits only at that many last
    positions; the causal LMs of transformers 4.45 and later do)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def load_tokenizer(model_dir: Path, label: str = "modelset.base"):
    """The tokenizer in ``model_dir``; a missing or damaged one is a one-line error for ``label``."""
    from transformers import AutoTokenizer

    return _transformers_load(AutoTokenizer, model_dir, label)


def _transformers_load(auto, model_dir: Path, label: str, **kwargs):
    try:
        return auto.from_pretrained(model_dir, **kwargs)
    except Exception as err:  # noqa: BLE001  transformers raises many types for a directory it cannot read
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(
            label,
            f"transformers cannot load {auto.__name__} from '{model_dir}' ({type(err).__name__}: {first})",
            REFETCH,
        ) from err
