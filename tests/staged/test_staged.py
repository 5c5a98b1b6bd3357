"""Staged evaluation: the perplexity metric, held-out text, cost accounting, selection, and sweeps on the tiny zoo."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module
from hypothesis import given
from hypothesis import strategies as st

from mergeval.core.errors import UserError
from mergeval.metrics.perplexity import degradation, log_perplexity, mean_log_ratio, perplexity
from mergeval.run.config import register_configs
from mergeval.staged.cost import Cost, benchmark_cost, cost_table, fractions
from mergeval.staged.heldout import GENERAL_TASK, domain_heldout, general_heldout, heldout_items
from mergeval.staged.nll import token_nlls
from mergeval.staged.plan import make_plan, stage2_limit
from mergeval.staged.selection import best_first, combine, mean_accuracy, promote
from tests.child import run_module

nll = st.floats(min_value=0.0, max_value=30.0, allow_nan=False)
texts = st.lists(st.lists(nll, min_size=1, max_size=8), min_size=1, max_size=8)


# ---- the perplexity metric -------------------------------------------------------------------------------


@given(texts)
def test_perplexity_is_at_least_one(nlls):
    assert perplexity(nlls) >= 1.0


@given(texts)
def test_perplexity_is_exp_of_the_token_mean(nlls):
    flat = [v for text in nlls for v in text]
    assert perplexity(nlls) == pytest.approx(math.exp(sum(flat) / len(flat)), rel=1e-12)


@given(texts, st.randoms(use_true_random=False))
def test_perplexity_ignores_the_order_of_texts_and_tokens(nlls, rng):
    shuffled = [list(text) for text in nlls]
    for text in shuffled:
        rng.shuffle(text)
    rng.shuffle(shuffled)
    assert perplexity(shuffled) == perplexity(nlls)  # exactly: fsum is exactly rounded


@given(texts)
def test_perplexity_weights_tokens_not_texts(nlls):
    flat = [v for text in nlls for v in text]
    assert log_perplexity(nlls) == log_perplexity([flat]) == log_perplexity([[v] for v in flat])


@given(st.integers(min_value=2, max_value=200_000), st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_a_uniform_model_over_v_tokens_has_perplexity_v(vocab, lengths):
    assert perplexity([[math.log(vocab)] * n for n in lengths]) == pytest.approx(vocab, rel=1e-9)


def test_perplexity_of_nothing_is_an_error_and_overflow_is_infinite():
    with pytest.raises(ValueError):
        perplexity([])
    assert perplexity([[1e6]]) == math.inf


ppls = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(1.0, 1e4), min_size=1)


@given(ppls, st.data())
def test_the_reference_shifts_every_stage1_key_alike(cand_a, data):
    tasks = list(cand_a)
    ref1, ref2, cand_b = (data.draw(st.fixed_dictionaries({t: st.floats(1.0, 1e4) for t in tasks})) for _ in range(3))
    gap1 = mean_log_ratio(cand_a, ref1) - mean_log_ratio(cand_b, ref1)
    gap2 = mean_log_ratio(cand_a, ref2) - mean_log_ratio(cand_b, ref2)
    assert gap1 == pytest.approx(gap2, abs=1e-9)
    assert degradation(cand_a, cand_a) == 0.0
    assert degradation(cand_a, ref1) == pytest.approx(math.exp(mean_log_ratio(cand_a, ref1)) - 1, rel=1e-9, abs=1e-12)


class UniformLM(torch.nn.Module):
    """Equal logits for every token: every next token has probability 1/V."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))


def test_token_nlls_of_a_uniform_model_give_perplexity_v_and_count_forward_passes():
    from mergeval.staged.nll import Spent

    seqs = [([1, 2, 3, 4], 2), ([5, 6], 1), ([7, 8, 9], 1)]
    spent = Spent()
    out = token_nlls(UniformLM(97), seqs, batch_size=2, pad_id=0, spent=spent)
    assert [len(x) for x in out] == [2, 1, 2]  # answer tokens only, in input order
    assert perplexity(out) == pytest.approx(97, rel=1e-5)
    assert (spent.forward_passes, spent.tokens, spent.batches) == (3, 9, 2)


def test_token_nlls_do_not_depend_on_batching(tiny_dir):
    from transformers import AutoTokenizer

    from mergeval.models.checkpoint import load_model
    from mergeval.models.zoo.domains import eval_items
    from mergeval.staged.nll import answer_sequences

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = load_model(tiny_dir)
    seqs = answer_sequences(tok, eval_items("unit_convert", 7) + eval_items("chem_count", 5))
    one = token_nlls(model, seqs, batch_size=1, pad_id=tok.pad_token_id)
    many = token_nlls(model, seqs, batch_size=5, pad_id=tok.pad_token_id)
    for a, b in zip(one, many):
        assert a == pytest.approx(b, abs=1e-4)


def test_token_nlls_with_logits_kept_from_the_first_answer_equal_all_logits(tiny_dir, monkeypatch):
    """Rows whose answers start at different positions in one batch; a model without logits_to_keep (UniformLM
    above) gets every position's logits."""
    from transformers import AutoTokenizer

    import mergeval.models.checkpoint as checkpoint
    from mergeval.models.checkpoint import load_model
    from mergeval.models.zoo.domains import eval_items
    from mergeval.staged.nll import answer_sequences

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = load_model(tiny_dir)
    assert checkpoint.takes_logits_to_keep(model)
    seqs = answer_sequences(tok, eval_items("unit_convert", 7) + eval_items("chem_count", 5))
    assert len({start for _, start in seqs}) > 1
    kept = token_nlls(model, seqs, batch_size=6, pad_id=tok.pad_token_id)
    monkeypatch.setattr(checkpoint, "takes_logits_to_keep", lambda model: False)
    every = token_nlls(model, seqs, batch_size=6, pad_id=tok.pad_token_id)
    assert [len(x) for x in kept] == [len(ids) - start for ids, start in seqs]
    for (ids, start), a, b in zip(seqs, kept, every):
        assert a == pytest.approx(b, abs=1e-6)
        with torch.inference_mode():  # from the definition: -ln p(ids[j] | ids[:j]), one sequence at a time
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
        assert a == pytest.approx([-logp[j - 1, ids[j]].item() for j in range(start, len(ids))], abs=1e-4)


# ---- held-out text -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "train", [SimpleNamespace(steps=30, batch_size=16, seed=0), SimpleNamespace(steps=6, batch_size=8, seed=3)]
)
@pytest.mark.parametrize("domain", ["chem_count", "unit_convert"])
def test_domain_heldout_is_disjoint_from_test_and_training_items(domain, train):
    from mergeval.eval.tasks import GENERATED
    from mergeval.models.zoo.domains import split_items
    from mergeval.models.zoo.experts import EVAL_POOL

    held = heldout_items([f"mergeval_{domain}"], 64, 200, {domain}, train)[f"mergeval_{domain}"]
    questions = {i["question"] for i in held}
    assert len(held) == len(questions) == 64
    tested = {i["question"] for i in GENERATED[f"mergeval_{domain}"](EVAL_POOL)}  # any benchmark size
    # the training items exactly as models/zoo/experts.py draws them
    trained, _ = split_items(
        domain, seed=0, n_train=train.steps * train.batch_size, n_eval=EVAL_POOL, train_seed=train.seed
    )
    assert not questions & tested
    assert not questions & {i["question"] for i in trained}
    assert domain_heldout(domain, 64, train.steps * train.batch_size, train.seed) == held  # deterministic


def test_general_heldout_is_disjoint_from_the_test_items_and_shrinks_with_the_pool():
    from mergeval.eval.tasks import GENERATED

    for n_items in (24, 200):
        held = general_heldout(64, n_items)
        tested = {i["question"] for i in GENERATED[GENERAL_TASK](n_items)}
        assert len(held) == 64 and not {i["question"] for i in held} & tested
    assert len(general_heldout(500, 200)) == 151  # 351 questions in the pool, 200 tested
    with pytest.raises(UserError, match="benchmark.n_items"):
        general_heldout(10, 351)


def test_lettered_tasks_get_the_held_out_text_of_their_cloze_task():
    train = SimpleNamespace(steps=6, batch_size=8, seed=3)
    tasks = ["mergeval_chem_count", "mergeval_chem_count_mc", "mergeval_general_facts", "mergeval_general_facts_mc"]
    held = heldout_items(tasks, 16, 200, {"chem_count"}, train)
    assert held["mergeval_chem_count_mc"] == held["mergeval_chem_count"]
    assert held["mergeval_general_facts_mc"] == held["mergeval_general_facts"]


# ---- cost accounting and selection -------------------------------------------------------------------------


def test_stage2_limit_rounds_up_without_float_noise():
    assert stage2_limit(0.15, 200) == 30 and stage2_limit(0.1, 24) == 3 and stage2_limit(0.01, 5) == 1
    assert stage2_limit(1.0, 7) == 7


@given(st.floats(0.001, 1.0), st.integers(1, 10_000))
def test_stage2_limit_is_the_smallest_count_covering_the_fraction(fraction, n):
    lim = stage2_limit(fraction, n)
    assert 1 <= lim <= n
    assert lim >= fraction * n - 1e-6 and (lim == 1 or lim - 1 < fraction * n)


def test_cost_table_of_the_quickstart_sweep():
    choices = {t: [4] * 200 for t in ("a", "b", "general")}
    # stage 1: 8 candidates on the two experts' tasks, and each expert on its own task (the reference)
    table = cost_table(8, {"a": 64, "b": 64}, 128, choices, 200, 30, n_stage2=4, n_stage3=3)
    assert table["stage1"] == Cost(8 * 128 + 128, 8 * 128 + 128)
    assert table["stage2"] == Cost(4 * 90, 4 * 360)
    assert table["stage3"] == Cost(3 * 510, 3 * 2040)
    assert table["full"] == Cost(8 * 600, 8 * 2400)
    assert fractions(table)["forward_passes"] == pytest.approx((1152 + 1440 + 6120) / 19200)


@given(
    st.integers(1, 12),
    st.lists(st.lists(st.integers(2, 6), min_size=2, max_size=30), min_size=1, max_size=4),
    st.data(),
)
def test_cost_table_sums(n_cand, per_task, data):
    choices = {f"t{i}": c for i, c in enumerate(per_task)}
    n_full = min(len(c) for c in per_task)
    n2 = data.draw(st.integers(1, n_full))
    k2 = data.draw(st.integers(0, n_cand))
    k3 = data.draw(st.integers(0, k2))
    texts = {t: data.draw(st.integers(1, 50)) for t in choices}
    reference = data.draw(st.integers(0, 200))
    table = cost_table(n_cand, texts, reference, choices, n_full, n2, k2, k3)
    assert table["staged"] == table["stage1"] + table["stage2"] + table["stage3"]
    one = benchmark_cost(choices, 0, n_full)
    assert table["full"] == one * n_cand
    assert benchmark_cost(choices, 0, n2) + benchmark_cost(choices, n2, n_full) == one  # stage 2 + 3 = one full
    assert table["stage1"].forward_passes == n_cand * sum(texts.values()) + reference


@given(st.lists(st.booleans(), min_size=2, max_size=300), st.data())
def test_combining_two_item_ranges_equals_scoring_them_together(correct, data):
    k = data.draw(st.integers(1, len(correct) - 1))

    def score(xs):
        return {"metric": "acc,none", "value": sum(xs) / len(xs), "n": len(xs)}

    both = combine(score(correct[:k]), score(correct[k:]))
    p = sum(correct) / len(correct)
    assert both["n"] == len(correct) and both["value"] == p
    assert both["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (len(correct) - 1)))


def test_promotion_is_stable_and_skips_the_excluded():
    keys = {"a": 1.0, "b": 0.5, "c": 1.0, "d": 0.1}
    assert best_first(keys, list(keys), higher_is_better=True) == ["a", "c", "b", "d"]
    assert promote(keys, list(keys), 2, higher_is_better=False, excluded=frozenset({"d"})) == ["b", "a"]
    assert mean_accuracy({"x": {"value": 0.5}, "y": {"value": 1.0}}) == 0.75


# ---- the plan: candidates validated before any work --------------------------------------------------------


def compose_staged(*overrides: str, experiment: str = "tiny_staged"):
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        return compose("config", overrides=[f"+experiment={experiment}", *overrides])


def test_the_staged_experiments_compose_into_their_grids():
    quick = compose_staged(experiment="quickstart_staged")
    plan = make_plan(quick.staged, ["a", "b"])
    assert len(plan.candidates) == 8 and plan.stage2_fraction == 0.15 and plan.stage3_keep == 3
    assert plan.candidates[0].label == "task_arithmetic(lambda_=0.5)" and plan.candidates[0].config.lambda_ == 0.5
    assert {c.method.name for c in plan.candidates} == {"task_arithmetic", "ties"}


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["staged.candidates=[{name:ties,densty:0.5}]"], "staged.candidates[0].densty: no such field of method ties"),
        (["staged.candidates=[{name:ties,lambda_:abc}]"], "staged.candidates[0].lambda_:"),
        (["staged.candidates=[{name:ties,density:1.5}]"], "staged.candidates[0].density:"),
        (["staged.candidates=[{lambda_:1.0}]"], "staged.candidates[0].name: missing"),
        (["staged.candidates=[{name:task_arithmetic,lambda_:0.5}]"], "staged.candidates[0]: candidate task_arithmetic"),
        (["+staged.grid.nope={lambda_:[1.0]}"], "staged.grid.nope: unknown merge method 'nope'"),
        (["staged.grid.ties.lambda_=[]"], "staged.grid.ties.lambda_: empty list"),
        (["staged.stage3_keep=5"], "staged.stage3_keep:"),
        (["staged.stage2_fraction=0"], "staged.stage2_fraction:"),
        (["staged.keep_memory=1.5"], "staged.keep_memory:"),
        (["~staged.grid.task_arithmetic", "~staged.grid.ties"], "staged: no candidates"),
    ],
)
def test_bad_candidates_and_stage_sizes_are_one_user_error(overrides, field):
    cfg = compose_staged(*overrides)
    with pytest.raises(UserError) as err:
        make_plan(cfg.staged, ["a", "b"])
    assert str(err.value).startswith(field), str(err.value)


# ---- sweeps on the tiny zoo --------------------------------------------------------------------------------

# One expert that clearly learned its task (80 steps: unit_convert 0.71 vs the base's 0.21 on 24 items), and
# three candidates whose order is known by construction: task arithmetic with lambda 0 is the base, lambda 1 is
# the expert itself (up to float rounding), lambda 8 overshoots the task vector eight times and wrecks the model.
KNOWN = [
    "~modelset.experts.chem",
    "benchmark.tasks=[mergeval_unit_convert,mergeval_general_facts]",
    "modelset.train.steps=80",
    "modelset.train.batch_size=16",
    "~staged.grid.ties",
]


@pytest.fixture(scope="module")
def known(cache):
    from mergeval.staged.pipeline import run_staged

    cfg = compose_staged(
        *KNOWN,
        f"cache_dir={cache}",
        "staged.grid.task_arithmetic.lambda_=[0.0,1.0,8.0]",
        "staged.stage1_keep=2",
        "staged.stage3_keep=1",
        "staged.full=true",
        "eval.force=true",
    )
    return cfg, run_staged(cfg)


def test_staged_picks_the_known_best_and_agrees_with_full_evaluation(known):
    _, out = known
    labels = [c.label for c in out.candidates]
    assert labels == ["task_arithmetic(lambda_=0.0)", "task_arithmetic(lambda_=1.0)", "task_arithmetic(lambda_=8.0)"]
    base, expert, wrecked = out.candidates
    assert base.fingerprint == out.constituents[0].fingerprint  # lambda 0 is the base, bit for bit
    assert list(out.reference) == ["mergeval_unit_convert"]  # stage 1 scores the experts' own tasks only
    assert out.reference["mergeval_unit_convert"]["model"] == "units"
    assert expert.log_ratio == pytest.approx(0.0, abs=1e-3)  # the expert is its own reference
    assert base.log_ratio > expert.log_ratio
    # degraded: more than twice the expert's perplexity on its task; the unmerged base is too (it lacks the skill)
    assert wrecked.degraded and base.degraded and not expert.degraded
    assert out.stage2 == [expert.label] and out.stage3 == [expert.label]
    assert out.pick == expert.label and out.early_stop is None
    assert out.comparison == {"full_pick": expert.label, "staged_pick": expert.label, "same_pick": True, "regret": 0.0}


def test_stage3_scores_equal_a_direct_full_run(known):
    _, out = known
    finalist = out.result(out.pick)
    for task in out.tasks:
        assert finalist.stage3[task]["value"] == pytest.approx(finalist.full[task]["value"], abs=1e-12)
        assert finalist.stage3[task]["n"] == finalist.full[task]["n"] == out.n_full


def test_cost_accounting_matches_what_ran(known):
    _, out = known
    # eval.force: every evaluation ran, so lm-eval's own request counts must equal the counts from the data
    for stage in ("stage1", "stage2", "stage3", "full"):
        assert out.ran[stage] == out.cost[stage].forward_passes, stage
    assert out.cost["stage2"].examples == 1 * len(out.tasks) * out.stage2_items
    assert out.cost["stage3"].examples == 1 * len(out.tasks) * (out.n_full - out.stage2_items)
    assert out.cost["staged"].forward_passes < out.cost["full"].forward_passes


def test_staged_json_is_strict_json_with_the_pick_and_costs(known, tmp_path):
    from mergeval.staged.report import render, write

    cfg, out = known
    data = json.loads((write(cfg, out, tmp_path)).read_text())
    json.dumps(data, allow_nan=False)  # an overflowing perplexity is written as a string, not Infinity
    assert data["pick"] == out.pick and data["full_comparison"]["same_pick"] is True
    assert data["cost"]["fraction_of_full"]["forward_passes"] == pytest.approx(
        out.cost["staged"].forward_passes / out.cost["full"].forward_passes
    )
    assert data["config"]["staged"]["stage3_keep"] == 1 and data["versions"]["torch"]
    render(out, "test")


def staged_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return run_module("mergeval.staged", "+experiment=tiny_staged", *args, cwd=cwd, env=env, timeout=900)


def test_the_pick_runs_as_a_plain_run_of_the_same_merge(cache, tmp_path):
    """staged.json's pick_command (printed too): the pick's method and the fields it sets beyond that method's
    composed defaults; run, it merges the model the sweep picked (the same fingerprint)."""
    import shlex

    out = staged_cli(
        "~staged.grid.task_arithmetic", "staged.grid.ties.lambda_=[0.7]", "staged.grid.ties.density=[0.3]", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(next(tmp_path.rglob("staged.json")).read_text())
    command = data["pick_command"]
    assert f"as a run (result.json, the results store; stored evaluations are reused): {command}" in out.stdout
    args = shlex.split(command)
    assert args[:4] == ["python", "-m", "mergeval", "+experiment=tiny_staged"] and "method=ties" in args
    assert {"method.lambda_=0.7", "method.density=0.3"} <= set(args) and not any("staged" in a for a in args[4:])
    run = run_module("mergeval", *args[3:], cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    merged = json.loads(Path(run.stdout.split("result: ")[-1].strip()).read_text())["models"][-1]
    assert merged["fingerprint"] == next(c["fingerprint"] for c in data["candidates"] if c["label"] == data["pick"])


def test_a_task_whose_own_settings_changed_is_the_only_one_evaluated_again(cache, tmp_path):
    """Per-task store keys: after a staged sweep, the same sweep with one task's few-shot count changed ran
    stages 2 and 3 on every task again (all or nothing per candidate); now only that task."""
    store, ran = tmp_path / "s.sqlite", []
    for i, extra in enumerate(([], ["benchmark.fewshot.mergeval_chem_count=2"])):
        out = staged_cli(f"store.path={store}", f"hydra.run.dir={tmp_path / str(i)}", *extra, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        ran.append(json.loads((tmp_path / str(i) / "staged.json").read_text())["forward_passes_run_in_this_job"])
    tasks = 3  # tiny_staged's benchmark: chem_count, unit_convert, general_facts
    for stage in ("stage2", "stage3"):
        assert 0 < ran[1][stage] < ran[0][stage] * 2 / tasks, (stage, ran)


def test_early_stop_when_every_candidate_degrades(cache, tmp_path):
    out = staged_cli(*KNOWN, "staged.grid.task_arithmetic.lambda_=[8.0,-8.0]", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "early stop" in out.stdout
    data = json.loads(next(tmp_path.rglob("staged.json")).read_text())
    assert data["early_stop"] and data["pick"] is None and data["stage2"] == []
    assert all(c["degraded"] for c in data["candidates"])
    assert data["cost"]["stage2"]["forward_passes"] == data["cost"]["stage3"]["forward_passes"] == 0
    assert all(m["evaluated"] is None for m in data["constituents"])  # no benchmark ran at all


@pytest.mark.parametrize(
    "override,line",
    [
        ("staged.candidates=[{name:ties,density:-0.5}]", "mergeval: error: staged.candidates[0].density:"),
        ("staged.stage1_kep=3", "mergeval: error: staged.stage1_kep: no such field"),
    ],
)
def test_a_bad_candidate_is_one_line_and_exit_2(override, line, cache, tmp_path):
    out = staged_cli(override, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line) and "Traceback" not in out.stderr, out.stderr
    assert not list(tmp_path.rglob("staged.json")) and not list(tmp_path.rglob(".hydra"))


def test_a_config_without_a_staged_section_says_which_experiment_to_use():
    with pytest.raises(UserError, match="^staged: no staged section.*quickstart_staged"):
        make_plan(None, ["a", "b"])


# ---- a plain -m sweep evaluated in stages (hydra/sweeper=staged) ------------------------------------------

NO_GRID = ["~staged.grid.task_arithmetic", "~staged.grid.ties"]  # tiny_staged's own grid


def sweep_configs(*jobs: list[str]):
    return [compose_staged(*job, *NO_GRID) for job in jobs]


def test_each_job_of_a_sweep_is_one_candidate_named_by_what_was_swept():
    from mergeval.staged.from_sweep import staged_config

    jobs = [
        ["method=task_arithmetic", "method.lambda_=1.0"],
        ["method=task_arithmetic", "method.lambda_=2.0"],
        ["method=ties", "method.lambda_=1.0", "method.density=0.3"],
    ]
    cfg = staged_config(sweep_configs(*jobs), ["a", "b", "c"])
    plan = make_plan(cfg.staged, ["a", "b"])
    # lambda_=1.0 is the default, but it was swept, so it names the candidate; density differs from ties' default
    assert [c.label for c in plan.candidates] == [
        "task_arithmetic(lambda_=1.0)",
        "task_arithmetic(lambda_=2.0)",
        "ties(density=0.3)",
    ]
    assert plan.candidates[2].config.density == 0.3 and plan.stage1_keep == 4  # the experiment's stage sizes


@pytest.mark.parametrize(
    "jobs,line",
    [
        ([["method.lambda_=1.0"], ["method.lambda_=2.0", "seed=1"]], "seed: differs between the sweep's jobs (a / b)"),
        ([["method.lambda_=1.0"], ["method.lambda_=2.0", "eval.batch_size=8"]], "eval.batch_size: differs"),
        ([["method=ties", "method.density=1.5"]], "method.density: "),
        ([["method.lambda_=1.0"], ["method.lambda_=1"]], "method: sweep jobs a and b are the same merge"),
    ],
)
def test_a_sweep_that_is_not_a_set_of_merges_is_one_user_error(jobs, line):
    from mergeval.staged.from_sweep import staged_config

    with pytest.raises(UserError) as err:
        make_plan(staged_config(sweep_configs(*jobs), ["a", "b"][: len(jobs)]).staged, ["a", "b"])
    assert str(err.value).startswith(line), str(err.value)


def test_a_sweep_and_a_staged_grid_together_are_one_user_error():
    from mergeval.staged.from_sweep import staged_config

    with pytest.raises(UserError, match="^staged.grid: with hydra/sweeper=staged the sweep's jobs are the candidates"):
        staged_config([compose_staged("method.lambda_=2.0")], ["a"])


def test_the_staged_sweeper_gives_what_python_m_mergeval_staged_gives(known, cache, tmp_path):
    """The same candidates through ``-m hydra/sweeper=staged``: the same stages, scores and pick (the benchmark
    evaluations come from the results store the in-process sweep filled; stage 1 runs again)."""
    _, out = known
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = run_module(
        "mergeval",
        "-m",
        "+experiment=tiny_staged",
        "hydra/sweeper=staged",
        *KNOWN,
        "~staged.grid.task_arithmetic",
        "method=task_arithmetic",
        "method.lambda_=0.0,1.0,8.0",
        "staged.stage1_keep=2",
        "staged.stage3_keep=1",
        "staged.full=true",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "sweep" / "staged.json").read_text())
    assert (tmp_path / "sweep" / "multirun.yaml").is_file()
    assert [c["label"] for c in data["candidates"]] == [c.label for c in out.candidates]
    assert data["pick"] == out.pick and data["stage2"] == out.stage2 and data["stage3"] == out.stage3
    for mine, theirs in zip(data["candidates"], out.candidates):
        assert mine["fingerprint"] == theirs.fingerprint
        assert mine["log_ratio"] == pytest.approx(theirs.log_ratio, abs=1e-9)
    # the pick as a plain run: the picked job's overrides, less the sweeper's and the staged section's
    import shlex

    args = shlex.split(data["pick_command"])
    assert "method.lambda_=1.0" in args and not any(a.startswith(("hydra", "staged", "~staged")) for a in args)
    again = run_module("mergeval", *args[3:], cwd=tmp_path, env=env, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    merged = json.loads(Path(again.stdout.split("result: ")[-1].strip()).read_text())["models"][-1]
    assert merged["fingerprint"] == out.result(out.pick).fingerprint
    assert merged["evaluated"] == "reused from the results store"  # staged.full scored the pick in full


def test_a_bad_swept_value_under_the_staged_sweeper_is_one_line_and_exit_2(cache, tmp_path):
    run = run_module(
        "mergeval",
        "-m",
        "+experiment=tiny_staged",
        "hydra/sweeper=staged",
        *NO_GRID,
        "method=ties",
        "method.density=0.5,1.5",
        cwd=tmp_path,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        timeout=900,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mergeval: error: method.density:"), run.stderr
    assert "method.density=1.5" in lines[0] and not list(tmp_path.rglob("staged.json"))


def test_candidates_get_what_their_method_needs_from_the_models_as_a_run_does(cache):
    """A staged sweep prepares each candidate with the run's own step (``ranking.prepare_method``): CMM's ranking of
    the experts on the validation split, hierarchical's head counts from the base's config.json, a pipeline's expert
    names. The CMM candidate merges with the very validation scores a run of method=cmm ranks by."""
    from omegaconf import open_dict

    from mergeval.models.checkpoint import read_config
    from mergeval.models.zoo.resolve import resolve_models
    from mergeval.run.checks import validate
    from mergeval.run.ranking import prepare_method
    from mergeval.staged.pipeline import run_staged

    cfg = compose_staged(f"cache_dir={cache}", "~staged.grid.task_arithmetic", "~staged.grid.ties", "staged.full=true")
    stages = [
        {"name": "half", "base": "base", "inputs": ["chem"], "method": {"name": "task_arithmetic", "lambda_": 0.5}},
        {"name": "final", "base": "base", "inputs": ["half", "units"], "method": {"name": "linear"}},
    ]
    with open_dict(cfg):
        cfg.staged.candidates = [
            {"name": "cmm", "validation_items": 8},
            {"name": "hierarchical"},
            {"name": "pipeline", "stages": stages},
        ]
    out = run_staged(cfg)
    cmm, hierarchical, pipeline = out.candidates
    assert [c.method for c in out.candidates] == ["cmm", "hierarchical", "pipeline"]
    assert all(c.full is not None for c in out.candidates)  # each was merged and scored

    run_cfg = compose_staged(f"cache_dir={cache}", "method=cmm", "method.validation_items=8")
    method, method_cfg = validate(run_cfg)
    base_dir, _, models = resolve_models(run_cfg, cache)
    ranked, details = prepare_method(run_cfg, method, method_cfg, models, base_dir, cache, can_evaluate=True)
    assert cmm.config["validation_scores"] == ranked.validation_scores and len(ranked.validation_scores) == 2
    heads = read_config(base_dir)
    assert hierarchical.config["num_attention_heads"] == heads["num_attention_heads"]
    assert pipeline.config["expert_names"] == ["chem", "units"]
