"""mergeval's merge methods against mergekit's, on tiny Llama checkpoints.

``compat=mergekit`` (mergeval/methods/compat.py) must give mergekit's tensors within 1e-6 for every
deterministic method mergekit also has, on any input: test_compat_same_tensors_as_mergekit runs them at
densities giving fractional kept counts, with mergekit-only variants (disjoint sum, L1 rescale of TIES,
normalized task arithmetic, breadcrumbs with density + gamma > 1), on the regular experts and on
"anti" experts: quantised task vectors that are negatively correlated (model_stock's t < 0), sum to
exactly 0 on many entries (the sign at a zero sum) and repeat magnitudes (the tie order at the cut).
DARE and DELLA in compat mode match in distribution (the random cases below).

mergekit's own methods (nearswap, nuslerp, multislerp, karcher) have one semantics in mergeval, mergekit's, and
give mergekit's tensors bit for bit (atol=0): the same float32 operations in the same order.

The paper-mode (default) methods with mergekit-like options are compared too. Deterministic methods (linear, task_arithmetic, ties, breadcrumbs, breadcrumbs_ties, slerp,
model_stock, sce) in their mergekit-compatible settings must give every tensor within 1e-5 of
``mergekit.merge.run_merge`` (CPU, float32, no lazy loading). The random methods (dare_linear,
dare_ties, della_linear, della) draw from different generators, so they are compared in
distribution over SEEDS seeds; each statistical check states its tolerance and the size of the
discrepancy it is there to catch.

The mergekit-compatible settings (mergeval's defaults follow the papers instead):
- TIES-style election (ties, breadcrumbs_ties, dare_ties, della): weights_before_election=true,
  and mergekit's normalize=true (mergeval always takes the disjoint mean; mergekit defaults
  dare_ties and breadcrumbs_ties to the disjoint sum).
- dare_* and della*: rescale=l1 (mergekit's rescale=true); della*: rank_scope=row.
- sce: normalize=true, uniform_below=1e-6.
- densities and select_topk that make density * n a whole number for every tensor: mergekit keeps
  floor(density * n) entries, mergeval ceil(density * n).
- model_stock: experts whose task vectors have a positive mean cosine in every tensor (and row):
  mergeval clamps the cosine at 0, mergekit only at -1.

The fixture's experts are base + (shared direction + own noise), scaled per expert and per row, so
their task vectors both agree (positive cosines) and conflict in sign on many entries;
test_fixture_exercises_the_differences checks that, so the comparisons cannot pass vacuously.
"""

from __future__ import annotations

import importlib.util
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from mergeval.merge import merge_tensors
from mergeval.methods import get_method
from mergeval.methods.draws import Draws
from mergeval.methods.sparsify import della_keep_prob

requires_mergekit = pytest.mark.skipif(
    importlib.util.find_spec("mergekit") is None,
    reason="mergekit is not installed; `pip install '.[test]'` installs the pinned version these comparisons need",
)

ARCH = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
EXPERT_SCALES = (1.0, 0.7, 1.4)  # unequal task-vector sizes: SCE's weights and TIES' sum vote matter
SHARED, OWN = 0.04, 0.03  # task vector = SHARED * common + OWN * own noise: mean cosine ~0.6, many sign conflicts
W3 = [1.0, 0.4, 1.6]
ATOL = 1e-5
SEEDS = 64
ZERO = "model.layers.1.post_attention_layernorm.weight"  # all zeros in the third anti expert


# ---------------------------------------------------------------- tiny checkpoints


@dataclass
class Tiny:
    base: Path
    experts: list[Path]  # three experts for the multi-model methods
    small_experts: list[Path]  # the same with task vectors 100x smaller (rms ~4e-4, as the quickstart experts')
    slerp_expert: Path  # one expert with exactly and nearly colinear tensors (slerp's lerp fallback)
    anti: list[Path]  # three experts over a quantised base: d_1 = -d_0 exactly, d_2 zero on half the entries
    root: Path

    def tensors(self, path: Path) -> dict[str, torch.Tensor]:
        return load_file(str(path / "model.safetensors"))


def _save(path: Path, config, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    config.save_pretrained(path)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    return path


def _row_scale(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """One log-normal scale per row of a matrix, as output units of a real network differ in scale."""
    if len(shape) < 2:
        return torch.ones(shape)
    return torch.exp(0.5 * torch.randn(shape[0], 1, generator=g))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("parity")
    config = LlamaConfig(**ARCH, architectures=["LlamaForCausalLM"])  # mergekit picks its layout by this
    with torch.random.fork_rng():  # a seeded init that leaves the session's global generator alone
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    base = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(0)
    for name in base:  # RMSNorm weights start at exactly 1: make their magnitudes distinct so rankings are unique
        if name.endswith("norm.weight"):
            base[name] = 1.0 + 0.1 * torch.randn(base[name].shape, generator=g)
    experts: list[dict[str, torch.Tensor]] = [{} for _ in EXPERT_SCALES]
    for name, b in base.items():
        common, rows = torch.randn(b.shape, generator=g), _row_scale(b.shape, g)
        for expert, scale in zip(experts, EXPERT_SCALES):
            expert[name] = b + scale * rows * (SHARED * common + OWN * torch.randn(b.shape, generator=g))
    slerp = {name: b + 0.05 * _row_scale(b.shape, g) * torch.randn(b.shape, generator=g) for name, b in base.items()}
    slerp["model.norm.weight"] = 1.3 * base["model.norm.weight"]  # colinear: cos = 1
    slerp["model.layers.0.input_layernorm.weight"] = base["model.layers.0.input_layernorm.weight"] + 1e-3 * torch.randn(
        32, generator=g
    )  # cos ~ 1 - 1e-7, above the 0.9995 threshold
    # Quantised on a grid of 2^-6 (base) and 2^-8 (deltas) so every e - b is exact in float32:
    # d_0 + d_1 = 0 bit for bit, and magnitudes repeat (ties at every trimming cut).
    qbase = {name: torch.round(b * 64) / 64 for name, b in base.items()}
    anti: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for name, b in qbase.items():
        c = torch.round(8 * torch.randn(b.shape, generator=g)) / 256
        half = torch.rand(b.shape, generator=g) < 0.5
        own = torch.where(half, torch.zeros_like(b), torch.round(4 * torch.randn(b.shape, generator=g)) / 256)
        anti[0][name], anti[1][name], anti[2][name] = b + c, b - c, b + own
    anti[2][ZERO] = torch.zeros_like(qbase[ZERO])  # a zero tensor: slerp's zero-norm case
    anti_root = root / "anti"
    anti_root.mkdir()
    return Tiny(
        base=_save(root / "base", config, base),
        experts=[_save(root / f"expert{i}", config, e) for i, e in enumerate(experts)],
        small_experts=[
            _save(root / f"small{i}", config, {n: base[n] + 0.01 * (e[n] - base[n]) for n in base})
            for i, e in enumerate(experts)
        ],
        slerp_expert=_save(root / "slerp", config, slerp),
        anti=[_save(anti_root / "base", config, qbase)]
        + [_save(anti_root / f"e{i}", config, e) for i, e in enumerate(anti)],
        root=root,
    )


# ---------------------------------------------------------------- running both tools


def run_mergekit(
    tiny: Tiny,
    method: str,
    models: list[tuple[Path, dict]],
    parameters: dict,
    base: bool | Path = True,
    seed: int | None = None,
) -> dict[str, torch.Tensor]:
    """mergekit's merge of ``models`` (each with its per-model parameters), read back and deleted."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    config = {
        "merge_method": method,
        "dtype": "float32",
        "out_dtype": "float32",
        "parameters": parameters,
        "models": [{"model": str(path), **({"parameters": p} if p else {})} for path, p in models],
    }
    if base:
        config["base_model"] = str(tiny.base if base is True else base)
    out = tiny.root / f"mergekit-{uuid.uuid4().hex}"
    options = MergeOptions(
        device="cpu", lazy_unpickle=False, copy_tokenizer=False, write_model_card=False, quiet=True, random_seed=seed
    )
    run_merge(MergeConfiguration.model_validate(config), str(out), options)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    shutil.rmtree(out)
    return tensors


def run_mergeval(
    tiny: Tiny, method: str, params: dict, experts: list[Path], seeds=(0,), base: Path | None = None
) -> list[dict[str, torch.Tensor]]:
    """mergeval's in-memory merge, once per seed."""
    merge = get_method(method)
    cfg = merge.config(**params)
    merge.validate(cfg, len(experts))
    base, tuned = tiny.tensors(base or tiny.base), [tiny.tensors(p) for p in experts]
    return [merge_tensors(merge, cfg, base, tuned, seed, progress=False) for seed in seeds]


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], atol: float = ATOL) -> None:
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------- deterministic methods: same tensors


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    ours: dict  # mergeval's method config
    shared: dict  # mergekit's global parameters
    per_model: dict  # mergekit's per-expert parameters (besides weight)
    weights: tuple[float, ...] | None = None  # per expert, both tools (mergekit needs one for task-vector methods)


def C(id, method, ours=None, shared=None, per_model=None, weights=None) -> Case:
    return Case(id, method, ours or {}, shared or {}, per_model or {}, tuple(weights) if weights else None)


TIES_LIKE = {"weights_before_election": True}
DETERMINISTIC = [
    C("linear", "linear", {"weights": [1.0, 2.0, 0.5]}, {"normalize": True}, weights=[1.0, 2.0, 0.5]),
    C(
        "linear-sum",
        "linear",
        {"weights": [1.0, 2.0, 0.5], "normalize": False},
        {"normalize": False},
        weights=[1.0, 2.0, 0.5],
    ),
    C("task_arithmetic", "task_arithmetic", {}, {"lambda": 1.0}, weights=[1, 1, 1]),
    C("task_arithmetic-weighted", "task_arithmetic", {"lambda_": 0.7, "weights": W3}, {"lambda": 0.7}, weights=W3),
    C("ties", "ties", {"density": 0.5, **TIES_LIKE}, {"normalize": True}, {"density": 0.5}, weights=[1, 1, 1]),
    C(
        "ties-weighted",
        "ties",
        {"density": 0.25, "lambda_": 0.8, "weights": W3, **TIES_LIKE},
        {"normalize": True, "lambda": 0.8},
        {"density": 0.25},
        weights=W3,
    ),
    C(
        "breadcrumbs",
        "breadcrumbs",
        {"density": 0.75, "gamma": 0.01},
        {},
        {"density": 0.75, "gamma": 0.01},
        weights=[1, 1, 1],
    ),
    C(
        "breadcrumbs-weighted",
        "breadcrumbs",
        {"density": 0.5, "gamma": 0.05, "lambda_": 0.9, "weights": W3},
        {"lambda": 0.9},
        {"density": 0.5, "gamma": 0.05},
        weights=W3,
    ),
    C(
        "breadcrumbs_ties",
        "breadcrumbs_ties",
        {"density": 0.75, "gamma": 0.01, **TIES_LIKE},
        {"normalize": True},
        {"density": 0.75, "gamma": 0.01},
        weights=[1, 1, 1],
    ),
    C(
        "breadcrumbs_ties-weighted",
        "breadcrumbs_ties",
        {"density": 0.5, "gamma": 0.05, "weights": W3, **TIES_LIKE},
        {"normalize": True},
        {"density": 0.5, "gamma": 0.05},
        weights=W3,
    ),
    C("model_stock", "model_stock", {}),
    C("model_stock-filter_wise", "model_stock", {"filter_wise": True}, {"filter_wise": True}),
    C("sce", "sce", {"normalize": True, "uniform_below": 1e-6}, {"select_topk": 1.0}),
    C("sce-topk", "sce", {"normalize": True, "uniform_below": 1e-6, "select_topk": 0.5}, {"select_topk": 0.5}),
]


# Task vectors 100x smaller (the scale of a light fine-tune) only for the methods that do not rank
# entries: float32 quantises such deltas coarsely (a 32-entry RMSNorm delta near 1.0 has ~2,000 levels),
# so equal magnitudes appear at the trimming cut, and which of them is kept is arbitrary in both tools.
# model_stock filter_wise is left out too: mergekit clamps |d_i| |d_j| at 1e-6, which shrinks the
# cosine of the fixture's small 32-entry rows (not of real rows: 576 entries of rms 5e-4 have norm ~0.01).
SMALL = {"linear", "linear-sum", "task_arithmetic", "task_arithmetic-weighted", "model_stock", "sce"}


@requires_mergekit
@pytest.mark.parametrize(
    "case,size",
    [(c, "large") for c in DETERMINISTIC] + [(c, "small") for c in DETERMINISTIC if c.id in SMALL],
    ids=lambda v: v.id if isinstance(v, Case) else v,
)
def test_same_tensors_as_mergekit(tiny, case, size):
    experts = tiny.experts if size == "large" else tiny.small_experts
    models = [
        (path, {**case.per_model, **({"weight": w} if case.weights else {})})
        for path, w in zip(experts, case.weights or [None] * len(experts))
    ]
    theirs = run_mergekit(tiny, case.method, models, case.shared, base=case.method != "linear")
    assert_same_tensors(run_mergeval(tiny, case.method, case.ours, experts)[0], theirs)


@requires_mergekit
def test_linear_with_the_base_as_a_model(tiny):
    weights = [0.5, 1.0, 1.0, 1.0]
    theirs = run_mergekit(
        tiny,
        "linear",
        [(p, {"weight": w}) for p, w in zip([tiny.base, *tiny.experts], weights)],
        {"normalize": True},
        base=False,
    )
    (ours,) = run_mergeval(tiny, "linear", {"weights": weights, "include_base": True}, tiny.experts)
    assert_same_tensors(ours, theirs)


@requires_mergekit
@pytest.mark.parametrize("t", [0.0, 1e-4, 0.01, 1.0])
def test_nearswap_same_tensors_as_mergekit_bit_for_bit(tiny, t):
    theirs = run_mergekit(tiny, "nearswap", [(tiny.base, {}), (tiny.slerp_expert, {})], {"t": t})
    assert_same_tensors(run_mergeval(tiny, "nearswap", {"t": t}, [tiny.slerp_expert])[0], theirs, atol=0)


SPHERICAL = {
    "flat": {},
    "rows": {"nuslerp_flatten": False},
    "columns": {"nuslerp_flatten": False, "nuslerp_row_wise": True},
}


@requires_mergekit
@pytest.mark.parametrize("shape", SPHERICAL)
@pytest.mark.parametrize("weights", [(1.0, 0.4), (0.3, 0.3), (1.0, -1.0)])
def test_nuslerp_same_tensors_as_mergekit_bit_for_bit(tiny, shape, weights):
    """With base_model: b + slerp of the two experts' task vectors; without: the two models themselves (the
    slerp expert has a colinear tensor, cos = 1, and one at cos ~ 1 - 1e-7: the lerp branch and next to it)."""
    params = SPHERICAL[shape]
    theirs = run_mergekit(tiny, "nuslerp", [(p, {"weight": w}) for p, w in zip(tiny.experts, weights)], params)
    ours = run_mergeval(tiny, "nuslerp", {**params, "weights": list(weights)}, tiny.experts[:2])[0]
    assert_same_tensors(ours, theirs, atol=0)
    pair = [tiny.base, tiny.slerp_expert]
    theirs = run_mergekit(tiny, "nuslerp", [(p, {"weight": w}) for p, w in zip(pair, weights)], params, base=False)
    ours = run_mergeval(
        tiny, "nuslerp", {**params, "weights": list(weights), "include_base": True}, [tiny.slerp_expert]
    )[0]
    assert_same_tensors(ours, theirs, atol=0)


MULTISLERP = [  # (models besides the base, weights, normalize_weights)
    (2, (1.0, 0.4), True),
    (3, tuple(W3), True),
    (3, tuple(W3), False),
    (3, (0.2, 0.3, 0.1), False),
]


@requires_mergekit
@pytest.mark.parametrize("n,weights,normalize", MULTISLERP)
def test_multislerp_same_tensors_as_mergekit_bit_for_bit(tiny, n, weights, normalize):
    """The experts' task vectors around base_model, and (include_base) the base with the first n - 1 experts."""
    params = {"normalize_weights": normalize}
    theirs = run_mergekit(tiny, "multislerp", [(p, {"weight": w}) for p, w in zip(tiny.experts, weights)], params)
    ours = run_mergeval(tiny, "multislerp", {**params, "weights": list(weights)}, tiny.experts[:n])[0]
    assert_same_tensors(ours, theirs, atol=0)
    models = [tiny.base, *tiny.experts[: n - 1]]
    theirs = run_mergekit(tiny, "multislerp", [(p, {"weight": w}) for p, w in zip(models, weights)], params, base=False)
    ours = run_mergeval(
        tiny, "multislerp", {**params, "weights": list(weights), "include_base": True}, tiny.experts[: n - 1]
    )[0]
    assert_same_tensors(ours, theirs, atol=0)


# RAM and RAM+ inputs: (base, experts). The regular experts change every entry (epsilon 1e-5 keeps them all:
# every entry shared), so larger epsilons make each expert's changed set a part of the tensor; the anti experts
# d_0 = -d_1 (exact zero sums of the shared quotients), d_2 zero on half the entries, all on a 2^-8 grid, so
# epsilon 0 and 0.01 give entries changed by 0, 1, 2 and 3 experts.
RAM_INPUTS = {
    "regular-2": lambda t: (t.base, t.experts[:2]),
    "regular-3": lambda t: (t.base, t.experts),
    "small-3": lambda t: (t.base, t.small_experts),
    "anti-2": lambda t: (t.anti[0], [t.anti[1], t.anti[3]]),
    "anti-3": lambda t: (t.anti[0], t.anti[1:]),
}
RAM_CASES = [
    ("regular-2", 1e-5),
    ("regular-2", 0.05),
    ("regular-2", 0.15),
    ("regular-3", 1e-5),
    ("regular-3", 0.03),
    ("regular-3", 0.08),
    ("small-3", 1e-5),
    ("small-3", 5e-4),
    ("anti-2", 0.0),
    ("anti-2", 0.01),
    ("anti-2", 0.02),
    ("anti-3", 0.0),
    ("anti-3", 1e-5),
    ("anti-3", 0.01),
]
RAMPLUS = [{}, {"r": 0.5, "alpha": 4.0}, {"r": 0.0}]  # mergekit's defaults; rho mostly below the cap; RAM's


@requires_mergekit
@pytest.mark.parametrize("inputs,epsilon", RAM_CASES, ids=[f"{i}-eps{e:g}" for i, e in RAM_CASES])
def test_ram_same_tensors_as_mergekit_bit_for_bit(tiny, inputs, epsilon):
    base, experts = RAM_INPUTS[inputs](tiny)
    theirs = run_mergekit(tiny, "ram", [(p, {}) for p in experts], {"epsilon": epsilon}, base=base)
    assert_same_tensors(run_mergeval(tiny, "ram", {"epsilon": epsilon}, experts, base=base)[0], theirs, atol=0)


@requires_mergekit
@pytest.mark.parametrize("inputs,epsilon", RAM_CASES, ids=[f"{i}-eps{e:g}" for i, e in RAM_CASES])
@pytest.mark.parametrize("params", RAMPLUS, ids=["defaults", "r0.5-alpha4", "r0"])
def test_ramplus_tl_same_tensors_as_mergekit_bit_for_bit(tiny, inputs, epsilon, params):
    base, experts = RAM_INPUTS[inputs](tiny)
    theirs = run_mergekit(tiny, "ramplus_tl", [(p, {}) for p in experts], {**params, "epsilon": epsilon}, base=base)
    (ours,) = run_mergeval(tiny, "ramplus_tl", {**params, "epsilon": epsilon}, experts, base=base)
    assert_same_tensors(ours, theirs, atol=0)


@requires_mergekit
def test_multislerp_of_opposite_task_vectors_falls_back_to_lerp_as_mergekit(tiny):
    """d_1 = -d_0 exactly (the anti fixture) at equal weights: the weighted unit vectors cancel, and two models
    are then lerped."""
    experts = tiny.anti[1:3]
    theirs = run_mergekit(tiny, "multislerp", [(p, {"weight": 1.0}) for p in experts], {}, base=tiny.anti[0])
    ours = run_mergeval(tiny, "multislerp", {}, experts, base=tiny.anti[0])[0]
    assert_same_tensors(ours, theirs, atol=0)
    assert_same_tensors(ours, tiny.tensors(tiny.anti[0]), atol=0)  # the lerp: b + (d_0 - d_0) / 2


KARCHER = [({}, 2), ({}, 3), ({"max_iter": 2, "tol": 1e-3}, 3), ({"max_iter": 50, "tol": 1e-7}, 3)]


@requires_mergekit
@pytest.mark.parametrize("params,n", KARCHER)
def test_karcher_same_tensors_as_mergekit_bit_for_bit(tiny, params, n):
    """Without base_model: the mean of the listed models; with it, the base too (include_base=true: mergekit adds
    an unlisted base_model after the models, as mergeval puts the base last)."""
    experts = tiny.experts[:n]
    theirs = run_mergekit(tiny, "karcher", [(p, {}) for p in experts], params, base=False)
    assert_same_tensors(run_mergeval(tiny, "karcher", params, experts)[0], theirs, atol=0)
    theirs = run_mergekit(tiny, "karcher", [(p, {}) for p in experts], params)
    assert_same_tensors(run_mergeval(tiny, "karcher", {**params, "include_base": True}, experts)[0], theirs, atol=0)


@requires_mergekit
@pytest.mark.parametrize("n", [2, 3])
def test_karcher_with_base_model_listed_first_within_float32_rounding(tiny, n):
    """mergekit averages the models in the order listed, base_model included where it stands (here first);
    mergeval puts the base last. The mean is the same, but its float32 sums (sum_i a_i u_i, the tangent step
    sum_i a_i log_mu(u_i), the mean norm) add the same terms in another order, and each such sum's last bit
    may differ; through the iteration the entries differ by up to 2.98e-7 (5 * 2^-24) on this fixture (measured:
    2.4e-7 with n = 2, 3.0e-7 with n = 3). The import says so in a note (test_mergekit_config.py)."""
    experts = tiny.experts[:n]
    theirs = run_mergekit(tiny, "karcher", [(tiny.base, {})] + [(p, {}) for p in experts], {})
    ours = run_mergeval(tiny, "karcher", {"include_base": True}, experts)[0]
    assert_same_tensors(ours, theirs, atol=3e-7)


@requires_mergekit
def test_karcher_with_a_zero_tensor_same_tensors_as_mergekit(tiny):
    """The third anti expert's ZERO tensor is all zeros: it leaves the directions' mean, its norm 0 still counts."""
    theirs = run_mergekit(tiny, "karcher", [(p, {}) for p in tiny.anti[1:]], {}, base=False)
    ours = run_mergeval(tiny, "karcher", {}, tiny.anti[1:], base=tiny.anti[0])[0]
    assert_same_tensors(ours, theirs, atol=0)


@requires_mergekit
def test_ram_cases_exercise_every_count_and_both_sides_of_the_cap(tiny):
    """The RAM cases above hold entries changed by 0, 1, 2 and 3 experts, and RAM+ ratios rho below and above
    both caps (0.2, 4), 0 included; RAM differs from task arithmetic, RAM+ from RAM: the parity is not vacuous."""

    def counts_and_rhos(inputs: str, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        base, experts = RAM_INPUTS[inputs](tiny)
        b, es = tiny.tensors(base), [tiny.tensors(p) for p in experts]
        counts, rhos = [], []
        for name in b:
            a = torch.stack([(e[name] - b[name]).abs() > epsilon for e in es]).flatten(1)
            c = a.sum(0)
            counts.append(c)
            rhos.append((a & (c > 1)).sum(1) / (a & (c == 1)).sum(1).clamp(min=epsilon))
        return torch.cat(counts), torch.cat(rhos)

    assert set(counts_and_rhos("anti-3", 0.01)[0].unique().tolist()) == {0, 1, 2, 3}
    rho = torch.cat([counts_and_rhos(inputs, epsilon)[1] for inputs, epsilon in RAM_CASES])
    for lo, hi in [(0, 0), (1e-9, 0.2), (0.2, 4), (4, float("inf"))]:
        assert bool(((rho >= lo) & (rho <= hi)).any()), (lo, hi)
    (ram,) = run_mergeval(tiny, "ram", {"epsilon": 0.08}, tiny.experts)
    (ta,) = run_mergeval(tiny, "task_arithmetic", {}, tiny.experts)
    (plus,) = run_mergeval(tiny, "ramplus_tl", {"epsilon": 0.08}, tiny.experts)
    assert all(not torch.equal(ram[n], ta[n]) and not torch.equal(plus[n], ram[n]) for n in ram)


@requires_mergekit
def test_ramplus_tl_where_mergekit_gives_nan(tiny, tmp_path):
    """epsilon = 0 and an expert equal to the base on a tensor: rho = 0 / 0 for it, and mergekit 0.1.5's whole
    tensor is NaN. mergeval takes rho = 0 (the expert has no unique entry to scale): RAM+ is then RAM's merge
    with the other experts' boosts, here the same as RAM+ of the others alone."""
    same = tmp_path / "base-copy"
    shutil.copytree(tiny.base, same)
    experts = [tiny.experts[0], same]
    theirs = run_mergekit(tiny, "ramplus_tl", [(p, {}) for p in experts], {"epsilon": 0.0})
    assert all(bool(t.isnan().all()) for t in theirs.values())
    (ours,) = run_mergeval(tiny, "ramplus_tl", {"epsilon": 0.0}, experts)
    assert_same_tensors(ours, run_mergeval(tiny, "ramplus_tl", {"epsilon": 0.0}, experts[:1])[0], atol=0)


# Arcee Fusion inputs: (base, expert); mergekit takes the base and exactly one other model.
FUSION_INPUTS = {
    "expert0": lambda t: (t.base, t.experts[0]),
    "expert2": lambda t: (t.base, t.experts[2]),
    "small": lambda t: (t.base, t.small_experts[0]),
    "slerp": lambda t: (t.base, t.slerp_expert),
    "anti": lambda t: (t.anti[0], t.anti[3]),
    "base": lambda t: (t.base, t.base),
}


@requires_mergekit
@pytest.mark.parametrize("inputs", sorted(FUSION_INPUTS))
@pytest.mark.parametrize("listed", ["base-and-expert", "expert-only"])
def test_arcee_fusion_same_tensors_as_mergekit_bit_for_bit(tiny, tmp_path, inputs, listed):
    """mergekit accepts the base listed among the models or not; the expert equal to the base (a copy, which
    mergekit does not take for the base itself) gives the base back."""
    base, expert = FUSION_INPUTS[inputs](tiny)
    if expert == base:
        expert = tmp_path / "base-copy"
        shutil.copytree(base, expert)
    models = ([(base, {})] if listed == "base-and-expert" else []) + [(expert, {})]
    theirs = run_mergekit(tiny, "arcee_fusion", models, {}, base=base)
    (ours,) = run_mergeval(tiny, "arcee_fusion", {}, [expert], base=base)
    assert_same_tensors(ours, theirs, atol=0)
    b, e = tiny.tensors(base), tiny.tensors(expert)
    if inputs == "base":
        assert_same_tensors(ours, b, atol=0)
    else:  # the mask keeps some entries of the expert and some of the base: not a vacuous comparison
        assert any(not torch.equal(ours[n], b[n]) and not torch.equal(ours[n], e[n]) for n in b)


@requires_mergekit
def test_arcee_fusion_refuses_two_experts_as_mergekit_does(tiny):
    with pytest.raises(ValueError, match="exactly 2 inputs"):
        run_mergekit(tiny, "arcee_fusion", [(p, {}) for p in tiny.experts[:2]], {})
    with pytest.raises(UserError) as err:
        run_mergeval(tiny, "arcee_fusion", {}, tiny.experts[:2])
    assert err.value.field == "modelset.experts"


@requires_mergekit
@pytest.mark.parametrize("t", [0.3, 0.5, 1.0])
def test_slerp_same_tensors_as_mergekit(tiny, t):
    theirs = run_mergekit(tiny, "slerp", [(tiny.base, {}), (tiny.slerp_expert, {})], {"t": t})
    assert_same_tensors(run_mergeval(tiny, "slerp", {"t": t}, [tiny.slerp_expert])[0], theirs)


@requires_mergekit
def test_fixture_exercises_the_differences(tiny):
    """The fixture must hit the cases where the tools' options matter, or the parity tests prove little."""
    base = tiny.tensors(tiny.base)
    experts = [tiny.tensors(p) for p in tiny.experts]
    deltas = torch.cat([torch.stack([e[n] - base[n] for e in experts]).flatten(1) for n in sorted(base)], dim=1)
    signs = torch.sign(deltas)
    conflict = (signs != signs[0]).any(0).float().mean().item()
    assert conflict > 0.2, f"only {conflict:.2f} of the entries have a sign conflict"
    for name in base:  # model_stock parity needs positive mean cosines per tensor and per row
        d = [(e[name] - base[name]).reshape(base[name].shape[0] if base[name].dim() > 1 else 1, -1) for e in experts]
        cos = torch.stack(
            [torch.nn.functional.cosine_similarity(d[i], d[j], dim=-1) for i in range(3) for j in range(i + 1, 3)]
        ).mean(0)
        assert cos.min() > 0.05, name
    # With unequal weights, the paper's order (election before weighting) gives another merge than
    # mergekit's: so the weighted TIES parity above does test the option, not a coincidence.
    theirs = run_mergekit(
        tiny, "ties", [(p, {"weight": w, "density": 0.25}) for p, w in zip(tiny.experts, W3)], {"normalize": True}
    )
    (paper,) = run_mergeval(tiny, "ties", {"density": 0.25, "weights": W3}, tiny.experts)
    assert max((paper[n] - theirs[n]).abs().max().item() for n in paper) > 1e-3
    # On the small experts mergekit's SCE weights the experts equally (uniform_below=1e-6), mergeval's
    # default weights them by energy: different merges, so the sce parity there tests the option.
    theirs = run_mergekit(tiny, "sce", [(p, {}) for p in tiny.small_experts], {"select_topk": 1.0})
    (energy,) = run_mergeval(tiny, "sce", {"normalize": True}, tiny.small_experts)
    assert max((energy[n] - theirs[n]).abs().max().item() for n in energy) > 2e-5
    # The slerp expert has tensors on both sides of the colinearity threshold.
    slerp = tiny.tensors(tiny.slerp_expert)
    cosines = [torch.nn.functional.cosine_similarity(base[n].flatten(), slerp[n].flatten(), dim=0).item() for n in base]
    assert max(cosines) > 0.9995 and min(cosines) < 0.9


# ---------------------------------------------------------------- compat=mergekit: same tensors within 1e-6

MK = {"compat": "mergekit"}
W_NEG = [1.0, -0.5, 1.2]  # a negative weight flips an expert's vote (mergekit elects on w_i s_i)
COMPAT = [  # densities give fractional counts: 0.3 * 2048 = 614.4, 0.3 * 32 = 9.6, 0.45 * 64 * 8 = 230.4 ...
    C("task_arithmetic", "task_arithmetic", {**MK, "lambda_": 0.7, "weights": W3}, {"lambda": 0.7}, weights=W3),
    C(
        "task_arithmetic-normalize",
        "task_arithmetic",
        {**MK, "normalize": True, "weights": W3},
        {"normalize": True},
        weights=W3,
    ),
    C("linear", "linear", {**MK, "weights": W3}, {}, weights=W3),
    C("ties", "ties", {**MK, "density": 0.3}, {}, {"density": 0.3}, weights=[1, 1, 1]),
    C(
        "ties-weighted",
        "ties",
        {**MK, "density": 0.45, "lambda_": 0.8, "weights": W_NEG},
        {"lambda": 0.8},
        {"density": 0.45},
        weights=W_NEG,
    ),
    C(
        "ties-sum-rescale",
        "ties",
        {**MK, "density": 0.3, "normalize": False, "rescale": "l1", "weights": W3},
        {"normalize": False, "rescale": True},
        {"density": 0.3},
        weights=W3,
    ),
    C(
        "breadcrumbs",
        "breadcrumbs",
        {**MK, "density": 0.3, "gamma": 0.05, "weights": W3},
        {},
        {"density": 0.3, "gamma": 0.05},
        W3,
    ),
    C(
        "breadcrumbs-crowded",
        "breadcrumbs",
        {**MK, "density": 0.98, "gamma": 0.05, "normalize": True},
        {"normalize": True},
        {"density": 0.98, "gamma": 0.05},
        weights=[1, 1, 1],
    ),
    C(
        "breadcrumbs_ties",
        "breadcrumbs_ties",
        {**MK, "density": 0.3, "gamma": 0.02},
        {},
        {"density": 0.3, "gamma": 0.02},
        weights=[1, 1, 1],
    ),
    C(
        "breadcrumbs_ties-normalize",
        "breadcrumbs_ties",
        {**MK, "density": 0.55, "gamma": 0.01, "normalize": True, "weights": W_NEG},
        {"normalize": True},
        {"density": 0.55, "gamma": 0.01},
        weights=W_NEG,
    ),
    C("model_stock", "model_stock", {**MK}),
    C("model_stock-filter_wise", "model_stock", {**MK, "filter_wise": True}, {"filter_wise": True}),
    C("sce-topk", "sce", {**MK, "select_topk": 0.3}, {"select_topk": 0.3}),
    C("sce", "sce", {**MK}, {}),
]


@requires_mergekit
@pytest.mark.parametrize(
    "case,fixture",
    [(c, f) for c in COMPAT for f in ("regular", "anti")],
    ids=lambda v: v.id if isinstance(v, Case) else v,
)
def test_compat_same_tensors_as_mergekit(tiny, case, fixture):
    base, experts = (tiny.base, tiny.experts) if fixture == "regular" else (tiny.anti[0], tiny.anti[1:])
    models = [
        (path, {**case.per_model, **({"weight": w} if case.weights else {})})
        for path, w in zip(experts, case.weights or [None] * len(experts))
    ]
    theirs = run_mergekit(tiny, case.method, models, case.shared, base=base if case.method != "linear" else False)
    (ours,) = run_mergeval(tiny, case.method, case.ours, experts, base=base)
    assert_same_tensors(ours, theirs, atol=1e-6)


@requires_mergekit
@pytest.mark.parametrize("t", [0.3, 0.8])
def test_compat_slerp_same_tensors_as_mergekit(tiny, t):
    """Includes a zero tensor (mergekit slerps it where the paper mode lerps) and colinear ones."""
    theirs = run_mergekit(tiny, "slerp", [(tiny.anti[0], {}), (tiny.anti[3], {})], {"t": t}, base=tiny.anti[0])
    (ours,) = run_mergeval(tiny, "slerp", {**MK, "t": t}, [tiny.anti[3]], base=tiny.anti[0])
    assert_same_tensors(ours, theirs, atol=1e-6)


@requires_mergekit
def test_anti_fixture_exercises_what_compat_changes(tiny):
    """Each difference the compat mode removes is present in the anti fixture, and the paper mode shows it."""
    base = tiny.tensors(tiny.anti[0])
    d = [{n: t - base[n] for n, t in tiny.tensors(p).items()} for p in tiny.anti[1:]]
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(d[0][name], -d[1][name]) and (d[2][name] == 0).float().mean() > 0.4  # exact zero sums
    assert d[0][name].abs().unique().numel() < d[0][name].numel() / 10  # repeated magnitudes: ties at the cut
    cases = {c.id: c for c in COMPAT}
    for case_id in ("ties", "breadcrumbs", "model_stock", "sce-topk"):
        case = cases[case_id]
        paper = {k: v for k, v in case.ours.items() if k != "compat"}
        (ours,) = run_mergeval(tiny, case.method, paper, tiny.anti[1:], base=tiny.anti[0])
        (exact,) = run_mergeval(tiny, case.method, case.ours, tiny.anti[1:], base=tiny.anti[0])
        assert max((ours[n] - exact[n]).abs().max().item() for n in ours) > 1e-3, case_id
    (paper,) = run_mergeval(tiny, "slerp", {"t": 0.3}, [tiny.anti[3]], base=tiny.anti[0])
    (exact,) = run_mergeval(tiny, "slerp", {**MK, "t": 0.3}, [tiny.anti[3]], base=tiny.anti[0])
    assert (paper[ZERO] - exact[ZERO]).abs().max() > 1e-2


# ---------------------------------------------------------------- random methods: same distribution


@dataclass(frozen=True)
class RandomCase:
    id: str
    method: str
    ours: dict
    shared: dict
    per_model: dict
    weights: tuple[float, ...]


RANDOM_SINGLE = [  # one expert, weight 1, lambda 1: the merged delta is the sparsified task vector itself
    RandomCase("dare", "dare_linear", {"compat": "mergekit", "density": 0.3}, {}, {"density": 0.3}, (1.0,)),
    RandomCase(
        "della",
        "della_linear",
        {"compat": "mergekit", "density": 0.5, "epsilon": 0.2},
        {},
        {"density": 0.5, "epsilon": 0.2},
        (1.0,),
    ),
]
RANDOM_MULTI = [  # compat=mergekit with mergekit's defaults (rescale l1; normalize false for dare_ties, true for della)
    RandomCase(
        "dare_linear",
        "dare_linear",
        {"compat": "mergekit", "density": 0.5, "weights": W3},
        {},
        {"density": 0.5},
        tuple(W3),
    ),
    RandomCase(
        "dare_ties", "dare_ties", {"compat": "mergekit", "density": 0.3, "weights": W3}, {}, {"density": 0.3}, tuple(W3)
    ),
    # the paper mode with mergekit-like options (L1 rescale, ranks within rows) stays close to mergekit too
    RandomCase(
        "della_linear-paper",
        "della_linear",
        {"density": 0.5, "epsilon": 0.15, "rescale": "l1", "rank_scope": "row", "lambda_": 0.8},
        {"rescale": True, "lambda": 0.8},
        {"density": 0.5, "epsilon": 0.15},
        (1.0, 1.0, 1.0),
    ),
    RandomCase(
        "della",
        "della",
        {"compat": "mergekit", "density": 0.4, "epsilon": 0.2, "weights": W3},
        {},
        {"density": 0.4, "epsilon": 0.2},
        tuple(W3),
    ),
]


def merged_deltas(tiny: Tiny, case: RandomCase, experts: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mergeval, mergekit) merged task vectors over SEEDS seeds, each (SEEDS, n) in sorted tensor order, float64."""
    base = tiny.tensors(tiny.base)
    models = [(p, {**case.per_model, "weight": w}) for p, w in zip(experts, case.weights)]

    def flat(merged: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(merged[n] - base[n]).flatten() for n in sorted(base)]).double()

    ours = torch.stack([flat(m) for m in run_mergeval(tiny, case.method, case.ours, experts, seeds=range(SEEDS))])
    theirs = torch.stack([flat(run_mergekit(tiny, case.method, models, case.shared, seed=s)) for s in range(SEEDS)])
    return ours, theirs


def row_ranks(delta: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each entry's normalised magnitude rank (0..1) within its row (whole tensor for 1-dim), sorted tensor order.

    MAGPRUNE's keep probability with density 0.5 and epsilon 0.5 is exactly that rank.
    """
    ranks = [della_keep_prob(delta[n], 0.5, 0.5, rank_scope="row").flatten() for n in sorted(delta)]
    return torch.cat(ranks).double()


def kept_sd(p: float, count: int) -> float:
    return (p * (1 - p) / count) ** 0.5


@requires_mergekit
@pytest.mark.parametrize("case", RANDOM_SINGLE, ids=lambda c: c.id)
def test_sparsifier_matches_mergekit_in_distribution(tiny, case):
    """One expert: the merged delta is the sparsified task vector s; compare how entries are kept and rescaled.

    - L1 rescale: per tensor and seed, |s|_1 = |d|_1 (relative 1e-4), in both tools.
    - Keep frequency per decile of magnitude rank within the row, over all entries and seeds (~50k
      draws a decile): within 5 standard deviations (<= 0.011) of the configured probability
      density - epsilon + 2 epsilon r (density for DARE) in both tools, and of each other. A density
      off by 0.02, an epsilon off by 0.03, or ranking within the whole tensor instead of the row (the
      fixture's rows differ in scale) fails it (measured).
    - Mean of the rescaled deltas relative to the deltas, mean_j s_j / d_j (its expectation is 1 for
      DARE; below 1 for DELLA with L1 matching): the tools agree within 5 combined standard errors
      (estimated from the per-seed values; each standard error is required to be <= 0.004, so a
      rescale that differs by 3% or more is caught); for DARE both are within 0.02 of 1.
    """
    expert = tiny.experts[0]
    base, tuned = tiny.tensors(tiny.base), tiny.tensors(expert)
    delta = {n: tuned[n] - base[n] for n in base}
    d = torch.cat([delta[n].flatten() for n in sorted(delta)]).double()
    sizes = [delta[n].numel() for n in sorted(delta)]
    ours, theirs = merged_deltas(tiny, case, [expert])
    density, epsilon = case.ours["density"], case.ours.get("epsilon", 0.0)
    rank = row_ranks(delta)
    p_entry = density - epsilon + 2 * epsilon * rank
    bins = torch.clamp((rank * 10).long(), max=9)
    nonzero = d != 0
    factors = {}
    for tool, s in [("mergeval", ours), ("mergekit", theirs)]:
        for seed_values in s:
            for part_s, part_d in zip(seed_values.split(sizes), d.split(sizes)):
                assert part_s.abs().sum().item() == pytest.approx(part_d.abs().sum().item(), rel=1e-4), tool
        kept = (s != 0).double()
        for b in range(10):
            in_bin = bins == b
            expected = p_entry[in_bin].mean().item()
            freq = kept[:, in_bin].mean().item()
            assert abs(freq - expected) <= 5 * kept_sd(expected, SEEDS * int(in_bin.sum())), (tool, b, freq, expected)
        factors[tool] = (s[:, nonzero] / d[nonzero]).mean(1)
    for b in range(10):
        in_bin = bins == b
        a, k = (ours[:, in_bin] != 0).double().mean().item(), (theirs[:, in_bin] != 0).double().mean().item()
        assert abs(a - k) <= 5 * 2**0.5 * kept_sd((a + k) / 2, SEEDS * int(in_bin.sum())), (b, a, k)
    se = {tool: v.std().item() / SEEDS**0.5 for tool, v in factors.items()}
    assert max(se.values()) <= 0.004, se
    mean = {tool: v.mean().item() for tool, v in factors.items()}
    assert abs(mean["mergeval"] - mean["mergekit"]) <= 5 * (se["mergeval"] ** 2 + se["mergekit"] ** 2) ** 0.5, mean
    if epsilon == 0.0:
        assert mean["mergeval"] == pytest.approx(1.0, abs=0.02) and mean["mergekit"] == pytest.approx(1.0, abs=0.02)


@requires_mergekit
@pytest.mark.parametrize("case", RANDOM_MULTI, ids=lambda c: c.id)
def test_merge_matches_mergekit_in_distribution(tiny, case):
    """Three experts: the merged task vector's per-entry distribution over seeds, mergeval vs mergekit.

    - Fraction of entries changed from the base: within 5 standard deviations (~0.003) of each other;
      a keep probability off by 0.03 moves it by 0.04 or more (measured).
    - Per-entry means: z_j = (mean_ours - mean_theirs) / sqrt((var_ours + var_theirs) / SEEDS) over
      the ~20k entries with any spread; mean of z_j^2 in [0.92, 1.08]. When the distributions agree
      it is ~1.01 (measured 1.008-1.012 for these four cases; standard error ~0.01). A shift of s
      standard deviations on a fraction f of the entries adds ~f * s^2 * SEEDS / 2; measured:
      electing before weighting (the paper's order) gives 1.15 (dare_ties) and 1.30 (della),
      ranking within the tensor instead of the row gives 1.62 (della_linear).
    - Spread: total variance ratio sum_j var_ours / sum_j var_theirs in [0.95, 1.05] (measured
      0.995-1.004 when they agree); a keep probability off by 0.05 changes it by more than 10%.
    """
    ours, theirs = merged_deltas(tiny, case, tiny.experts)
    changed = [(x != 0).double().mean().item() for x in (ours, theirs)]
    p = sum(changed) / 2
    assert abs(changed[0] - changed[1]) <= 5 * 2**0.5 * kept_sd(p, ours.numel()), changed
    var_a, var_b = ours.var(0), theirs.var(0)
    pooled = var_a + var_b
    spread = pooled > 0
    # Entries that never vary (e.g. always kept by the election) must agree exactly.
    assert torch.allclose(ours.mean(0)[~spread], theirs.mean(0)[~spread], atol=1e-6)
    z2 = ((ours.mean(0) - theirs.mean(0))[spread] ** 2 / (pooled[spread] / SEEDS)).mean().item()
    assert 0.92 <= z2 <= 1.08, z2
    ratio = (var_a.sum() / var_b.sum()).item()
    assert 0.95 <= ratio <= 1.05, ratio


# ---------------------------------------------------------------- the DELLA rank_scope option (no mergekit needed)


def test_della_row_ranks_each_row_on_its_own():
    """rank_scope=row: every row's keep probabilities span [density - eps, density + eps] by its own magnitude order,
    whatever the other rows' scales; 1-dim tensors are one row (same as rank_scope=tensor)."""
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(6, 9, generator=g) * torch.tensor([1e-3, 1.0, 5.0, 0.1, 2.0, 1e2]).unsqueeze(1)
    p = della_keep_prob(delta, 0.5, 0.2, rank_scope="row")
    for row_p, row_d in zip(p, delta):
        assert torch.all(row_p[row_d.abs().argsort()].diff() > 0)
        assert row_p.min().item() == pytest.approx(0.3) and row_p.max().item() == pytest.approx(0.7)
    tensor_p = della_keep_prob(delta, 0.5, 0.2, rank_scope="tensor")
    assert tensor_p[0].max() < 0.5 < tensor_p[-1].min()  # whole-tensor ranks: the small rows keep less
    vector = torch.randn(11, generator=g)
    assert torch.equal(della_keep_prob(vector, 0.5, 0.2, rank_scope="row"), della_keep_prob(vector, 0.5, 0.2))


def test_della_rank_scope_is_validated():
    from mergeval.core.errors import UserError

    method = get_method("della")
    with pytest.raises(UserError, match="rank_scope"):
        method.validate(method.config(rank_scope="column"), 2)


# ---------------------------------------------------------------- the SCE uniform_below option (no mergekit needed)


@st.composite
def base_and_experts(draw):
    """(base, 2-4 experts) of one shape, from a drawn seed and a drawn task-vector scale."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = draw(st.sampled_from([(7,), (3, 5), (4, 4, 2)]))
    scale = draw(st.sampled_from([1e-4, 1e-2, 1.0]))
    base = torch.randn(shape, generator=g)
    return base, [base + scale * torch.randn(shape, generator=g) for _ in range(draw(st.integers(2, 4)))]


def sce(base, experts, **params):
    method = get_method("sce")
    cfg = method.config(**params)
    method.validate(cfg, len(experts))
    return method.merge(base, experts, cfg, Draws(0, "w"))


@settings(max_examples=40, deadline=None)
@given(base_and_experts(), st.booleans())
def test_sce_below_uniform_below_weights_experts_equally(data, normalize):
    """Energy under uniform_below: w_i = 1/N, so with normalize the merge is TIES' disjoint mean at density 1,
    and without it b + (1/N) * sum_i A_i d_i."""
    base, experts = data
    merged = sce(base, experts, normalize=normalize, uniform_below=1e9)
    if normalize:
        torch.testing.assert_close(merged, ties_full(base, experts), atol=1e-6, rtol=0)
    else:
        d = torch.stack([e - base for e in experts])
        agree = (torch.sign(d) == torch.sign(d.sort(0).values.sum(0))) & (d != 0)
        torch.testing.assert_close(merged, base + (d * agree).sum(0) / len(experts), atol=1e-6, rtol=0)


def ties_full(base, experts):
    method = get_method("ties")
    return method.merge(base, experts, method.config(density=1.0), Draws(0, "w"))


@settings(max_examples=40, deadline=None)
@given(base_and_experts(), st.booleans(), st.floats(0.0, 0.999))
def test_sce_uniform_below_under_the_energy_changes_nothing(data, normalize, frac):
    base, experts = data
    energy = sum(float((e - base).double().square().mean()) for e in experts)
    assert torch.equal(
        sce(base, experts, normalize=normalize, uniform_below=frac * energy), sce(base, experts, normalize=normalize)
    )


@pytest.mark.parametrize("value", [-1e-6, float("nan"), float("inf")])
def test_sce_uniform_below_is_validated(value):
    from mergeval.core.errors import UserError

    with pytest.raises(UserError, match="uniform_below"):
        sce(torch.zeros(3), [torch.ones(3), -torch.ones(3)], uniform_below=value)
