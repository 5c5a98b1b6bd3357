"""Hierarchical integration: head alignment is function-preserving and recovers permutations; the cosine LERP."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.methods import get_method
from mergeval.methods.draws import Draws
from mergeval.methods.hierarchical import (
    HierarchicalConfig,
    cosine_weight,
    fill_head_counts,
    head_permutation,
    hierarchical_tensor,
    permute_heads,
)
from tests.strategies import t

HEADS, KV = 4, 2
method = get_method("hierarchical")
CFG = HierarchicalConfig(num_attention_heads=HEADS, num_key_value_heads=KV)


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def layer(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{i}."
    return {n: t.clone() for n, t in state.items() if n.startswith(prefix)}


def random_group_perm(rng: random.Random) -> list[int]:
    per = HEADS // KV
    groups = list(range(KV))
    rng.shuffle(groups)
    perm = []
    for g in groups:
        heads = list(range(g * per, (g + 1) * per))
        rng.shuffle(heads)
        perm.extend(heads)
    return perm


@settings(max_examples=10)
@given(st.integers(0, 1000))
def test_head_permutation_is_function_preserving(seed):
    model = tiny_llama(0)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        before = model(ids).logits
    state = model.state_dict()
    perm = random_group_perm(random.Random(seed))
    state.update(permute_heads(layer(state, 0), "model.layers.0.", perm, HEADS, KV))
    model.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)


@settings(max_examples=10)
@given(st.integers(0, 1000))
def test_alignment_recovers_a_permutation(seed):
    a = layer(tiny_llama(0).state_dict(), 0)
    g = torch.Generator().manual_seed(seed)
    noisy = {n: t + 0.01 * t.std() * torch.randn(t.shape, generator=g) for n, t in a.items()}
    shuffled = permute_heads(noisy, "model.layers.0.", random_group_perm(random.Random(seed)), HEADS, KV)
    perm = head_permutation(a, shuffled, "model.layers.0.", HEADS, KV)
    aligned = permute_heads(shuffled, "model.layers.0.", perm, HEADS, KV)
    for name in a:
        torch.testing.assert_close(aligned[name], noisy[name])


def test_fine_tunes_of_one_base_align_to_identity():
    base = layer(tiny_llama(0).state_dict(), 1)
    g = torch.Generator().manual_seed(3)
    a = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    b = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    assert head_permutation(a, b, "model.layers.1.", HEADS, KV) == list(range(HEADS))


vectors = st.integers(0, 10_000).map(lambda s: torch.randn(20, generator=torch.Generator().manual_seed(s)))


@given(vectors, vectors, st.floats(0, 1))
def test_cosine_weight_range_and_cases(x, y, t_max):
    w = cosine_weight([x], [y], t_max)
    assert 0 <= w <= t_max + 1e-12
    assert cosine_weight([x], [x * 3], t_max) == pytest.approx(t_max)
    assert cosine_weight([x], [-x], t_max) == 0
    assert cosine_weight([x], [torch.zeros_like(x)], t_max) == 0


def test_layer_merge_formula_and_endpoints():
    state = tiny_llama(0).state_dict()
    base = layer(state, 0)
    g = torch.Generator().manual_seed(1)
    d_a = {n: torch.randn(t.shape, generator=g) for n, t in base.items()}
    a = {n: base[n] + d_a[n] for n in base}
    same = method.merge_layer(base, [a, {n: base[n] + 2 * d_a[n] for n in base}], CFG, g)
    for n in base:  # parallel task vectors: cos = 1 -> w = 1 -> B
        torch.testing.assert_close(same[n], base[n] + 2 * d_a[n])
    opposite = method.merge_layer(base, [a, {n: base[n] - d_a[n] for n in base}], CFG, g)
    for n in base:  # opposed task vectors: w = 0 -> the anchor A
        torch.testing.assert_close(opposite[n], a[n])
    half = method.merge_layer(
        base,
        [a, {n: base[n] + 2 * d_a[n] for n in base}],
        HierarchicalConfig(t_max=0.5, num_attention_heads=HEADS, num_key_value_heads=KV),
        g,
    )
    for n in base:
        torch.testing.assert_close(half[n], base[n] + 1.5 * d_a[n])


def test_identical_experts_return_that_model():
    base = layer(tiny_llama(0).state_dict(), 0)
    expert = {n: t + 0.1 for n, t in base.items()}
    out = method.merge_layer(base, [expert, dict(expert)], CFG, Draws(0, "w"))
    for n in base:
        torch.testing.assert_close(out[n], expert[n])


def test_bad_configs():
    with pytest.raises(UserError, match="exactly 2"):
        method.validate(HierarchicalConfig(), 3)
    with pytest.raises(UserError) as err:
        method.validate(HierarchicalConfig(t_max=1.5), 2)
    assert err.value.field == "method.t_max"
    with pytest.raises(UserError) as err:
        fill_head_counts(HierarchicalConfig(), {"num_attention_heads": 4, "num_key_value_heads": 3})
    assert err.value.field == "method.num_attention_heads"
    filled = fill_head_counts(HierarchicalConfig(), {"num_attention_heads": 9, "num_key_value_heads": 3})
    assert (filled.num_attention_heads, filled.num_key_value_heads) == (9, 3)
    # counts given against the base's config.json were once used as given, aligning the wrong head slices
    for counts, key in (
        ({"num_attention_heads": 8}, "num_attention_heads"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ):
        with pytest.raises(UserError, match="the base's config.json says") as err:
            fill_head_counts(HierarchicalConfig(**counts), {"num_attention_heads": 4, "num_key_value_heads": 2})
        assert err.value.field == f"method.{key}"
    same = fill_head_counts(
        HierarchicalConfig(num_attention_heads=4), {"num_attention_heads": 4, "num_key_value_heads": 2}
    )
    assert (same.num_attention_heads, same.num_key_value_heads) == (4, 2)


def test_cosine_weight_at_an_intermediate_angle_by_hand():
    """d_A = (1, 0, 0, 1), d_B = (1, 1, 0, 0): cos = 1 / (sqrt 2 * sqrt 2) = 0.5, so w = t_max * 0.5 (not cos^2 =
    0.25); a layer split over two tensors is one flattened vector: (3, 4) . (4, 3) / 25 = 24 / 25."""
    a, b = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert cosine_weight([a], [b], 1.0) == pytest.approx(0.5)
    assert cosine_weight([a], [b], 0.6) == pytest.approx(0.3)
    parts_a, parts_b = [torch.tensor([3.0]), torch.tensor([4.0])], [torch.tensor([4.0]), torch.tensor([3.0])]
    assert cosine_weight(parts_a, parts_b, 1.0) == pytest.approx(24 / 25)


def test_hierarchical_non_layer_tensor_interpolates_from_the_anchor():
    # d_A = (1, 0), d_B = (1, 1): cos = 1/sqrt2 = w; merged = (1 - w) A + w B = (1, w)
    base, a, b = t(0.0, 0.0), t(1.0, 0.0), t(1.0, 1.0)
    out = hierarchical_tensor(base, [a, b], HierarchicalConfig(align="none"), Draws(0, "w"))
    torch.testing.assert_close(out, t(1.0, 1 / math.sqrt(2)))
