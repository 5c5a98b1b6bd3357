"""A saved merge is a complete model directory for the tools users already have: both save paths (the streaming
merge-only engine and the run's ``save_merged``) keep the base's chat template, so a chat model merged by mergeval
formats conversations exactly as its base does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many O atoms in H2O?"}]


@pytest.fixture(scope="module")
def chat_base(tiny_dir, tmp_path_factory) -> Path:
    """The tiny zoo model with a chat template, saved as transformers saves one."""
    from transformers import AutoTokenizer

    base = tmp_path_factory.mktemp("chat") / "base"
    shutil.copytree(tiny_dir, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(base)
    return base


def _same_chat(base: Path, saved: Path) -> None:
    from transformers import AutoTokenizer

    theirs, ours = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(saved)
    assert theirs.chat_template == TEMPLATE and ours.chat_template == TEMPLATE
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )


def test_the_streaming_merge_keeps_the_chat_template(chat_base, tmp_path):
    from mergeval.merge import merge_to_disk
    from mergeval.methods import get_method

    method = get_method("task_arithmetic")
    out = merge_to_disk(method, method.config(), chat_base, [chat_base, chat_base], tmp_path / "merged")
    _same_chat(chat_base, out)


def test_the_runs_saved_merge_keeps_the_chat_template(chat_base, tmp_path):
    from safetensors.torch import load_file

    from mergeval.merge.memory import save_merged
    from mergeval.methods import get_method

    tensors = load_file(chat_base / "model.safetensors")
    out = save_merged(tensors, chat_base, tmp_path / "merged", get_method("task_arithmetic"), card={})
    _same_chat(chat_base, out)
