"""The merge engine: a plan of units (tensors or layers) run by one executor, into memory or onto disk.

    plan.py       units, depth, per-tensor parameter rules (pure)
    vocab.py      vocabulary policies error / truncate / union (pure)
    reader.py     lazy safetensors reader (one tensor at a time, NaN/Inf checked)
    execute.py    the executor shared by both paths (bit-identical results)
    writer.py     streaming sharded safetensors writer, config and tokenizer copy
    card.py       the model card
    streaming.py  merge_to_disk: bounded-memory merge into a new directory (atomic)
    memory.py     merge_tensors / merge_into_model / save_merged
"""

from mergeval.engine.execute import tensor_seed
from mergeval.engine.memory import merge_into_model, merge_tensors, save_merged
from mergeval.engine.streaming import merge_to_disk
from mergeval.engine.writer import DEFAULT_SHARD_SIZE

__all__ = ["DEFAULT_SHARD_SIZE", "merge_into_model", "merge_tensors", "merge_to_disk", "save_merged", "tensor_seed"]
