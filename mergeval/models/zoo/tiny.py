"""A tiny random-initialised Llama with its own small tokenizer, cheap enough to build in every test run.

Same architecture family and code path as SmolLM2 (LlamaForCausalLM, tied
embeddings, grouped-query attention), so tests exercise the real merge and
evaluation path without a real model. The tokenizer is a byte-level BPE
trained on the generated domain text, so lm-eval can run on it.
"""

from __future__ import annotations

import random
from pathlib import Path

from mergeval.core.paths import atomic_dir
from mergeval.models.safetensors_io import cached_build_usable
from mergeval.models.zoo.domains import DOMAINS, QUICKSTART_DOMAINS

ZOO = {
    "tiny": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=0
    )
}


def zoo_dir(name: str, cache: Path) -> Path:
    spec = ZOO[name]
    target = cache / "models" / ("zoo-" + name + "-" + "-".join(f"{v}" for v in spec.values()))
    if not cached_build_usable(target, f"zoo:{name}"):
        with atomic_dir(target) as tmp:
            _build(tmp, **spec)
    return target


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    # Only the original two domains: the tokenizer (and so every tiny-model test) must not change when
    # domains are added.
    for make in (DOMAINS[d] for d in QUICKSTART_DOMAINS):
        for _ in range(200):
            item = make(rng)
            lines.append(f"Question: {item['question']}\nAnswer: " + " ".join(item["choices"]))
    return lines


def _build(out: Path, seed: int, **arch) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_corpus(seed), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        **arch,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
