"""Calibration data and the data-aware / mask-based methods (issue 19): Fisher merging, RegMean, Consensus TA,
Localize-and-Stitch (data-free and trained). Property tests on random tensors, hand-worked masks, the calibration
config's checks, the statistics cache, and Fisher / RegMean / both Localize-and-Stitch variants through the engine
against independent dense implementations on the two-layer tiny zoo model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.merge.expert_statistics import calibration_items, check_calibration, data_digest, statistics_dir
from mergeval.methods import METHODS
from mergeval.methods.data_aware import fisher_merge, regmean_linear, shrink
from mergeval.methods.draws import Draws
from mergeval.methods.masks import tall_masks, top_mask
from tests.merge.test_engine import make_expert, read_dir

SETTINGS = settings(max_examples=25, deadline=None)
shapes = st.sampled_from([(3, 4), (5, 5), (2, 7)])


def rand(shape, seed, scale=1.0):
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- Fisher


@SETTINGS
@given(shapes, st.integers(0, 10_000), st.integers(1, 4))
def test_fisher_with_equal_fisher_is_the_average_and_one_expert_is_itself(shape, seed, n):
    experts = [rand(shape, seed + i) for i in range(n)]
    f = rand(shape, seed + 99).abs()
    merged = fisher_merge(experts, [f] * n, 1e-10)
    assert torch.allclose(merged, torch.stack(experts).mean(0), atol=1e-12)
    assert torch.allclose(fisher_merge(experts[:1], [f], 1e-10), experts[0], atol=1e-12)


def test_fisher_weights_each_entry_by_its_fisher_and_the_floor_averages_zero_fisher():
    e1, e2 = torch.tensor([1.0, 1.0, 4.0]), torch.tensor([3.0, 5.0, 8.0])
    f1, f2 = torch.tensor([1.0, 3.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])
    # (1*1 + 1*3)/2 = 2; (3*1 + 1*5)/4 = 2; zero Fisher everywhere -> the floor gives the mean 6
    assert fisher_merge([e1, e2], [f1, f2], 1e-10).tolist() == pytest.approx([2.0, 2.0, 6.0])


# ---------------------------------------------------------------- RegMean


@SETTINGS
@given(st.integers(2, 6), st.integers(1, 5), st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_regmean_one_expert_is_itself_and_identical_grams_average(d_in, d_out, seed, alpha):
    x = rand((3 * d_in, d_in), seed)
    g = x.T @ x / len(x)
    ws = [rand((d_out, d_in), seed + 1 + i) for i in range(3)]
    assert torch.allclose(regmean_linear(ws[:1], [g], alpha), ws[0], atol=1e-8)
    assert torch.allclose(regmean_linear(ws, [g] * 3, alpha), torch.stack(ws).mean(0), atol=1e-8)


@SETTINGS
@given(st.integers(0, 10_000), st.floats(0.0, 1.0))
def test_regmean_minimises_the_summed_output_distance(seed, alpha):
    """W solves the normal equations of sum_i ||X_i W^T - X_i W_i^T||^2 with the shrunk Grams: its gradient
    sum_i G~_i (W^T - W_i^T) is zero, and moving W raises the (shrunk) objective."""
    grams = [(lambda x: x.T @ x / len(x))(rand((12, 4), seed + i)) for i in range(2)]
    ws = [rand((3, 4), seed + 10 + i) for i in range(2)]
    w = regmean_linear(ws, grams, alpha)
    grad = sum(shrink(g, alpha) @ (w - wi).T for g, wi in zip(grams, ws))
    assert grad.abs().max() < 1e-8

    def loss(v):
        return sum(torch.trace((v - wi) @ shrink(g, alpha) @ (v - wi).T) for g, wi in zip(grams, ws))

    assert loss(w) <= loss(w + 1e-3 * rand(w.shape, seed + 77)) + 1e-12


def test_regmean_shrinkage_and_unseen_inputs_by_hand():
    g = torch.tensor([[4.0, 2.0], [2.0, 3.0]], dtype=torch.float64)
    assert shrink(g, 0.25).tolist() == [[4.0, 0.5], [0.5, 3.0]]
    # input 1 is never active for either expert: its column is the plain average, input 0 Gram-weighted
    g1 = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    g2 = torch.tensor([[3.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    w1, w2 = torch.tensor([[2.0, 10.0]]), torch.tensor([[6.0, 20.0]])
    assert regmean_linear([w1, w2], [g1, g2], 1.0).tolist() == [[pytest.approx(5.0), pytest.approx(15.0)]]


# ---------------------------------------------------------------- Consensus TA, Localize-and-Stitch


def test_tall_and_consensus_masks_by_hand():
    base = torch.zeros(4)
    e1, e2, e3 = (
        torch.tensor([1.0, 0.0, 2.0, 0.1]),
        torch.tensor([1.0, 3.0, -2.0, 0.0]),
        torch.tensor([0.0, 0.0, 0.0, 5.0]),
    )
    # mtl = (2, 3, 0, 5.1); m_t = |t| >= 0.5 |mtl - t|:
    # e1: 1>=0.5, 0>=1.5 no, 2>=1 yes, 0.1>=2.5 no -> (1,0,1,0)
    # e2: 1>=0.5, 3>=0 yes, 2>=1 yes, 0>=2.55 no   -> (1,1,1,0)
    # e3: 0>=1 no, 0>=1.5 no, 0>=0 yes, 5>=0.05 yes -> (0,0,1,1)
    masks = tall_masks([e1, e2, e3], 0.5)
    assert [m.int().tolist() for m in masks] == [[1, 0, 1, 0], [1, 1, 1, 0], [0, 0, 1, 1]]
    assert tall_masks([e1, e2, e3], 0.5, strict=True)[2].int().tolist() == [0, 0, 0, 1]  # 0 > 0 is false
    cfg = METHODS["consensus_ta"].config(lambda_=0.5, k=2, tall_lambda=0.5)
    out = METHODS["consensus_ta"].merge(base, [e1, e2, e3], cfg, Draws(0, "w"))
    assert out.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])  # votes (2,1,3,1): entries 0 and 2 kept, * 0.5


@SETTINGS
@given(shapes, st.integers(0, 10_000), st.floats(0.0, 2.0))
def test_consensus_with_one_expert_and_k1_is_task_arithmetic(shape, seed, lam):
    base, e = rand(shape, seed).float(), rand(shape, seed + 1).float()
    cfg = METHODS["consensus_ta"].config(lambda_=lam, k=1)
    out = METHODS["consensus_ta"].merge(base, [e], cfg, Draws(0, "w"))
    assert torch.allclose(out, base + lam * (e - base), atol=1e-6)


def test_consensus_refuses_k_beyond_the_experts():
    with pytest.raises(UserError, match="method.k"):
        METHODS["consensus_ta"].validate(METHODS["consensus_ta"].config(k=3), 2)


def test_localize_stitch_by_hand_and_at_full_density():
    base = torch.zeros(4)
    e1, e2 = torch.tensor([4.0, -3.0, 0.5, 0.1]), torch.tensor([2.0, 0.1, 0.2, -6.0])
    assert top_mask(e1, 0.5).tolist() == [True, True, False, False]
    cfg = METHODS["localize_stitch"].config(sparsity=0.5, scope="tensor")
    out = METHODS["localize_stitch"].merge(base, [e1, e2], cfg, Draws(0, "w"))
    # masks (1,1,0,0) and (1,0,0,1): entry 0 overlaps -> mean (4+2)/2; entry 1 from e1; 2 none; 3 from e2
    assert out.tolist() == pytest.approx([3.0, -3.0, 0.0, -6.0])
    full = METHODS["localize_stitch"].merge(
        base + 1, [e1 + 1, e2 + 1], METHODS["localize_stitch"].config(sparsity=1.0, scope="tensor"), Draws(0, "w")
    )
    assert torch.allclose(full, 1 + (e1 + e2) / 2)


# ---------------------------------------------------------------- calibration config


def cal(task="chem_count", split="train", n=8):
    return SimpleNamespace(task=task, split=split, n=n)


@pytest.mark.parametrize(
    "kwargs,field,words",
    [
        (dict(split="test"), "x.split", "never uses the test split"),
        (dict(split="dev"), "x.split", "unknown split"),
        (dict(n=0), "x.n", "positive"),
        (dict(task="mergeval_nope"), "x.task", "unknown calibration task"),
        (dict(task="mergeval_general_facts"), "x.split", "no training split"),
        (dict(task="mergeval_chem_count", split="validation", n=400), "x.n", "fewer than"),
    ],
)
def test_calibration_config_errors_name_the_field(kwargs, field, words):
    with pytest.raises(UserError) as err:
        check_calibration(cal(**kwargs), "x", 200)
    assert err.value.field == field and words in err.value.problem


def test_calibration_items_never_touch_the_test_items():
    from mergeval.eval.tasks import task_items

    test = {i["question"] for i in task_items("mergeval_chem_count", 200)}
    train = calibration_items(cal(n=64), "x", 200)
    valid = calibration_items(cal("mergeval_chem_count_mc", "validation", 64), "x", 200)
    assert len(train) == len(valid) == 64
    assert not test & {i["question"] for i in train} and not test & {i["question"] for i in valid}
    assert calibration_items(cal(n=64), "x", 200)[:8] == calibration_items(cal(n=8), "x", 200)  # a fixed stream
    assert data_digest(train) != data_digest(valid)


def test_calibration_from_lm_eval_tasks_uses_their_own_splits_never_the_scored_one(tiny_dir, cache):
    """hellaswag (shipped data) is scored on its validation split: train is allowed, validation refused;
    medqa_4options is scored on test, so its validation split is allowed; gsm8k has no validation split;
    examples are rendered by the task itself (its doc_to_text, gold choice after the target delimiter)."""
    from omegaconf import OmegaConf

    from mergeval.merge.expert_statistics import compute
    from mergeval.run.config import BenchmarkConfig, EvalConfig

    data = {
        "hellaswag": {
            "validation": "shipped:data/hellaswag/validation.jsonl",
            "train": "shipped:data/hellaswag/train.jsonl",
        },
        "medqa_4options": {
            "test": "shipped:data/medqa_4options/test.jsonl",
            "validation": "shipped:data/medqa_4options/validation.jsonl",
            "train": "shipped:data/medqa_4options/train.jsonl",
        },
        "gsm8k": {"test": "shipped:data/gsm8k/test.jsonl", "train": "shipped:data/gsm8k/train.jsonl"},
    }
    bench = OmegaConf.structured(BenchmarkConfig(name="b", tasks=["hellaswag"], data=data))
    ev = OmegaConf.structured(EvalConfig())
    train = calibration_items(cal("hellaswag", "train", 3), "x", 200, bench, ev, cache)
    first = json.loads(open(_shipped("hellaswag/train.jsonl")).readline())
    assert len(train) == 3 and first["activity_label"] in train[0]["context"]
    assert train[0]["continuation"].strip() in first["endings"][int(first["label"])]
    with pytest.raises(UserError) as err:
        calibration_items(cal("hellaswag", "validation", 3), "x", 200, bench, ev, cache)
    assert err.value.field == "x.split" and "scored on" in err.value.problem
    valid = calibration_items(cal("medqa_4options", "validation", 2), "x", 200, bench, ev, cache)
    assert len(valid) == 2 and all(v["continuation"] in (" A", " B", " C", " D") for v in valid)
    with pytest.raises(UserError) as err:
        calibration_items(cal("gsm8k", "validation", 2), "x", 200, bench, ev, cache)
    assert err.value.field == "x.split" and "no validation split" in err.value.problem
    fisher, _ = compute("fisher", tiny_dir, train)
    assert any(f.abs().max() > 0 for f in fisher.values()) and data_digest(train) != data_digest(valid)


def _shipped(rel):
    from mergeval.eval.suite import SHIPPED

    return SHIPPED / "data" / rel


# ---------------------------------------------------------------- against a dense implementation


@pytest.fixture(scope="module")
def two_layer(tiny_dir, tmp_path_factory):
    """The two-layer tiny Llama, two noisy experts and each one's calibration items (train / validation)."""
    root = tmp_path_factory.mktemp("data_aware")
    experts = [make_expert(tiny_dir, root / f"e{i}", seed=10 + i, scale=0.05) for i in range(2)]
    items = [
        calibration_items(cal("chem_count", "train", 4), "x", 200),
        calibration_items(cal("unit_convert", "validation", 4), "x", 200),
    ]
    return tiny_dir, experts, items, root


def _dense_examples(model_dir, items):
    from transformers import AutoTokenizer

    from mergeval.models.zoo.finetune import prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for item in items:
        context = tok(prompt(item["question"]))["input_ids"]
        full = tok(prompt(item["question"]) + " " + item["choices"][item["answer"]])["input_ids"] + [tok.eos_token_id]
        out.append((torch.tensor([full]), len(context)))
    return out


def dense_fisher(model_dir, items):
    """(1/n) sum_x (grad of sum_{answer tokens} log softmax)^2, written independently of mergeval.merge.expert_statistics."""
    from mergeval.models.checkpoint import load_model

    model = load_model(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    examples = _dense_examples(model_dir, items)
    for ids, start in examples:
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        ll = sum(logp[j - 1, ids[0, j]] for j in range(start, ids.shape[1]))
        grads = torch.autograd.grad(ll, list(params.values()))
        for (n, _), g in zip(params.items(), grads):
            total[n] += g.double() ** 2
    return {n: t / len(examples) for n, t in total.items()}


def dense_grams(model_dir, items):
    """Per nn.Linear (every one, no sharing): X^T X / T over all calibration tokens, with numpy."""
    from mergeval.models.checkpoint import load_model

    model = load_model(model_dir, dtype=torch.float32)
    xs: dict[str, list[np.ndarray]] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, inp, n=n: xs.setdefault(n, []).append(
                inp[0].detach().reshape(-1, inp[0].shape[-1]).double().numpy()
            )
        )
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    with torch.no_grad():
        for ids, _ in _dense_examples(model_dir, items):
            model(input_ids=ids)
    for h in hooks:
        h.remove()
    out = {}
    for n, chunks in xs.items():
        x = np.concatenate(chunks)
        out[f"{n}.weight"] = x.T @ x / len(x)
    return out


def _engine_merge(name, base, experts, items, root, cache, **params):
    from mergeval.merge import merge_to_disk
    from mergeval.methods import get_method
    from mergeval.models.fingerprint import fingerprint

    dirs = [
        str(statistics_dir(get_method(name).needs.statistics, e, fingerprint(e), its, cache)[0])
        for e, its in zip(experts, items)
    ]
    method = METHODS[name]
    cfg = method.config(statistics=dirs, **params)
    method.validate(cfg, len(experts))
    out = merge_to_disk(method, cfg, base, experts, root / f"out-{name}")
    return read_dir(out), dirs


def test_fisher_through_the_engine_matches_a_dense_implementation(two_layer, cache):
    base, experts, items, root = two_layer
    merged, dirs = _engine_merge("fisher", base, experts, items, root, cache)
    fishers = [dense_fisher(e, its) for e, its in zip(experts, items)]
    params = [{n: t.double() for n, t in read_dir(e).items()} for e in experts]
    assert set(merged) <= set(fishers[0])
    assert any(fishers[0][n].abs().max() > 0 for n in merged)
    for n, got in merged.items():
        num = sum((f[n] + 1e-10) * p[n] for f, p in zip(fishers, params))
        want = num / sum(f[n] + 1e-10 for f in fishers)
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-6), n
    # computed once: a second request reuses the directory without recomputing
    from mergeval.models.fingerprint import fingerprint

    again, fresh = statistics_dir("fisher", experts[0], fingerprint(experts[0]), items[0], cache)
    assert str(again) == dirs[0] and not fresh


def test_regmean_through_the_engine_matches_a_dense_implementation(two_layer, cache):
    base, experts, items, root = two_layer
    alpha = 0.7
    merged, _ = _engine_merge("regmean", base, experts, items, root, cache, alpha=alpha)
    grams = [dense_grams(e, its) for e, its in zip(experts, items)]
    params = [{n: t.double().numpy() for n, t in read_dir(e).items()} for e in experts]
    solved = 0
    for n, got in merged.items():
        if n in grams[0]:
            gs = [alpha * g[n] + (1 - alpha) * np.diag(np.diag(g[n])) for g in grams]
            want = np.linalg.solve(sum(gs), sum(g @ p[n].T for g, p in zip(gs, params))).T
            solved += 1
        else:
            want = sum(p[n] for p in params) / len(params)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-4, atol=1e-5, err_msg=n)
    assert solved == 2 * 7  # q, k, v, o, gate, up, down in each of the two layers


def test_data_aware_methods_are_refused_without_calibration(cache):
    from hydra import compose, initialize_config_module

    from mergeval.run.checks import validate
    from mergeval.run.config import register_configs

    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        for name in ("fisher", "regmean"):
            cfg = compose(
                "config", overrides=["+experiment=tiny", f"method={name}", "modelset.experts.units.calibration=null"]
            )
            with pytest.raises(UserError) as err:
                validate(cfg)
            assert err.value.field == "modelset.experts.units.calibration"
        cfg = compose(
            "config",
            overrides=["+experiment=tiny", "method=consensus_ta", "modelset.experts.chem.calibration.split=test"],
        )
        with pytest.raises(UserError) as err:
            validate(cfg)
        assert err.value.field == "modelset.experts.chem.calibration.split"
        validate(
            compose(
                "config",
                overrides=["+experiment=tiny", "method=consensus_ta", "modelset.experts.units.calibration=null"],
            )
        )  # data-free: fine


def test_localize_stitch_over_the_whole_model_matches_a_dense_global_top_k(two_layer, cache):
    """scope=model: each expert keeps its ceil(sparsity n) largest |d| over all its tensors (the exact cut from
    the two-pass histogram equals the sorted k-th value), overlaps averaged; checked on the flattened model."""
    import math

    from mergeval.core.outcome import ModelInfo
    from mergeval.merge import merge_to_disk
    from mergeval.merge.expert_statistics import fill_thresholds, kth_largest_delta

    base, experts, _, root = two_layer
    b = read_dir(base)
    es = [read_dir(e) for e in experts]
    names = sorted(b)
    flat = [torch.cat([(e[n].float() - b[n].float()).abs().flatten() for n in names]) for e in es]
    for k in (1, 7, 1000, flat[0].numel()):
        assert kth_largest_delta(base, experts[0], k) == torch.sort(flat[0], descending=True).values[k - 1].item()
    method = METHODS["localize_stitch"]
    cfg, info = fill_thresholds(
        method.config(sparsity=0.05),
        base,
        [ModelInfo("base", "", "", str(base))] + [ModelInfo(f"e{i}", "", "", str(e)) for i, e in enumerate(experts)],
    )
    assert info["kept_per_expert"] == math.ceil(0.05 * flat[0].numel())
    merged = read_dir(merge_to_disk(method, cfg, base, experts, root / "out-ls"))
    cuts = [torch.sort(f, descending=True).values[info["kept_per_expert"] - 1] for f in flat]
    for n in names:
        ds = [e[n].float() - b[n].float() for e in es]
        ms = [(d.abs() >= c).float() for d, c in zip(ds, cuts)]
        want = b[n].float() + sum(m * d for m, d in zip(ms, ds)) / torch.stack(ms).sum(0).clamp(min=1)
        assert torch.allclose(merged[n].float(), want, atol=1e-7), n
    kept = sum(int((((es[0][n].float() - b[n].float()).abs()) >= cuts[0]).sum()) for n in names)
    assert kept == info["kept_per_expert"]  # random noise has no ties at the cut
    # cached per (base, expert, k): a second request reads the file (a planted value proves it is not recomputed)
    from mergeval.merge.expert_statistics import magnitude_cut

    first = magnitude_cut(base, "fp-base", experts[0], "fp-e0", 7, cache)
    assert first == torch.sort(flat[0], descending=True).values[6].item()
    (written,) = [p for p in (cache / "statistics").glob("cut-*.json") if json.loads(p.read_text())["model"] == "fp-e0"]
    written.write_text(json.dumps({**json.loads(written.read_text()), "cut": 123.0}))
    assert magnitude_cut(base, "fp-base", experts[0], "fp-e0", 7, cache) == 123.0


def test_pipeline_stages_refuse_what_needs_preparation():
    from mergeval.methods.pipeline import PipelineConfig, StageConfig

    def pipeline(stage_method):
        return PipelineConfig(
            stages=[StageConfig(name="s", inputs=["a", "b"], method=stage_method)], expert_names=["a", "b"]
        )

    for stage_method, field in (
        ({"name": "fisher"}, "method.stages[0].method.name"),
        ({"name": "localize_stitch"}, "method.stages[0].method.scope"),
    ):
        with pytest.raises(UserError) as err:
            METHODS["pipeline"].validate(pipeline(stage_method), 2)
        assert err.value.field == field
    METHODS["pipeline"].validate(pipeline({"name": "localize_stitch", "scope": "tensor"}), 2)


def test_trained_localize_stitch_against_a_dense_gradient_and_mask(two_layer, cache):
    """The stored gradient equals a dense autograd one at the soft-masked model (b + sigmoid(+-3) tau); the
    engine's merge equals the masks S1 = S0 - lr sigmoid'(3) g tau > 0 stitched by hand; the step moves masks."""
    import math

    from mergeval.core.outcome import ModelInfo
    from mergeval.merge import merge_to_disk
    from mergeval.merge.expert_statistics import fill_statistics, fill_thresholds, read_stat
    from mergeval.models.checkpoint import load_model
    from mergeval.models.fingerprint import fingerprint

    base, experts, items, root = two_layer
    models = [ModelInfo("base", "", fingerprint(base), str(base))] + [
        ModelInfo(f"e{i}", "", fingerprint(e), str(e)) for i, e in enumerate(experts)
    ]
    run = SimpleNamespace(
        benchmark=SimpleNamespace(n_items=200),
        eval=None,
        modelset=SimpleNamespace(
            experts={
                "e0": {"calibration": cal("chem_count", "train", 4)},
                "e1": {"calibration": cal("unit_convert", "validation", 4)},
            }
        ),
    )
    method = METHODS["localize_stitch_trained"]
    cfg, _ = fill_thresholds(method.config(sparsity=0.2, lr=1e5), base, models)
    cfg, info = fill_statistics(run, method.name, "localize", cfg, models, cache, base)
    b = read_dir(base)
    sig = 1 / (1 + math.exp(-3.0))
    # dense gradient of expert 0 at its soft-masked point
    model = load_model(experts[0], dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            tau = p - b[n].float()
            p.copy_(b[n].float() + torch.where(tau.abs() >= cfg.thresholds[0], sig, 1 - sig) * tau)
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for ids, start in _dense_examples(experts[0], items[0]):
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        loss = -sum(logp[j - 1, ids[0, j]] for j in range(start, ids.shape[1])) / (ids.shape[1] - start)
        for (n, _), g in zip(params.items(), torch.autograd.grad(loss, list(params.values()))):
            total[n] += g.double()
    for n in params:
        assert torch.allclose(read_stat(cfg.statistics[0], n).double(), total[n], rtol=1e-3, atol=1e-7), n
    merged = read_dir(merge_to_disk(method, cfg, base, experts, root / "out-lst"))
    es = [read_dir(e) for e in experts]
    moved = 0
    for n in b:
        ds = [e[n].float() - b[n].float() for e in es]
        ms = []
        for i, d in enumerate(ds):
            s0 = torch.where(d.abs() >= cfg.thresholds[i], 3.0, -3.0).double()
            g = read_stat(cfg.statistics[i], n).double()
            ms.append(s0 - 1e5 * sig * (1 - sig) * g * d.double() > 0)
            moved += int((ms[-1] != (s0 > 0)).sum())
        want = b[n].float() + sum(m * d for m, d in zip(ms, ds)) / torch.stack([m.float() for m in ms]).sum(0).clamp(
            min=1
        )
        assert torch.allclose(merged[n].float(), want, atol=1e-7), n
    assert moved > 0


def test_check_states_the_calibration_passes(cache):
    import io

    from hydra import compose, initialize_config_module
    from rich.console import Console

    from mergeval.check.__main__ import _print_calibration_cost
    from mergeval.run.config import register_configs

    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        for method, kind, words in (
            ("fisher", "fisher", "one forward + backward pass each"),
            ("regmean", "gram", "one forward pass each"),
            ("localize_stitch_trained", "localize", "one forward + backward pass each"),
        ):
            out = io.StringIO()
            _print_calibration_cost(
                compose("config", overrides=["+experiment=tiny", f"method={method}"]), Console(file=out, width=300)
            )
            assert f"calibration: chem: {kind} statistics from 64 chem_count train items, {words}" in out.getvalue()
        out = io.StringIO()
        _print_calibration_cost(compose("config", overrides=["+experiment=tiny", "method=ties"]), Console(file=out))
        assert out.getvalue() == ""


def test_a_padded_batch_scores_each_example_as_it_scores_alone(two_layer):
    """localize's batches: the per-example mean answer log-likelihood of a right-padded batch equals the
    examples' own, one by one (examples of different lengths, so the padding is exercised)."""
    from transformers import AutoTokenizer

    from mergeval.merge.expert_statistics import _example, answer_log_likelihood, padded_batches
    from mergeval.models.checkpoint import load_model

    base, _, items, _ = two_layer
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = load_model(base, dtype=torch.float32)
    examples = [_example(tokenizer, item) for item in items[0] + items[1]]
    assert len({ids.shape[1] for ids, _, _ in examples}) > 1
    alone = sum(answer_log_likelihood(model, *ex) / int((ex[2][:, 1:] != -100).sum()) for ex in examples)
    batches = list(padded_batches(examples, 3))
    assert [b[0].shape[0] for b in batches] == [3, 3, 2]
    together = sum(answer_log_likelihood(model, *b, per_example_mean=True) for b in batches)
    assert torch.allclose(together, alone, rtol=1e-5, atol=1e-5)
