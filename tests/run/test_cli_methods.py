"""CMM, pipelines and hierarchical merging through the Hydra app on the tiny zoo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.run.test_cli import mergeval


def result_of(out, tmp_path: Path) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = list(tmp_path.rglob("result.json"))
    return json.loads(path.read_text())


def test_cmm_ranks_experts_on_the_validation_split_and_records_the_order(tmp_path, tiny_dir):
    out = mergeval("+experiment=tiny", "method=cmm", "method.validation_items=20", cwd=tmp_path)
    result = result_of(out, tmp_path)
    merge = result["merge"]
    scores = merge["validation_scores"]
    assert set(scores) == {"chem", "units"}
    assert merge["order"] == sorted(scores, key=lambda name: (scores[name], name != "chem"))  # weakest first
    assert merge["coefficients"] == pytest.approx([0.3, 0.6])
    test_digests = set(result["task_digests"].values())
    assert not test_digests & set(merge["validation_digests"].values())  # validation data is not test data
    assert all(v["n"] == 20 for per in merge["validation_per_task"].values() for v in per.values())
    # each near tie (neighbours less than a combined stderr apart) is in result.json and printed
    stderrs = merge["validation_stderrs"]
    assert set(stderrs) == {"chem", "units"} and all(se > 0 for se in stderrs.values())
    a, b = merge["order"]
    tied = abs(scores[a] - scores[b]) < (stderrs[a] ** 2 + stderrs[b] ** 2) ** 0.5
    assert [t["experts"] for t in merge["validation_near_ties"]] == ([[a, b]] if tied else [])
    assert (f"mergeval: ranking: {a} and {b} are " in out.stdout) == tied


def test_cmm_order_changes_the_merged_model(tmp_path, tiny_dir):
    fps = {}
    for order in ("given", "reverse"):
        run_dir = tmp_path / order
        run_dir.mkdir()
        out = mergeval(
            "+experiment=tiny", "method=cmm", f"method.order={order}", "method.validation_scores=[0.2,0.9]", cwd=run_dir
        )
        result = result_of(out, run_dir)
        fps[order] = next(m["fingerprint"] for m in result["models"] if m["role"] == "merged")
        assert result["merge"]["order"] == (["chem", "units"] if order == "given" else ["units", "chem"])
        # the curriculum it chose is printed beside the table, not only stored
        first, second = result["merge"]["order"]
        assert f"curriculum: {first} (0.30) -> {second} (0.60)" in out.stdout, out.stdout[-1500:]
    assert fps["given"] != fps["reverse"]


def test_pipeline_runs_its_stages(tmp_path, tiny_dir):
    result = result_of(mergeval("+experiment=tiny", "method=pipeline", cwd=tmp_path), tmp_path)
    assert [s["name"] for s in result["config"]["method"]["stages"]] == ["chem_half", "final"]
    assert {m["role"] for m in result["models"]} == {"base", "chem", "units", "merged"}


def test_pipeline_with_an_unknown_input_is_one_line(tmp_path, tiny_dir):
    out = mergeval("+experiment=tiny", "method=pipeline", "method.stages.0.inputs=[nobody]", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "method.stages[0]" in lines[0] and "nobody" in lines[0], out.stderr


def test_hierarchical_merges_layer_by_layer(tmp_path, tiny_dir):
    result = result_of(mergeval("+experiment=tiny", "method=hierarchical", cwd=tmp_path), tmp_path)
    merged = next(m for m in result["models"] if m["role"] == "merged")
    experts = {m["fingerprint"] for m in result["models"] if m["role"] in ("chem", "units")}
    assert merged["fingerprint"] not in experts


def test_metric_group_full_adds_groups_forgetting_and_similarity(tmp_path, tiny_dir):
    result = result_of(mergeval("+experiment=tiny", "metric=full", "eval.force=true", cwd=tmp_path), tmp_path)
    agg = result["aggregates"]
    assert set(agg["groups"]) == {"base", "chem", "units", "merged"}
    general = result["scores"]["mergeval_general_facts"]
    assert agg["forgetting"]["mean"] == general["base"]["value"] - general["merged"]["value"]
    assert {"chem~units", "chem~merged", "units~merged"} == set(agg["similarity"])
    for role in ("base", "chem", "units", "merged"):  # ECE from the per-choice log-likelihoods kept per evaluation
        assert set(agg["calibration"][role]) == set(result["tasks"])
        assert all(0 <= v <= 1 for v in agg["calibration"][role].values())


def test_metric_group_naming_an_unknown_task_is_one_line(tmp_path, tiny_dir):
    out = mergeval("+experiment=tiny", "metric=full", "metric.forgetting_tasks=[mergeval_nope]", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "metric.forgetting_tasks" in out.stderr


@pytest.mark.parametrize(
    "preset,name,values",
    [
        ("medical_hier/dare_ties", "dare_ties", {"density": 0.6}),
        ("medical_hier/della", "della", {"density": 0.6, "epsilon": 0.05}),
        ("medical_hier/breadcrumbs", "breadcrumbs", {"density": 0.9, "gamma": 0.01}),
        ("mergebench/soup", "task_arithmetic", {"lambda_": 0.2}),
        ("mergebench/task_arithmetic", "task_arithmetic", {"lambda_": 0.4}),
        ("mergebench/ties", "ties", {"density": 0.3, "lambda_": 0.4}),
        ("mergebench/dare", "dare_linear", {"density": 0.1, "lambda_": 0.4, "rescale": "inverse_density"}),
        ("mergebench/consensus_ta", "consensus_ta", {"lambda_": 0.4, "k": 2, "tall_lambda": 0.2, "strict": True}),
        ("medical_hier/dare_ties_high", "dare_ties", {"density": 0.9}),
        ("cmm_chem/reverse", "cmm", {"order": "reverse", "schedule": "linear", "start": 0.3, "end": 0.6}),
        ("cmm_chem/constant", "cmm", {"order": "ranked", "schedule": "constant", "start": 0.45, "end": 0.45}),
        ("cmm_chem/task_arithmetic", "cmm", {"order": "ranked", "update": "additive", "start": 0.3, "end": 0.6}),
        ("regmean", "regmean", {"alpha": 0.5}),
        ("fisher", "fisher", {"epsilon": 1e-10}),
        ("localize_stitch", "localize_stitch", {"sparsity": 0.1}),
        ("localize_stitch_trained", "localize_stitch_trained", {"sparsity": 0.1, "lr": 1e8, "sigmoid_bias": 3.0}),
    ],
)
def test_a_papers_baseline_presets_carry_its_stated_hyperparameters(preset, name, values):
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from mergeval.methods import get_method
    from mergeval.run.config import register_configs

    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"method={preset}"])
    assert cfg.method.name == name and {k: cfg.method[k] for k in values} == values
    assert isinstance(OmegaConf.to_object(cfg.method), get_method(name).config)  # the method's schema, typed


def test_a_papers_presets_live_in_its_folder_and_its_experiments_sweep_them():
    """A paper's presets are ``conf/method/<paper>/<name>.yaml`` (``method=<paper>/<name>``), beside no method:
    each experiment that sweeps a paper's presets composes every job with the values its preset file sets."""
    import yaml
    from hydra import compose, initialize_config_module

    from mergeval.run.config import register_configs
    from mergeval.run.sweep_check import sweep_jobs

    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf" / "method"
    papers = [("cmm_mini", "cmm_chem"), ("medical_hier_mini", "medical_hier"), ("mergebench_mini", "mergebench")]
    for experiment, paper in papers:
        chosen = [o.removeprefix("method=") for job in sweep_jobs([f"+experiment={experiment}"]) for o in job]
        presets = [c for c in chosen if "/" in c]
        assert presets and all(c.startswith(f"{paper}/") for c in presets), chosen
        with initialize_config_module("mergeval.run.conf", version_base="1.3"):
            for preset in presets:
                method = compose("config", overrides=[f"+experiment={experiment}", f"method={preset}"]).method
                sets = {
                    k: v for k, v in yaml.safe_load((conf / f"{preset}.yaml").read_text()).items() if k != "defaults"
                }
                assert sets and {k: method[k] for k in sets} == sets, (experiment, preset)


@pytest.mark.parametrize(
    "constituents,roles", [("experts", ["chem", "units"]), ("base_and_experts", ["base", "chem", "units"])]
)
def test_every_aggregate_recomputes_from_the_result_files_scores(tmp_path, tiny_dir, constituents, roles):
    """Macro-Gain, Macro-OG, normalized scores, group means and forgetting, recomputed here by hand from the
    per-task scores in result.json, for two and three constituents (the base counted only when asked)."""
    # metric=full: groups domains (chem, units) and general, equal weights; forgetting on general_facts
    result = result_of(
        mergeval(
            "+experiment=tiny",
            "metric=full",
            f"metric.constituents={constituents}",
            "metric.similarity=false",
            "metric.calibration=false",
            cwd=tmp_path,
        ),
        tmp_path,
    )
    s = {t: {role: v["value"] for role, v in by_role.items()} for t, by_role in result["scores"].items()}
    tasks, agg = result["tasks"], result["aggregates"]
    avg = {role: sum(s[t][role] for t in tasks) / len(tasks) for role in ("base", "chem", "units", "merged")}
    assert agg["constituents"] == roles
    assert agg["macro_gain"] == pytest.approx(100 * (avg["merged"] - sum(avg[r] for r in roles) / len(roles)))
    assert agg["macro_og"] == pytest.approx(100 * (avg["merged"] - max(avg[r] for r in roles)))
    for task, expert in (("mergeval_chem_count", "chem"), ("mergeval_unit_convert", "units")):
        gain = s[task][expert] - s[task]["base"]
        want = None if gain == 0 else (s[task]["merged"] - s[task]["base"]) / gain
        assert agg["normalized"][task] == (None if want is None else pytest.approx(want))
    for role in ("base", "chem", "units", "merged"):
        domains = (s["mergeval_chem_count"][role] + s["mergeval_unit_convert"][role]) / 2
        assert agg["groups"][role] == pytest.approx((domains + s["mergeval_general_facts"][role]) / 2)
    drop = s["mergeval_general_facts"]["base"] - s["mergeval_general_facts"]["merged"]
    assert agg["forgetting"]["mean"] == pytest.approx(drop)
