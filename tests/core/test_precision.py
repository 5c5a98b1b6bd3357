"""The default compute precision: bfloat16 where the hardware multiplies it natively, float32 elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

from mergeval.core import precision
from mergeval.models.zoo.experts import expert_key, train_dtype
from mergeval.run.config import register_configs
from mergeval.run.resume import config_hash


@pytest.fixture
def native(monkeypatch):
    """Pretend the CPU does (True) or does not (False) run bfloat16 natively."""

    def set_native(value: bool):
        monkeypatch.setattr(precision, "bf16_native", lambda device="cpu": value)

    return set_native


def composed(*overrides: str):
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("is_native,want", [(True, "bfloat16"), (False, "float32")])
def test_the_default_precision_follows_the_hardware(native, is_native, want):
    native(is_native)
    cfg = composed()
    assert cfg.eval.dtype == want and cfg.modelset.train.dtype == want
    forced = composed("eval.dtype=bfloat16", "modelset.train.dtype=bfloat16")
    assert forced.eval.dtype == forced.modelset.train.dtype == "bfloat16"  # a forced value wins everywhere


def test_on_native_hardware_the_default_hashes_as_the_old_literal_bfloat16(native):
    """A sweep resumed on a bfloat16 machine finds the jobs it recorded before the default became automatic."""
    native(True)
    assert config_hash(composed()) == config_hash(composed("eval.dtype=bfloat16", "modelset.train.dtype=bfloat16"))
    native(False)
    assert config_hash(composed()) == config_hash(composed("eval.dtype=float32", "modelset.train.dtype=float32"))
    assert config_hash(composed()) != config_hash(composed("eval.dtype=bfloat16"))


def test_the_device_is_asked_not_the_cpu(monkeypatch):
    monkeypatch.setattr(precision, "bf16_native", lambda device="cpu": device == "cuda")
    assert composed("eval.device=cuda").eval.dtype == "bfloat16"
    assert composed("eval.device=cuda").modelset.train.dtype == "float32"  # experts are fine-tuned on the CPU


def test_bf16_native_answers_for_this_machine():
    assert isinstance(precision.bf16_native("cpu"), bool)
    assert precision.auto_dtype("cpu") == ("bfloat16" if precision.bf16_native("cpu") else "float32")


def test_float32_experts_get_their_own_cache_key_and_bfloat16_keeps_the_old_one():
    train = dict(steps=30, batch_size=16, lr=5e-5, seed=0)
    bf16 = SimpleNamespace(**train, dtype="bfloat16")
    fp32 = SimpleNamespace(**train, dtype="float32")
    assert expert_key("e9bbcdac5085b7d65c7873f55f4770aa", "chem_count", bf16) == "083227aebcb0fa3c"  # as before
    assert expert_key("e9bbcdac5085b7d65c7873f55f4770aa", "chem_count", fp32) != "083227aebcb0fa3c"
    assert train_dtype(SimpleNamespace(**train)) == precision.auto_dtype("cpu")  # settings without a dtype


def test_fine_tuning_runs_in_either_precision(tiny_dir):
    from transformers import AutoTokenizer

    from mergeval.models.checkpoint import load_model
    from mergeval.models.zoo.domains import split_items
    from mergeval.models.zoo.finetune import finetune

    items, _ = split_items("chem_count", seed=0, n_train=8, n_eval=500)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    before = load_model(tiny_dir, dtype=torch.float32).state_dict()
    after = {}
    for dtype in ("bfloat16", "float32"):
        model = load_model(tiny_dir, dtype=torch.float32)
        losses = finetune(model, tokenizer, items, steps=2, batch_size=4, lr=1e-3, seed=0, dtype=dtype)
        assert all(torch.isfinite(torch.tensor(losses)))
        after[dtype] = model.state_dict()
        assert any(not torch.equal(after[dtype][k], before[k]) for k in before)  # it trained
        assert all(t.dtype == torch.float32 for t in after[dtype].values())  # weights stay float32 either way
    # the precisions differ: bfloat16 autocast rounds the products' inputs, float32 does not
    assert any(not torch.equal(after["bfloat16"][k], after["float32"][k]) for k in before)


def test_the_default_device_is_a_gpu_where_torch_sees_one(monkeypatch):
    """eval.device defaults to auto: resolved when the config is read, so result.json and the store's keys hold
    the device that ran (on a CPU machine the literal "cpu" of before: stored evaluations stay valid)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert composed().eval.device == "cpu"
    assert config_hash(composed()) == config_hash(composed("eval.device=cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precision, "bf16_native", lambda device="cpu": device == "cuda")
    assert composed().eval.device == "cuda" and composed().eval.dtype == "bfloat16"
    assert composed("eval.device=cpu").eval.device == "cpu"  # a named device wins
    assert precision.auto_device("cuda:1") == "cuda:1"


def test_auto_given_as_a_value_is_resolved_before_anything_runs(monkeypatch):
    import torch

    from mergeval.run.checks import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = composed("eval.device=auto")
    validate(cfg)
    assert cfg.eval.device == "cpu" and cfg.eval.dtype == precision.auto_dtype("cpu")
