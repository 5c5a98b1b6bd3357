"""The merge methods' counter-based draws (mergeval/methods/draws.py): Threefry-2x32-20 keyed by (seed, tensor,
expert), one uniform per entry from its flat index.

Known answers (Random123's published threefry2x32-20 vectors), the torch definition against a plain transcription
of the algorithm on Python integers, the key derivation as documented, draws that do not depend on how the index
range is split (row blocks) or on the device, a uniform enough distribution, and distinct streams.
The compiled kernels are held to this definition in tests/methods/test_fused.py.
"""

from __future__ import annotations

import hashlib
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.methods import draws
from mergeval.methods.draws import Draws, keep_threshold, key_of, threefry2x32

WORD = st.integers(0, 2**32 - 1)
# starts anywhere, and near and beyond 2^32 (the counter's high word), with odd offsets
STARTS = st.one_of(st.integers(0, 10**6), st.integers(2**32 - 5000, 2**32 + 5000), st.integers(0, 2**40))


def reference(key: tuple[int, int], counter: tuple[int, int]) -> tuple[int, int]:
    """Threefry-2x32-20 on Python integers, step by step as the module's docstring states it."""
    mask = 2**32 - 1
    ks = [key[0], key[1], 0x1BD11BDA ^ key[0] ^ key[1]]
    x0, x1 = (counter[0] + ks[0]) & mask, (counter[1] + ks[1]) & mask
    for r in range(20):
        rot = (13, 15, 26, 6, 17, 29, 16, 24)[r % 8]
        x0 = (x0 + x1) & mask
        x1 = ((x1 << rot) | (x1 >> (32 - rot))) & mask
        x1 ^= x0
        if r % 4 == 3:
            s = (r + 1) // 4
            x0 = (x0 + ks[s % 3]) & mask
            x1 = (x1 + ks[(s + 1) % 3] + s) & mask
    return x0, x1


def words(key, c0: int, c1: int) -> tuple[int, int]:
    x0, x1 = threefry2x32(key, torch.tensor([c0]), torch.tensor([c1]))
    return int(x0), int(x1)


@pytest.mark.parametrize(
    "key,counter,expected",
    [
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ],
)
def test_random123s_known_answers(key, counter, expected):
    """Random123's kat_vectors for threefry2x32 with 20 rounds (the counter's words first, then the key's)."""
    assert words(key, *counter) == expected
    assert reference(key, counter) == expected


@settings(max_examples=200, deadline=None)
@given(WORD, WORD, st.lists(st.tuples(WORD, WORD), min_size=1, max_size=20))
def test_the_torch_definition_is_the_algorithm_on_integers(k0, k1, counters):
    c0 = torch.tensor([c[0] for c in counters])
    c1 = torch.tensor([c[1] for c in counters])
    x0, x1 = threefry2x32((k0, k1), c0, c1)
    assert list(zip(x0.tolist(), x1.tolist())) == [reference((k0, k1), c) for c in counters]
    assert c0.tolist() == [c[0] for c in counters] and c1.tolist() == [c[1] for c in counters]  # inputs kept


def test_the_key_is_sha256_of_seed_name_and_stream_as_documented():
    digest = hashlib.sha256(b"7:model.layers.0.mlp.up_proj.weight:2").digest()
    expected = (int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little"))
    assert key_of(7, "model.layers.0.mlp.up_proj.weight", "2") == expected
    assert Draws(7, "model.layers.0.mlp.up_proj.weight").key(2) == expected
    assert Draws(7, "w").stream(3).key(1) == key_of(7, "w", "3.1")
    assert Draws(7, "w").stream(3).stream(0).key(1) == key_of(7, "w", "3.0.1")


def test_the_draws_of_an_entry_are_pinned():
    """A change of any part of the definition (key, counter, rounds, the 24 bits taken) changes these: stored
    merges of random methods would no longer be reproducible, which needs their methods' versions raised."""
    gen = Draws(7, "model.layers.0.mlp.up_proj.weight")
    start = 2**32 - 2  # the counter's high word changes inside the range
    x0 = [reference(gen.key(1), ((start + j) % 2**32, (start + j) >> 32))[0] for j in range(4)]
    u = gen.uniform(1, (2, 2), start=start)
    assert u.dtype == torch.float32 and u.shape == (2, 2)
    assert u.reshape(-1).tolist() == [(x >> 8) * 2.0**-24 for x in x0]
    assert [x >> 8 for x in x0] == PINNED


PINNED = [1008113, 9845937, 3674821, 7931919]  # x0 >> 8 of the four entries above


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(-(2**63), 2**63),
    expert=st.integers(0, 20),
    start=STARTS,
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=8),
    density=st.sampled_from([0.0, 1e-9, 0.1, 0.5, 0.7, 1 - 2**-25, 1.0]),
)
def test_any_split_of_the_index_range_draws_what_one_call_draws(seed, expert, start, sizes, density):
    """Row blocks of any size at any offset get the entries' own draws, whatever the definition's own steps."""
    gen = Draws(seed, "t")
    total = sum(sizes)
    with mock.patch.object(draws, "CHUNK_CPU", 97):  # steps that split the range as well
        whole_u, whole_keep = gen.uniform(expert, (total,), start), gen.keep(expert, (total,), density, start)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    pieces_u = [gen.uniform(expert, (n,), start + o) for o, n in zip(offsets, sizes)]
    pieces_keep = [gen.keep(expert, (n,), density, start + o) for o, n in zip(offsets, sizes)]
    assert torch.equal(torch.cat(pieces_u), whole_u)
    assert torch.equal(torch.cat(pieces_keep), whole_keep)
    assert torch.equal(whole_keep, whole_u < density)  # keep is u < density, compared in float32


@given(st.one_of(st.floats(0.0, 1.0), st.sampled_from([1e-9, 2**-25, 0.7, 0.1, 1 - 2**-25, 1.0])))
def test_the_threshold_splits_the_uniforms_where_density_does(density):
    t = keep_threshold(density)
    u = torch.tensor([m * 2.0**-24 for m in (t - 1, t) if 0 <= m < 2**24], dtype=torch.float32)
    kept = (u < density).tolist()  # torch's own comparison, in float32
    assert kept == [m < t for m in (t - 1, t) if 0 <= m < 2**24]


def test_shapes_are_filled_in_row_major_order():
    gen = Draws(3, "w")
    assert torch.equal(gen.uniform(0, (3, 5, 7), start=11).reshape(-1), gen.uniform(0, (105,), start=11))
    assert gen.uniform(0, ()).shape == () and gen.uniform(0, (0, 4)).shape == (0, 4)


N = 1 << 20
BINS = 64


def test_the_uniforms_are_uniform_enough():
    """2^20 draws of one stream, at an offset past 2^32: the mean within 6 standard errors of 1/2 (sd of one draw
    1/sqrt(12)), a chi-square over 64 equal bins below 63 + 6 sqrt(2 * 63) (its mean plus 6 sd; 63 degrees of
    freedom), and the keep frequency at density 0.3 within 6 standard errors. The draws are fixed: these hold or
    fail for good, and a generator as broken as a constant word, a stuck bit or a repeated block fails them all."""
    u = Draws(11, "model.embed_tokens.weight").uniform(1, (N,), start=2**32 - N // 2).double()
    assert abs(float(u.mean()) - 0.5) < 6 * (1 / 12) ** 0.5 / N**0.5
    counts = torch.bincount((u * BINS).long(), minlength=BINS).double()
    chi2 = float(((counts - N / BINS) ** 2 / (N / BINS)).sum())
    assert chi2 < (BINS - 1) + 6 * (2 * (BINS - 1)) ** 0.5
    kept = Draws(11, "model.embed_tokens.weight").keep(1, (N,), 0.3).double().mean()
    assert abs(float(kept) - 0.3) < 6 * (0.3 * 0.7 / N) ** 0.5
    # every one of the 24 bits is set about half the time
    m = (u * 2**24).long()
    for bit in range(24):
        assert abs(float(((m >> bit) & 1).double().mean()) - 0.5) < 6 * 0.5 / N**0.5, bit


def test_different_seeds_tensors_experts_and_stages_draw_different_streams():
    """Each (seed, name, stream) keys its own stream: the same entries' uniforms differ between any two of them,
    and are uncorrelated (|r| below 6 / sqrt(n))."""
    n = 1 << 16
    variants = {
        "base": Draws(0, "a.weight").uniform(0, (n,)),
        "seed": Draws(1, "a.weight").uniform(0, (n,)),
        "name": Draws(0, "b.weight").uniform(0, (n,)),
        "expert": Draws(0, "a.weight").uniform(1, (n,)),
        "stage": Draws(0, "a.weight").stream(0).uniform(0, (n,)),
        "negative seed": Draws(-1, "a.weight").uniform(0, (n,)),
    }
    items = list(variants.items())
    for i, (a, x) in enumerate(items):
        for b, y in items[i + 1 :]:
            assert float((x == y).double().mean()) < 0.001, (a, b)  # equal draws only by chance (2^-24 each)
            r = float(torch.corrcoef(torch.stack([x.double(), y.double()]))[0, 1])
            assert abs(r) < 6 / n**0.5, (a, b, r)
    keys = {Draws(s, t).stream(g).key(e) for s in (0, 1) for t in ("a", "b", "a:1") for g in (0, 1) for e in (0, 1)}
    keys |= {Draws(s, t).key(e) for s in (0, 1) for t in ("a", "b", "a:1") for e in (0, 1)}
    assert len(keys) == 2 * 3 * 2 * 2 + 2 * 3 * 2


def test_the_meta_device_computes_shapes_only_without_the_cpu():
    """The torch definition runs wholly on the device it is given (tests/merge/test_merge_device.py's meta device)."""
    gen = Draws(0, "w")
    u = gen.uniform(1, (5, 3), start=2**33, device="meta")
    k = gen.keep(1, (5, 3), 0.4, start=2**33, device="meta")
    assert u.device.type == "meta" and u.dtype == torch.float32 and u.shape == (5, 3)
    assert k.device.type == "meta" and k.dtype == torch.bool and k.shape == (5, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_draws_the_cpus_bits():
    gen = Draws(5, "model.layers.3.self_attn.q_proj.weight")
    for start in (0, 12_345, 2**32 - 100_000):
        cpu_u, cpu_keep = gen.uniform(2, (300_000,), start), gen.keep(2, (300_000,), 0.37, start)
        assert torch.equal(gen.uniform(2, (300_000,), start, device="cuda").cpu(), cpu_u)
        assert torch.equal(gen.keep(2, (300_000,), 0.37, start, device="cuda").cpu(), cpu_keep)
