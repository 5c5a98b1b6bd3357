"""Row-chunked merges (methods/rows.py) and the tie order of TIES' trim (methods/select.py).

A tensor merged in row blocks must equal, bit for bit, the whole-tensor merge; the trim keeps the
first k of a stable descending sort of |d|, whatever the number of tied entries at the cut.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from mergeval.merge import execute, merge_tensors, merge_to_disk
from mergeval.merge import reader as reader_module
from mergeval.merge.memory import merge_into_model
from mergeval.merge.reader import CheckpointReader
from mergeval.methods import fused, get_method, select
from mergeval.methods.draws import Draws
from mergeval.methods.select import Threshold, first_k_mask
from mergeval.methods.task_vector import disjoint_merge, kept_count, trim_to_density
from mergeval.models.checkpoint import load_model, load_tensors


def stable_top_k(a: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: the first k of a stable descending sort of a (ties by position)."""
    keep = torch.zeros(a.numel(), dtype=torch.bool)
    keep[torch.sort(a.reshape(-1), descending=True, stable=True).indices[:k]] = True
    return keep.view_as(a)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5000), st.integers(1, 50), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.data()
)
def test_kth_smallest_is_torchs_kthvalue(n, levels, dtype, data):
    # NumPy's introselect on the CPU: the same order statistic, ties and repeated values included
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    a = (torch.randint(-levels, levels + 1, (n,), generator=g).double() * torch.rand(1, generator=g).item()).to(dtype)
    k = data.draw(st.integers(1, n))
    assert select.kth_smallest(a, k) == float(a.kthvalue(k).values)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 70_000), st.integers(1, 6), st.floats(0.01, 0.99), st.integers(0, 2**31 - 1))
def test_first_k_mask_is_the_first_k_of_a_stable_sort(n, levels, density, seed):
    # few distinct magnitudes: many entries tie at the cut; above SMALL entries the sampled threshold runs
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, levels + 1, (n,), generator=g).float() * 0.25
    k = kept_count(density, n)
    assert torch.equal(first_k_mask(a, k) | (a == 0), stable_top_k(a, k) | (a == 0))  # zeros: kept or not, same
    assert int(first_k_mask(a, k).sum()) == k or float(a.reshape(-1).sort().values[-k]) == 0


def test_trim_keeps_the_first_tied_entries_by_position():
    delta = torch.tensor([1.0, -3.0, 2.0, 3.0, -3.0, 3.0])
    assert trim_to_density(delta, 0.5).tolist() == [0.0, -3.0, 0.0, 3.0, -3.0, 0.0]


def test_the_sampled_threshold_counts_ties_per_chunk():
    a = torch.tensor([5.0, 2.0, 2.0, 1.0, 2.0, 2.0, 0.0, 2.0] * 8192)
    chunks = a.split(10_000)
    t = Threshold(a.numel(), 3 * 8192)
    for c in chunks:
        t.sample(c)
    for c in chunks:
        t.count(c)
    tau, c_gt, c_eq = t.result()
    assert (tau, c_gt, c_eq) == (2.0, 8192, 5 * 8192)
    assert t.chunk_ties == [int((c == 2.0).sum()) for c in chunks]
    assert select.tie_quotas(t.chunk_ties, 2 * 8192) == [
        min(max(0, 2 * 8192 - sum(t.chunk_ties[:i])), x) for i, x in enumerate(t.chunk_ties)
    ]


@pytest.fixture(scope="module")
def tied_experts(tiny_dir, tmp_path_factory) -> list[Path]:
    """Experts whose deltas take few distinct values, so every trim cut falls inside a run of ties."""
    root = tmp_path_factory.mktemp("tied")
    base = load_file(str(tiny_dir / "model.safetensors"))
    out = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        tensors = {
            n: (t + 2.0**-7 * torch.randint(-2, 3, t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t)
            for n, t in base.items()
        }
        shutil.copytree(tiny_dir, root / f"e{i}")
        save_file(tensors, str(root / f"e{i}" / "model.safetensors"), metadata={"format": "pt"})
        out.append(root / f"e{i}")
    return out


@pytest.mark.parametrize(
    "name,params",
    [
        ("ties", {"density": 0.3}),
        ("ties", {"density": 0.5, "sign_rule": "count", "per_expert": [{"density": 1.0}, {}, {"density": 0.2}]}),
        ("dare_ties", {"density": 0.4}),
        ("dare_ties", {"density": 0.6, "rescale": "none", "per_expert": [{}, {"density": 1.0}, {}]}),
        ("dare_linear", {"density": 0.5, "weights": [0.5, 1.0, -0.25], "normalize": True}),
        ("task_arithmetic", {"lambda_": 0.7, "weights": [0.5, 1.0, -0.25], "normalize": True}),
        ("linear", {"weights": [0.2, 0.3, 0.5]}),
        ("linear", {"include_base": True, "normalize": False}),
        # compat=mergekit (rows.GtaRows): the whole-tensor keep rules (argsort's order at the tied cuts these experts
        # make, the draws, the L1 norms) made in prepare, then gta block by block
        ("ties", {"density": 0.3, "compat": "mergekit"}),
        (
            "ties",
            {
                "density": 0.5,
                "compat": "mergekit",
                "rescale": "l1",
                "weights": [1.0, -0.7, 0.4],
                "per_expert": [{"density": 1.0}, {}, {"density": 0.2}],
            },
        ),
        ("dare_ties", {"density": 0.4, "compat": "mergekit"}),
        (
            "dare_linear",
            {"density": 0.5, "compat": "mergekit", "rescale": "none", "weights": [0.5, 1.0, -0.25], "normalize": True},
        ),
        ("task_arithmetic", {"lambda_": 0.7, "compat": "mergekit", "weights": [0.5, 1.0, -0.25]}),
    ],
)
@pytest.mark.parametrize("compiled", [False, True] if fused.available() else [False])
def test_row_blocks_equal_the_whole_tensor_merge_bit_for_bit(
    name, params, compiled, tiny_dir, tied_experts, tmp_path, monkeypatch
):
    # every tensor of 2+ rows in blocks of about 300 entries: many blocks, ties split across blocks
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    method = get_method(name)
    cfg = method.config(**params)
    monkeypatch.setattr(fused, "MIN_ENTRIES", 1 << 62)  # the whole-tensor reference: torch's code throughout
    whole = merge_tensors(
        method, cfg, load_tensors(tiny_dir), [load_tensors(p) for p in tied_experts], seed=7, blocks=False
    )
    # compiled: the blocks (and the draws) through fused.py's kernels, held to the torch reference
    monkeypatch.setattr(fused, "MIN_ENTRIES", 2 if compiled else 1 << 62)
    out = merge_to_disk(method, cfg, tiny_dir, tied_experts, tmp_path / "out", seed=7)
    reader = CheckpointReader(out, "out")
    assert sorted(reader.names()) == sorted(whole)
    for n in whole:
        assert torch.equal(reader.get(n), whole[n]), n
        assert torch.equal(reader.get(n).signbit(), whole[n].signbit()), n  # zeros of the same sign too
    assert method.rows(cfg, len(tied_experts), 10**6, Draws(0, "w")) is not None or name == "linear"
    # a run's merge into the live model takes the same row blocks
    live = merge_into_model(load_model(tiny_dir), method, cfg, tiny_dir, tied_experts, seed=7).state_dict()
    for n in whole:
        assert torch.equal(live[n], whole[n].to(live[n].dtype)), n
    # and so does an in-memory merge of tensors already loaded (a staged sweep's)
    in_memory = merge_tensors(method, cfg, load_tensors(tiny_dir), [load_tensors(p) for p in tied_experts], seed=7)
    for n in whole:
        assert in_memory[n].dtype == whole[n].dtype and torch.equal(in_memory[n], whole[n]), n


@pytest.mark.parametrize("compiled", [False, True] if fused.available() else [False])
@pytest.mark.parametrize("name", ["dare_ties", "dare_linear"])
def test_dare_row_blocks_merged_in_any_order_draw_their_own_entries(name, compiled, monkeypatch):
    """No draw depends on another: blocks of odd sizes merged last first give the whole tensor's merge."""
    g = torch.Generator().manual_seed(0)
    shape = (700, 301)
    base = torch.randn(shape, generator=g)
    experts = [base + 0.1 * torch.randn(shape, generator=g) for _ in range(3)]
    method = get_method(name)
    cfg = method.config(density=0.4, per_expert=[{}, {"density": 1.0}, {"density": 0.7}])
    monkeypatch.setattr(fused, "MIN_ENTRIES", 2 if compiled else 1 << 62)
    gen = fused.CompiledDraws(5, "model.layers.0.mlp.up_proj.weight")
    whole = method.merge(base, experts, cfg, gen)
    merger = method.rows(cfg, len(experts), base.numel(), gen)
    merger.prepare(None)  # nothing to prepare: it reads no block
    out = torch.empty_like(base)
    for r0, r1 in reversed(execute.row_spans(shape, 3001)):
        out[r0:r1] = merger.merge(r0 * shape[1], base[r0:r1], [e[r0:r1] for e in experts])
    assert torch.equal(out.view(torch.int32), whole.view(torch.int32))


@pytest.mark.parametrize("n_experts", [5, 6, 9])
@pytest.mark.parametrize("weights_before_election", [False, True])
def test_the_election_of_an_entry_does_not_depend_on_where_it_is(n_experts, weights_before_election):
    # blocks of any size give the whole tensor's bits only if each entry's sums over the experts do not depend
    # on its position: torch's sum(0) of five or more rows orders the columns past the last full vector chunk
    # differently (task_vector.sum_in_order); 67 columns split at 30 put different columns in those places
    g = torch.Generator().manual_seed(n_experts)
    sparse = torch.randn(n_experts, 67, generator=g) * 10.0 ** torch.randint(-6, 3, (n_experts, 67), generator=g)
    sparse[torch.rand(n_experts, 67, generator=g) < 0.3] = 0.0
    cfg = get_method("ties").config(
        weights=[0.5 + i / 7 for i in range(n_experts)], weights_before_election=weights_before_election
    )
    whole = disjoint_merge(sparse, cfg)
    pieces = torch.cat(
        [disjoint_merge(sparse[:, :30].contiguous(), cfg), disjoint_merge(sparse[:, 30:].contiguous(), cfg)]
    )
    assert torch.equal(whole.view(torch.int32), pieces.view(torch.int32))


@pytest.mark.parametrize(
    "name,params", [("ties", {"density": 0.3}), ("dare_ties", {"density": 0.4}), ("task_arithmetic", {"lambda_": 0.7})]
)
@pytest.mark.parametrize("compiled", [False, True] if fused.available() else [False])
def test_in_memory_inputs_of_any_layout_merge_as_contiguous_ones(
    name, params, compiled, tiny_dir, tied_experts, monkeypatch
):
    """Tensors in memory may be views with other strides (transposed storage here); the row blocks must not
    care: the compiled count once wrote into a flat copy of a strided scratch buffer and read stale memory."""
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    monkeypatch.setattr(fused, "MIN_ENTRIES", 2 if compiled else 1 << 62)
    method = get_method(name)
    cfg = method.config(**params)
    base, experts = load_tensors(tiny_dir), [load_tensors(p) for p in tied_experts]
    whole = merge_tensors(method, cfg, base, experts, seed=3, blocks=False)

    def strided(tensors):
        return {n: t.t().contiguous().t() if t.dim() == 2 else t for n, t in tensors.items()}

    inputs = [strided(base)] + [strided(e) for e in experts]
    assert not all(t.is_contiguous() for t in inputs[0].values())
    before = [{n: t.clone() for n, t in d.items()} for d in inputs]
    merged = merge_tensors(method, cfg, inputs[0], inputs[1:], seed=3)
    for n in whole:
        assert torch.equal(merged[n], whole[n]), n
    for d, kept in zip(inputs, before):  # the inputs are only read
        assert all(torch.equal(d[n], kept[n]) for n in d)


@pytest.mark.parametrize(
    "name,params",
    [
        ("dare_ties", {"density": 0.5}),
        ("dare_linear", {"density": 0.5}),
        ("ties", {"density": 0.5, "rescale": "l1"}),
        ("task_arithmetic", {}),
    ],
)
def test_compat_row_blocks_of_strided_inputs_equal_their_whole_tensor_merge(name, params):
    """compat=mergekit's L1 factor is a sum over the whole d_i, which adds in memory order: GtaRows takes the
    inputs as the whole-tensor merge gets them (a transposed view's factor, as it once did not, differed in
    65-85K of 590K entries)."""
    g = torch.Generator().manual_seed(0)
    shape = (1024, 576)  # transposed storage; 589,824 entries: row blocks at the default size
    base = {"w": torch.randn(shape, generator=g).t()}
    experts = [
        {"w": (base["w"].t() + torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 1, shape, generator=g)).t()}
        for _ in range(3)
    ]
    method = get_method(name)
    cfg = method.config(compat="mergekit", **params)
    assert method.rows(cfg, 3, 589_824, Draws(0, "w")) is not None
    whole = merge_tensors(method, cfg, base, experts, seed=0, progress=False, blocks=False)["w"]
    blocks = merge_tensors(method, cfg, base, experts, seed=0, progress=False)["w"]
    assert torch.equal(whole.contiguous().view(torch.int32), blocks.contiguous().view(torch.int32))


@pytest.mark.parametrize("n_experts", [4, 5, 9])
@pytest.mark.parametrize(
    "name,params", [("task_arithmetic", {}), ("ties", {"density": 0.5}), ("dare_linear", {"density": 0.5})]
)
def test_compat_row_blocks_equal_the_whole_merge_for_any_number_of_experts(name, params, n_experts):
    """torch's sum(0) over 5+ rows groups them one way in its vectorized body and another in its scalar tail, so a
    block whose size is not a multiple of the vector width moves sums by an ulp (67 columns: 3912-row blocks of
    262,104 entries); compat merges of 5+ experts therefore keep the whole-tensor code."""
    g = torch.Generator().manual_seed(n_experts)
    shape = (4000, 67)
    base = {"w": torch.randn(shape, generator=g)}
    experts = [
        {"w": base["w"] + torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 1, shape, generator=g)}
        for _ in range(n_experts)
    ]
    method = get_method(name)
    cfg = method.config(compat="mergekit", **params)
    assert (method.rows(cfg, n_experts, 268_000, Draws(0, "w")) is None) == (n_experts > 4)
    whole = merge_tensors(method, cfg, base, experts, seed=0, progress=False, blocks=False)["w"]
    blocks = merge_tensors(method, cfg, base, experts, seed=0, progress=False)["w"]
    assert torch.equal(whole.view(torch.int32), blocks.view(torch.int32))


@pytest.mark.parametrize("compiled", [False, True] if fused.available() else [False])
def test_ties_cuts_shared_across_a_sweeps_candidates_give_each_candidates_own_merge(
    compiled, tiny_dir, tied_experts, monkeypatch
):
    """A staged sweep merges the same inputs once per candidate with one ``prepared`` dict: TIES' cut at a
    density is computed once and reused by the candidates that differ in lambda, weights or sign rule only."""
    from mergeval.merge.memory import merge_sources
    from mergeval.merge.reader import MemorySource
    from mergeval.methods.rows import TiesRows

    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    monkeypatch.setattr(fused, "MIN_ENTRIES", 2 if compiled else 1 << 62)
    prepares = []
    real_prepare = TiesRows.prepare
    monkeypatch.setattr(TiesRows, "prepare", lambda self, blocks: (prepares.append(1), real_prepare(self, blocks)))
    base, experts = load_tensors(tiny_dir), [load_tensors(p) for p in tied_experts]
    sources = [MemorySource(base, "modelset.base")] + [
        MemorySource(e, f"modelset.experts.{i}") for i, e in enumerate(experts)
    ]
    method, prepared = get_method("ties"), {}
    candidates = [
        {"density": 0.3, "lambda_": 0.5},
        {"density": 0.3, "lambda_": 1.5, "weights": [1.0, 0.5, 2.0]},
        {"density": 0.5, "lambda_": 1.0},
        {"density": 0.3, "lambda_": 1.0, "sign_rule": "count"},
        {"density": 0.3, "per_expert": [{"density": 1.0}, {}, {"density": 0.2}]},
    ]
    counts = []
    for params in candidates:
        cfg = method.config(**params)
        before = len(prepares)
        merged = merge_sources(method, cfg, sources[0], sources[1:], seed=5, prepared=prepared)
        counts.append(len(prepares) - before)
        whole = merge_tensors(method, cfg, base, experts, seed=5, blocks=False)
        for n in whole:
            assert torch.equal(merged[n], whole[n]), (params, n)
    # cuts computed for the first candidate at each set of densities only
    assert counts[0] > 0 and counts[1] == 0 and counts[2] == counts[0] and counts[3] == 0 and counts[4] == counts[0]


def test_a_missed_sampled_bound_falls_back_to_an_exact_pass(tiny_dir, tied_experts, tmp_path, monkeypatch):
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    monkeypatch.setattr(Threshold, "result", lambda self: None)
    method = get_method("ties")
    cfg = method.config(density=0.3)
    out = merge_to_disk(method, cfg, tiny_dir, tied_experts, tmp_path / "out", seed=0)
    monkeypatch.undo()
    whole = merge_tensors(
        method, cfg, load_tensors(tiny_dir), [load_tensors(p) for p in tied_experts], seed=0, blocks=False
    )
    reader = CheckpointReader(out, "out")
    for n in whole:
        assert torch.equal(reader.get(n), whole[n]), n


def test_the_live_merge_benchmark_reports_the_merge_a_run_makes(tiny_dir, tied_experts):
    # benchmarks/live_merge.py compares checkouts by the fingerprint it prints: it must be the live model's
    import re
    import subprocess
    import sys

    from mergeval.models.fingerprint import fingerprint_state_dict

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "live_merge.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--base",
            str(tiny_dir),
            "--experts",
            *map(str, tied_experts),
            "--method",
            "ties:density=0.3",
            "dare_ties:density=0.5,rescale=none",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    printed = dict(re.findall(r"^(\S+): median .* fingerprint (\w+);", out.stdout, re.M))
    for text, name, params in (
        ("ties:density=0.3", "ties", {"density": 0.3}),
        ("dare_ties:density=0.5,rescale=none", "dare_ties", {"density": 0.5, "rescale": "none"}),
    ):
        method = get_method(name)
        live = merge_into_model(load_model(tiny_dir), method, method.config(**params), tiny_dir, tied_experts, seed=0)
        assert printed[text] == fingerprint_state_dict(dict(live.state_dict())), text


def _poisoned(tiny_dir: Path, experts: list[Path], root: Path, where: list[int], bad: float) -> tuple[Path, list[Path]]:
    """Copies of the base (0) and the experts (1 + i) with ``bad`` at one entry of a projection where ``where``
    names them."""
    out = []
    for k, src in enumerate([tiny_dir, *experts]):
        dst = root / f"m{k}"
        shutil.copytree(src, dst)
        if k in where:
            tensors = load_file(str(dst / "model.safetensors"))
            tensors["model.layers.1.mlp.up_proj.weight"][5, 3] = bad
            save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        out.append(dst)
    return out[0], out[1:]


@pytest.mark.skipif(not fused.available(), reason="needs numba")
@pytest.mark.parametrize(
    "name,params",
    [
        ("dare_ties", {"density": 0.4}),
        ("ties", {"density": 0.3}),
        ("dare_linear", {"density": 0.5, "weights": [0.5, 1.0, -0.25]}),
    ],
)
@pytest.mark.parametrize(
    "where,named",
    [([0], "modelset.base"), ([2], "modelset.experts.1"), ([3, 0], "modelset.base"), ([3, 1], "modelset.experts.0")],
)
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nan_in_a_block_the_kernel_merges_is_the_readers_one_line_error(
    name, params, where, named, bad, tiny_dir, tied_experts, tmp_path, monkeypatch
):
    """The compiled kernel counts NaN and Inf as it reads, so the engine leaves out the readers' pass over the
    blocks it merges (execute.Blocks.merged); a block it refuses gets the readers' error: the same field (the
    base first, then the experts in order), tensor and directory as for any other merge, and no output."""
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    monkeypatch.setattr(fused, "MIN_ENTRIES", 2)
    base, experts = _poisoned(tiny_dir, tied_experts, tmp_path, where, bad)
    method = get_method(name)
    cfg = method.config(**params)
    with pytest.raises(UserError) as err:
        merge_to_disk(method, cfg, base, experts, tmp_path / "out", seed=7)
    assert err.value.field == named
    directory = base if named == "modelset.base" else experts[int(named.rsplit(".", 1)[1])]
    assert f"tensor model.layers.1.mlp.up_proj.weight in {directory} contains NaN or Inf" in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError) as err:  # tensors in memory: the same
        merge_tensors(method, cfg, load_tensors(base), [load_tensors(p) for p in experts], seed=7)
    assert err.value.field == named and "model.layers.1.mlp.up_proj.weight" in str(err.value)


@pytest.mark.skipif(not fused.available(), reason="needs numba")
def test_the_readers_skip_their_nan_pass_over_the_blocks_the_kernel_merges(
    tiny_dir, tied_experts, tmp_path, monkeypatch
):
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    checked = []
    real = reader_module.check_finite
    monkeypatch.setattr(reader_module, "check_finite", lambda t, *a: checked.append(t.numel()) or real(t, *a))
    method = get_method("dare_ties")
    counts = {}
    for compiled in (False, True):
        monkeypatch.setattr(fused, "MIN_ENTRIES", 2 if compiled else 1 << 62)
        checked.clear()
        merge_to_disk(method, method.config(density=0.4), tiny_dir, tied_experts, tmp_path / f"out{compiled}", seed=7)
        counts[compiled] = sum(checked)
    entries = sum(t.numel() for t in load_tensors(tiny_dir).values() if t.is_floating_point())
    assert counts[False] == 4 * entries  # the base and three experts, every entry once
    assert counts[True] < counts[False] / 4  # only what the kernel does not merge (1-row tensors)
