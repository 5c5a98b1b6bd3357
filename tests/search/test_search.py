"""Merge-recipe search (mergeval/search): the space's up-front checks, the stage pruner, and one search on the
tiny zoo that runs end to end, never scores a test item while tuning, prunes, and resumes its stored study."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from mergeval.core.errors import UserError
from mergeval.eval.tasks import task_items
from mergeval.methods import get_method
from mergeval.search.schema import register_search_configs
from mergeval.search.space import parse_space
from mergeval.search.study import StagePruner
from tests.child import run_module

register_search_configs()

# A search small enough for the suite: 16 validation items per task, 4 held-out texts per expert task, a study of
# 4 trials resumed to 6 (all drawn at random: a resumed sampler must not replay the first process's draws); the
# pruner keeps the top third once one trial has completed.
SMALL = [
    "+experiment=tiny",
    "search.validation_items=16",
    "search.heldout_items=4",
    "search.random_trials=10",
    "search.startup_trials=1",
    "search.keep_percent=34",
    "search.seed=1",
]


def compose_search(*overrides: str, config: str = "search_run"):
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        return compose(config, overrides=list(overrides))


def test_the_search_config_is_the_run_config_plus_the_search_section():
    """The search schema is merged after the run config: it must not reset any of the run's values."""
    search = OmegaConf.to_container(compose_search("+experiment=tiny", "eval.batch_size=7"))
    run = OmegaConf.to_container(compose_search("+experiment=tiny", "eval.batch_size=7", config="config"))
    assert search.pop("search")["method"] == "task_arithmetic"
    assert search == run


def test_a_study_is_not_resumed_across_a_change_of_the_held_out_scorer(monkeypatch):
    """Stage 1's pruning read the held-out NLLs: a new implementation version starts a new default study."""
    from mergeval.search import study

    cfg = compose_search(*SMALL)
    before = study.study_name(cfg, "space", {"a": 1})
    assert study.study_name(cfg, "space", {"a": 1}) == before
    monkeypatch.setattr(study, "NLL_VERSION", study.NLL_VERSION + 1)
    assert study.study_name(cfg, "space", {"a": 1}) != before


def test_a_misspelt_search_key_fails_when_the_config_is_composed():
    with pytest.raises(Exception, match="n_trails"):
        compose_search("search.n_trails=3")


# ---- the space, checked before any model loads ------------------------------------------------------------


def _space(method: str, space: dict, n_experts: int = 2):
    return parse_space(space, get_method(method), OmegaConf.structured(get_method(method).config), n_experts)


@pytest.mark.parametrize(
    "method, space, field, says",
    [
        ("task_arithmetic", {}, "search.space", "empty"),
        ("task_arithmetic", {"lambda": {"low": 0, "high": 1}}, "search.space.lambda", "no such field"),
        ("task_arithmetic", {"lambda_": {"lo": 0, "high": 1}}, "search.space.lambda_.lo", "not a search setting"),
        ("task_arithmetic", {"lambda_": {"low": 2, "high": 1}}, "search.space.lambda_", "not below"),
        ("task_arithmetic", {"lambda_": {"low": 0, "high": 1, "log": True}}, "search.space.lambda_.low", "log"),
        ("task_arithmetic", {"lambda_": 1.0}, "search.space.lambda_", "must be a mapping"),
        ("task_arithmetic", {"weights": {"low": 0.1, "high": 1}}, "search.space.weights.per_expert", "one value per"),
        (
            "task_arithmetic",
            {"lambda_": {"low": 0.1, "high": 1, "per_expert": True}},
            "search.space.lambda_.per_expert",
            "no per-expert lambda_",
        ),
        ("ties", {"density": {"low": 0.1, "high": 1.5}}, "search.space.density", "1.5 is refused by ties"),
        ("ties", {"sign_rule": {"choices": ["sum", "median"]}}, "search.space.sign_rule", "'median' is refused"),
        ("ties", {"lambda_": {"low": 0.1, "high": 1, "depth": 1}}, "search.space.lambda_.depth", ">= 2"),
        (
            "task_arithmetic",
            {"normalize": {"low": 0, "high": 1, "depth": 2}},
            "search.space.normalize.depth",
            "not a numeric parameter",
        ),
        (
            "ties",
            {"lambda_": {"low": 0.1, "high": 1, "match": "*mlp*"}},
            "search.space.lambda_.match",
            "only with depth",
        ),
    ],
)
def test_a_bad_space_is_one_line_naming_its_key(method, space, field, says):
    with pytest.raises(UserError) as err:
        _space(method, space)
    assert err.value.field == field and says in err.value.problem


def test_space_entries_become_the_method_fields_they_name():
    space = _space(
        "ties",
        {
            "lambda_": {"low": 0.5, "high": 2.0, "depth": 3, "match": "*mlp*"},
            "density": {"low": 0.1, "high": 1.0, "per_expert": True},
            "weights": {"low": 0.5, "high": 1.5, "per_expert": True},
            "sign_rule": {"choices": ["sum", "count"]},
        },
    )
    assert sorted(space.distributions()) == [
        "density[0]",
        "density[1]",
        "lambda_@0",
        "lambda_@1",
        "lambda_@2",
        "sign_rule",
        "weights[0]",
        "weights[1]",
    ]
    params = {
        "lambda_@0": 0.5,
        "lambda_@1": 1.0,
        "lambda_@2": 2.0,
        "density[0]": 0.2,
        "density[1]": 0.9,
        "weights[0]": 0.7,
        "weights[1]": 1.3,
        "sign_rule": "count",
    }
    assert space.overrides(params) == {
        "rules": [{"match": "*mlp*", "lambda_": [0.5, 1.0, 2.0]}],
        "per_expert": [{"density": 0.2}, {"density": 0.9}],
        "weights": [0.7, 1.3],
        "sign_rule": "count",
    }
    assert isinstance(
        _space("cmm", {"validation_items": {"low": 10, "high": 50}}).distributions()["validation_items"],
        optuna.distributions.IntDistribution,
    )


@pytest.mark.parametrize(
    "preset", sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "search").glob("*.yaml"))
)
def test_every_search_preset_composes_and_its_space_passes_its_method(preset):
    from mergeval.search.run import prepare

    cfg = compose_search("+experiment=quickstart", f"search={preset}")
    cfg.method = compose_search("+experiment=quickstart", f"method={cfg.search.method}").method
    method, space = prepare(cfg)
    assert method.name == cfg.search.method and space.distributions()


def test_a_space_written_for_another_method_is_refused():
    from mergeval.search.run import prepare

    with pytest.raises(UserError) as err:
        prepare(compose_search("+experiment=tiny", "search=ties"))
    assert err.value.field == "search.method" and "method=ties" in err.value.fix


def test_more_validation_items_than_the_pool_leaves_are_refused():
    from mergeval.search.run import prepare

    with pytest.raises(UserError) as err:
        prepare(compose_search("+experiment=tiny", "search.validation_items=490"))
    assert err.value.field == "search.validation_items"


# ---- the stage pruner ---------------------------------------------------------------------------------------


def _study_with(values_at_step0: list[float], completed: int):
    study = optuna.create_study(direction="maximize", pruner=StagePruner(keep_percent=50, startup_trials=2))
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for i, v in enumerate(values_at_step0):
        state = optuna.trial.TrialState.COMPLETE if i < completed else optuna.trial.TrialState.PRUNED
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": 0.5},
                distributions=dist,
                state=state,
                value=1.0 if i < completed else None,
                intermediate_values={0: v, 1: 100.0 + v},
            )
        )
    return study


def test_the_stage_pruner_compares_a_trial_only_at_the_stage_it_reached():
    study = _study_with([0.1, 0.2, 0.3, 0.4], completed=2)
    low, high = study.ask(), study.ask()
    low.report(0.15, 0)  # below the median of {0.1, 0.2, 0.3, 0.4, 0.15}
    high.report(0.35, 0)
    assert low.should_prune() and not high.should_prune()
    # Optuna's own percentile pruner takes a trial's best value over all steps; here step 1's values (100+) never
    # rescue a trial at step 0, and at step 1 the trial is ranked among step 1's values only
    high.report(100.1, 1)
    assert high.should_prune()


def test_a_stage_left_out_of_prune_at_never_prunes_by_rank():
    study = _study_with([0.1, 0.2, 0.3, 0.4], completed=2)
    study.pruner = StagePruner(keep_percent=50, startup_trials=2, prune_at=[2])
    trial = study.ask()
    trial.report(-5.0, 0)
    assert not trial.should_prune()
    trial.report(0.0, 1)
    assert trial.should_prune()


def test_no_trial_is_pruned_before_the_startup_trials_complete():
    study = _study_with([0.1, 0.2, 0.3], completed=1)
    trial = study.ask()
    trial.report(-5.0, 0)
    assert not trial.should_prune()


# ---- one search on the tiny zoo -----------------------------------------------------------------------------


class Spy:
    """The questions every lm-eval scoring call and the held-out text covered, by phase (tuning, then test)."""

    def __init__(self):
        self.phase, self.scored, self.heldout = "tuning", {"tuning": {}, "test": {}}, set()

    def record(self, harness, samples):
        for name, task in harness.task_dict["tasks"].items():
            docs = list(task.eval_docs)
            picked = [docs[i] for i in samples[name]] if samples else docs[: harness.limit or len(docs)]
            self.scored[self.phase].setdefault(name, set()).update(d["question"] for d in picked)


@pytest.fixture(scope="module")
def searched(cache, tiny_dir, tmp_path_factory):
    """A 4-trial search (tuning only), then the same search resumed to 6 trials after a trial was left running by
    a dead process, with the test split scored after tuning; every scored question and printed line recorded."""
    import contextlib
    import io

    from mergeval.eval.harness import Harness
    from mergeval.search import run as search_run
    from mergeval.staged import heldout

    store = tmp_path_factory.mktemp("search") / "results.sqlite"
    cfg = compose_search(*SMALL, "search.n_trials=4", "search.test=false", f"cache_dir={cache}", f"store.path={store}")
    spy, mp, printed = Spy(), pytest.MonkeyPatch(), io.StringIO()
    score, test, draw = Harness.score, search_run._test, heldout.heldout_items

    def scoring(self, model, tokenizer, samples=None):
        spy.record(self, samples)
        return score(self, model, tokenizer, samples=samples)

    def test_phase(*args, **kwargs):
        spy.phase = "test"
        return test(*args, **kwargs)

    def drawn(*args, **kwargs):
        items = draw(*args, **kwargs)
        spy.heldout |= {item["question"] for task_items_ in items.values() for item in task_items_}
        return items

    mp.setattr(Harness, "score", scoring)
    mp.setattr(search_run, "_test", test_phase)
    mp.setattr(heldout, "heldout_items", drawn)
    try:
        with contextlib.redirect_stdout(printed):
            first = search_run.run_search(cfg)
        # a trial left RUNNING by a process that is gone (a pid that has exited, on this host)
        gone = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        )
        study = optuna.load_study(study_name=first.study, storage=f"sqlite:///{store}")
        orphan = study.ask()
        orphan.set_user_attr("owner", [__import__("socket").gethostname(), int(gone.stdout), 0])
        spy.phase = "tuning"
        with contextlib.redirect_stdout(printed):
            resumed = search_run.run_search(
                compose_search(*SMALL, "search.n_trials=6", f"cache_dir={cache}", f"store.path={store}")
            )
    finally:
        mp.undo()
    study = optuna.load_study(study_name=first.study, storage=f"sqlite:///{store}")
    return cfg, first, resumed, orphan.number, spy, study, printed.getvalue()


def test_tuning_never_scores_a_test_item(searched):
    cfg, first, resumed, _, spy, _, _ = searched
    test_questions = {
        t: {item["question"] for item in task_items(t, cfg.benchmark.n_items)} for t in cfg.benchmark.tasks
    }
    tuned = spy.scored["tuning"]
    assert set(tuned) == set(cfg.benchmark.tasks)
    for task, questions in tuned.items():
        assert len(questions) == cfg.search.validation_items  # the whole validation split, and nothing else
        assert not questions & test_questions[task]
        assert not spy.heldout & test_questions[task]
    # the spy sees test items where they are scored (after tuning), so the assertions above can fail
    assert all(spy.scored["test"][t] == test_questions[t] for t in cfg.benchmark.tasks)


def test_the_test_split_is_reported_apart_from_the_validation_split(searched):
    cfg, first, resumed, _, _, _, _ = searched
    assert first.test is None  # search.test=false: tuning only
    for outcome in (first, resumed):
        assert outcome.best is not None and outcome.baseline.value is not None
        # the seeded default is a trial too: the best is the default or a sampled trial at least as good
        best = max([t["value"] for t in outcome.trials if t["state"] == "COMPLETE"] + [outcome.baseline.value])
        assert outcome.best.value == best
        assert outcome.best_is_default == (outcome.best.fingerprint == outcome.baseline.fingerprint)
        assert all(s["n"] == cfg.search.validation_items for s in outcome.best.scores.values())
    for label in ("best", "default"):
        scores = resumed.test[label]["scores"]
        assert {t: s["n"] for t, s in scores.items()} == {t: cfg.benchmark.n_items for t in cfg.benchmark.tasks}
    assert resumed.test["default"]["fingerprint"] == resumed.baseline.fingerprint


def test_the_search_prunes_and_costs_less_than_scoring_every_trial(searched):
    _, first, resumed, _, _, _, _ = searched
    cost = resumed.cost
    assert cost["pruned_at_stage1"] + cost["pruned_at_stage2"] >= 1
    assert cost["complete"] + cost["pruned_at_stage1"] + cost["pruned_at_stage2"] == cost["trials"] == 6
    assert cost["staged"]["forward_passes"] < cost["full"]["forward_passes"]
    # a pruned trial stopped where it says: no validation scores beyond its stage
    for t in resumed.trials:
        assert (t["state"] == "PRUNED") == (t["stage"] < 3)
        assert (t["stage2"] is None) == (t["stage"] == 1)


def test_a_stored_study_resumes_where_it_stopped(searched):
    _, first, resumed, orphan, _, study, _ = searched
    assert len(first.trials) == 4 and first.resumed == 0
    assert resumed.resumed == 4 and len(resumed.trials) == 6
    assert [t["number"] for t in resumed.trials[:4]] == [t["number"] for t in first.trials]
    assert resumed.orphans == [orphan]
    drawn = [tuple(sorted(t["params"].items())) for t in resumed.trials]
    assert len(set(drawn)) == len(drawn)  # the resumed sampler drew new points
    assert study.trials[orphan].state == optuna.trial.TrialState.FAIL
    assert json.dumps(resumed.cost)  # the report's cost is plain data


def test_the_default_seeds_the_study_once_as_a_free_trial(searched):
    cfg, first, resumed, _, _, study, printed = searched
    seeded = [t for t in study.trials if t.user_attrs.get("default")]
    assert len(seeded) == 1 and seeded[0].number == 0  # seeded before the first draw, not again on resuming
    assert seeded[0].value == first.baseline.value == resumed.baseline.value
    # the tiny experiment's default (lambda 1, weights null), as the preset's space names it
    assert seeded[0].params == {"lambda_": 1.0, **{f"weights[{i}]": 1.0 for i in range(len(cfg.modelset.experts))}}
    assert seeded[0].intermediate_values[0] == pytest.approx(-first.baseline.log_ratio)
    assert seeded[0].number not in [t["number"] for t in resumed.trials]  # not counted in search.n_trials
    assert printed.count("seeded as a trial the sampler starts from") == 1


def test_the_default_recipe_as_the_space_names_it():
    both = {"lambda_": {"low": 0.3, "high": 2.0}, "weights": {"low": 0.3, "high": 1.7, "per_expert": True}}
    space = _space("task_arithmetic", both)
    assert space.default_params({"lambda_": 1.0, "weights": None}) == {
        "lambda_": 1.0,
        "weights[0]": 1.0,
        "weights[1]": 1.0,
    }
    assert space.default_params({"lambda_": 1.0, "weights": [0.5, 1.5]})["weights[1]"] == 1.5
    assert space.default_params({"lambda_": 2.5, "weights": None}) is None  # outside the range
    ties = _space(
        "ties", {"density": {"low": 0.1, "high": 0.9, "per_expert": True}, "sign_rule": {"choices": ["sum", "count"]}}
    )
    config = {"density": 0.2, "sign_rule": "count", "per_expert": [{"density": 0.7}, None], "weights": None}
    assert ties.default_params(config) == {"density[0]": 0.7, "density[1]": 0.2, "sign_rule": "count"}
    assert ties.default_params({**config, "sign_rule": "other"}) is None
    depth = _space("ties", {"density": {"low": 0.1, "high": 0.9, "depth": 3}})
    assert depth.default_params({"density": 0.5, "rules": []}) == {f"density@{j}": 0.5 for j in range(3)}
    assert depth.default_params({"density": 0.5, "rules": [{"match": "*mlp*", "density": 0.3}]}) is None


def test_progress_lines_and_the_report(searched, tmp_path):
    from mergeval.search import report

    cfg, _, resumed, _, _, _, printed = searched
    progress = [line for line in printed.splitlines() if line.startswith("search: trial ")]
    assert [line.split()[2] for line in progress] == ["1/4", "2/4", "3/4", "4/4", "5/6", "6/6"]
    assert all("best so far" in line and "left" in line for line in progress)
    assert "resuming study" in printed
    summary = "\n".join(report.lines(resumed))
    assert "test split (scored once, after tuning)" in summary and "saved" in summary
    written = json.loads(report.write(cfg, resumed, tmp_path).read_text())
    assert written["resumed"] == 4 and written["cost"]["trials"] == 6 and written["test"]["best"]["scores"]


def test_the_best_recipe_runs_as_a_plain_run_that_reuses_the_searchs_scores(searched, tmp_path):
    """The summary's command line: the search's overrides less its own and Hydra's, plus the best recipe's
    fields in full; run, it merges the very model the search scored (same fingerprint) and evaluates nothing."""
    import shlex

    from mergeval.run.rerun import run_command

    cfg, _, resumed, _, _, _, _ = searched
    given = [
        *SMALL,
        "search.n_trials=6",
        f"cache_dir={cfg.cache_dir}",
        f"store.path={cfg.store.path}",
        "hydra.run.dir=search-job",
    ]
    args = shlex.split(run_command(given, ("search",), resumed.best_fields))
    assert args[:3] == ["python", "-m", "mergeval"] and not any(a.startswith(("search", "hydra")) for a in args)
    assert {a.split("=")[0] for a in args if a.startswith("method.")} == {f"method.{f}" for f in resumed.best_fields}
    out = run_module("mergeval", *args[3:], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    merged = json.loads(Path(out.stdout.split("result: ")[-1].strip()).read_text())["models"][-1]
    assert merged["fingerprint"] == resumed.test["best"]["fingerprint"]
    assert merged["evaluated"] == "reused from the results store"


def test_the_rerun_keeps_the_config_dir_and_the_users_own_words():
    """A --config-dir the sweep's experiment lives in (the command failed without it), and a mapping's
    override without the ++ open_mappings gave it; a ++ the user wrote on another key stays."""
    from mergeval.run.rerun import config_dir, run_command

    assert config_dir(["-m", "--config-dir", "conf", "+experiment=x"]) == ["--config-dir", str(Path("conf").resolve())]
    assert config_dir(["-cd=/a/b"]) == ["-cd", "/a/b"] and config_dir(["+experiment=x"]) == []
    assert (
        run_command(["++eval.gen_kwargs={a:1}", "++seed=1", "search.n_trials=3"], ("search",), {"lambda_": 0.5})
        == "python -m mergeval 'eval.gen_kwargs={a:1}' ++seed=1 method.lambda_=0.5"
    )


def test_a_recipe_value_is_written_in_hydras_grammar():
    from mergeval.run.rerun import hydra_value

    value = [{"match": "*mlp*", "lambda_": [0.1 + 0.2, 1e-05]}, {"sign_rule": "count", "on": True, "k": None}]
    assert (
        hydra_value(value) == '[{match:"*mlp*",lambda_:[0.30000000000000004,1e-05]},{sign_rule:"count",on:true,k:null}]'
    )


def test_a_finished_search_leaves_its_trials_in_the_stores_own_file(cache, tmp_path):
    """Optuna's pooled connections are closed when the search ends (search.study.opened_study): while one stayed
    open, SQLite kept everything written since in the "-wal" file beside the store, so the store's file alone,
    copied elsewhere, held no trials."""
    import sqlite3

    store = tmp_path / "results.sqlite"
    out = run_module(
        "mergeval.search",
        *SMALL,
        "search.n_trials=2",
        "search.test=false",
        f"cache_dir={cache}",
        f"store.path={store}",
        f"hydra.run.dir={tmp_path}/job",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert not Path(f"{store}-wal").exists()
    alone = tmp_path / "copy.sqlite"
    alone.write_bytes(store.read_bytes())
    db = sqlite3.connect(alone)
    try:
        assert db.execute("SELECT count(*) FROM trials").fetchone()[0] >= 2
    finally:
        db.close()


def test_a_bad_search_setting_is_one_line_and_exit_2(tmp_path):
    out = run_module(
        "mergeval.search",
        "+experiment=tiny",
        "search.space={lambda_: {low: 2, high: 1}}",
        f"hydra.run.dir={tmp_path}/job",
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "mergeval: error: search.space.lambda_: low 2 is not below high 1; give low < high"
    ]
    assert not (tmp_path / "job").exists()


def test_the_report_lists_scores_in_the_benchmarks_task_order():
    from mergeval.search.report import _scores_line

    read_back = {"mergeval_unit_convert": {"value": 0.94}, "mergeval_chem_count": {"value": 0.975}}
    assert (
        _scores_line(read_back, ["mergeval_chem_count", "mergeval_unit_convert"])
        == "chem_count 0.975  unit_convert 0.940"
    )


def test_a_search_that_cost_more_than_full_scoring_says_so():
    """4 trials on the tiny zoo, none pruned: stage 1's perplexities came on top and the summary said
    "107%, -7% saved"."""
    from mergeval.search.report import lines
    from mergeval.search.run import SearchOutcome
    from mergeval.search.trials import Scored

    def cost(fraction):
        full = {"forward_passes": 4800, "examples": 1200}
        staged = {"forward_passes": int(4800 * fraction), "examples": 1520}
        return {
            "trials": 4,
            "complete": 4,
            "pruned_at_stage1": 0,
            "pruned_at_stage2": 0,
            "staged": staged,
            "full": full,
            "fraction_of_full": fraction,
        }

    for fraction, says in ((16 / 15, "107%, 7% more (stage 1's perplexities"), (0.71, "71%, 29% saved")):
        outcome = SearchOutcome(
            "s", "macro_gain", "ties", 4, ["t"], 16, 4, Scored({}, {}, value=1.0), cost=cost(fraction)
        )
        assert says in "\n".join(lines(outcome))


def test_an_undefined_objective_is_one_line_not_a_crash():
    """search.objective=normalized where no expert beats the base on its own task on the validation split: the
    objective is undefined (None) for every recipe, and the default recipe's line crashed on it
    (``signed(None)``: TypeError) after the constituents had been scored."""
    from mergeval.core.outcome import MERGED, ModelInfo
    from mergeval.search.trials import defined_objective, objective

    def score(value):
        return {"metric": "acc,none", "value": value, "stderr": 0.01, "n": 100}

    models = [ModelInfo("base", "b", "f0"), ModelInfo("a", "a", "f1", task="t1"), ModelInfo("b", "b", "f2", task="t2")]
    models.append(ModelInfo(MERGED, "m", "f3"))
    constituents = {"t1": {"base": score(0.5), "a": score(0.4), "b": score(0.5)}, "t2": {"base": score(0.5)}}
    constituents["t2"].update(a=score(0.5), b=score(0.5))
    merged = {"t1": score(0.45), "t2": score(0.5)}
    value, _ = objective("normalized", merged, constituents, models, "fraction")
    assert value is None
    with pytest.raises(UserError) as err:
        defined_objective("normalized", value)
    assert err.value.field == "search.objective" and "no expert beats the base" in err.value.problem
    gain, _ = objective("macro_gain", merged, constituents, models, "fraction")
    assert defined_objective("macro_gain", gain) == gain
