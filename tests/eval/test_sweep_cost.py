"""benchmarks/sweep_cost.py's check that mergeval and the mergekit + lm_eval baseline got the same accuracies
(the benchmark itself takes 10+ minutes; here its comparison runs on files laid out as both sides write them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mergeval.eval.scorer import ACCURACY_TOLERANCE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep_cost():
    spec = importlib.util.spec_from_file_location("sweep_cost", ROOT / "benchmarks" / "sweep_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_job(sweep: Path, job: int, method: str, lam: float, scores: dict) -> None:
    """A result.json as python -m mergeval writes it for one job of a multirun (the fields the check reads)."""
    path = sweep / str(job) / "result.json"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "config": {"method": {"name": method, "lambda_": lam}},
                "scores": {
                    task: {
                        role: {"metric": "acc,none", "value": v, "stderr": 0.03, "n": 200}
                        for role, v in by_role.items()
                    }
                    for task, by_role in scores.items()
                },
            }
        )
    )


def write_lm_eval(out: Path, results: dict) -> Path:
    """lm_eval --output_path OUT writes OUT/<model path, sanitized>/results_<time>.json."""
    path = out / "__tmp__model" / "results_2026-01-01T00-00-00.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"results": {t: {"alias": t, **m} for t, m in results.items()}}))
    return out


def test_both_sides_read_and_agree(sweep_cost, tmp_path):
    sweep = tmp_path / "multirun"
    write_job(sweep, 0, "ties", 0.5, {"t1": {"base": 0.30, "chem": 0.50, "merged": 0.45}})
    write_job(sweep, 1, "ties", 1.0, {"t1": {"base": 0.30, "chem": 0.50, "merged": 0.40}})
    ours = sweep_cost.mergeval_accuracies(sweep)
    assert ours == {
        ("base", "t1"): ("acc,none", 0.30, 200),
        ("chem", "t1"): ("acc,none", 0.50, 200),
        ("ties lambda=0.5", "t1"): ("acc,none", 0.45, 200),
        ("ties lambda=1", "t1"): ("acc,none", 0.40, 200),
    }
    theirs = {}
    for model, acc in (("base", 0.30), ("chem", 0.50), ("ties lambda=0.5", 0.45), ("ties lambda=1", 0.405)):
        out = write_lm_eval(tmp_path / "lm_eval" / model, {"t1": {"acc,none": acc, "acc_stderr,none": 0.03}})
        theirs.update(sweep_cost.lm_eval_accuracies(out, model))
    assert theirs["chem", "t1"]["acc,none"] == 0.50
    assert sweep_cost.accuracy_mismatches(ours, theirs, 0.01) == []  # 0.405 vs 0.40: 1 item of 200
    assert sweep_cost.merge_label("ties", 1.0) == "ties lambda=1"


def test_a_difference_beyond_the_tolerance_is_named(sweep_cost):
    ours = {("base", "t1"): ("acc,none", 0.30, 200), ("ties lambda=1", "t1"): ("acc,none", 0.40, 200)}
    theirs = {("base", "t1"): {"acc,none": 0.30}, ("ties lambda=1", "t1"): {"acc,none": 0.43}}
    [line] = sweep_cost.accuracy_mismatches(ours, theirs, 0.01)
    assert line.startswith("ties lambda=1 / t1: acc,none 0.4000 (mergeval) vs 0.4300 (lm_eval)")
    assert "(6 of 200 items) > 0.01" in line
    assert sweep_cost.accuracy_mismatches(ours, theirs, 0.03) == []  # exactly at the tolerance: agrees


def test_pairs_scored_by_one_side_or_under_another_metric_are_mismatches(sweep_cost):
    ours = {("base", "t1"): ("acc_norm,none", 0.3, 200), ("chem", "t1"): ("acc,none", 0.5, 200)}
    theirs = {("base", "t1"): {"acc,none": 0.3}, ("units", "t1"): {"acc,none": 0.2}}
    assert sweep_cost.accuracy_mismatches(ours, theirs, 0.01) == [
        "units / t1: only the lm_eval side scored it",
        "base / t1: lm_eval reports no acc_norm,none",
        "chem / t1: only mergeval scored it",
    ]


def test_the_benchmark_compares_in_mergevals_precision_with_the_scorers_tolerance(sweep_cost):
    from mergeval.core.precision import auto_dtype

    assert sweep_cost.DTYPE == auto_dtype("cpu") and ACCURACY_TOLERANCE["bfloat16"] == 0.06
    cmd = sweep_cost.lm_eval_cmd(Path("/m"), Path("/tasks"), Path("/out"))
    assert f"pretrained=/m,dtype={sweep_cost.DTYPE},softmax_dtype=float32" in cmd  # the log-softmax our scorer takes


def write_staged(sweep: Path, pick: str | None) -> None:
    """A staged.json as the staged sweeper writes it (the fields the benchmark reads)."""
    sweep.mkdir(parents=True)
    candidates = [
        {"label": f"{m}(lambda_={lam})", "method": m, "config": {"lambda_": lam, "density": 0.5}}
        for m in ("task_arithmetic", "ties")
        for lam in (0.5, 1.0)
    ]
    sweep.joinpath("staged.json").write_text(json.dumps({"pick": pick, "candidates": candidates}))


def test_the_staged_pick_is_compared_with_the_best_of_full_evaluation(sweep_cost, tmp_path):
    full = tmp_path / "multirun"
    # dyadic fractions, so the means are exact and the two best tie exactly
    write_job(full, 0, "task_arithmetic", 0.5, {"t1": {"merged": 0.25}, "t2": {"merged": 0.25}})
    write_job(full, 1, "task_arithmetic", 1.0, {"t1": {"merged": 0.75}, "t2": {"merged": 0.25}})
    write_job(full, 2, "ties", 0.5, {"t1": {"merged": 0.5}, "t2": {"merged": 0.25}})
    write_job(full, 3, "ties", 1.0, {"t1": {"merged": 0.625}, "t2": {"merged": 0.375}})
    means = sweep_cost.full_means(full)
    assert means == {
        "task_arithmetic lambda=0.5": 0.25,
        "task_arithmetic lambda=1": 0.5,
        "ties lambda=0.5": 0.375,
        "ties lambda=1": 0.5,
    }
    order = ["task_arithmetic lambda=0.5", "task_arithmetic lambda=1", "ties lambda=0.5", "ties lambda=1"]
    write_staged(tmp_path / "a", "ties(lambda_=0.5)")
    pick = sweep_cost.staged_pick(tmp_path / "a")
    assert pick == "ties lambda=0.5"
    # a tie between the two best: the first in the sweep's order is the best, as the staged sweep breaks ties
    assert sweep_cost.pick_comparison(means, order, pick) == {
        "full_pick": "task_arithmetic lambda=1",
        "staged_pick": "ties lambda=0.5",
        "same_pick": False,
        "regret": 0.125,
    }
    assert sweep_cost.pick_comparison(means, order, "task_arithmetic lambda=1")["same_pick"]
    # equal accuracies in another task order are equal means (fsum, as the staged sweep computes them)
    other = tmp_path / "other"
    write_job(
        other, 0, "task_arithmetic", 0.5, {"t1": {"merged": 0.02}, "t2": {"merged": 0.14}, "t3": {"merged": 0.02}}
    )
    write_job(other, 1, "ties", 0.5, {"t1": {"merged": 0.02}, "t2": {"merged": 0.02}, "t3": {"merged": 0.14}})
    tied = sweep_cost.full_means(other)
    assert tied["task_arithmetic lambda=0.5"] == tied["ties lambda=0.5"]
    assert sweep_cost.pick_comparison(
        tied, ["task_arithmetic lambda=0.5", "ties lambda=0.5"], "task_arithmetic lambda=0.5"
    )["same_pick"]
    write_staged(tmp_path / "b", None)  # the staged sweep stopped before any benchmark
    assert sweep_cost.staged_pick(tmp_path / "b") is None
    assert sweep_cost.pick_comparison(means, order, None)["regret"] is None
