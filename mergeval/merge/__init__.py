"""The merge engine: a plan of units (tensors or layers) run by one executor, into memory or onto disk.

plan.py       units, depth, per-tensor parameter rules (pure)
vocab.py      vocabulary policies error / truncate / union (pure)
tokens.py     tokenizer_source: vocabularies aligned by token (different tokenizers)
reader.py     lazy safetensors reader (one tensor at a time, NaN/Inf checked)
execute.py    the executor shared by both paths (bit-identical results)
writer.py     streaming sharded safetensors writer, config and tokenizer copy
card.py       the model card
streaming.py  merge_to_disk: bounded-memory merge into a new directory (atomic)
memory.py     merge_tensors / merge_into_model / save_merged
"""

# The engine's entry points, loaded on first use: importing the package (as ``python -m mergeval.merge`` does
# before its command module, or a test for one submodule) does not load torch and every engine module.
_PUBLIC = {
    "merge_into_model": "memory",
    "merge_tensors": "memory",
    "save_merged": "memory",
    "merge_to_disk": "streaming",
    "DEFAULT_SHARD_SIZE": "writer",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
