"""Registry tasks through the command line: a real-task run, the check command, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from mergeval.run.config import register_configs
from tests.child import run_module

PAPERS = ["cmm_chem", "cmm_general", "mergebench", "medical_hier", "cpt_finance"]


def run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return run_module(module, *args, cwd=cwd, env=env, timeout=900)


def one_line(out: subprocess.CompletedProcess, field: str) -> str:
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mergeval: error: {field}") and "Traceback" not in out.stderr, (
        out.stderr[-2000:]
    )
    return lines[0]


@pytest.mark.parametrize("name", PAPERS)
def test_every_paper_experiment_composes_with_nothing_left_to_fill(name):
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={name}"])
    text = json.dumps(__import__("omegaconf").OmegaConf.to_container(cfg, resolve=True))
    assert "???" not in text
    sources = [cfg.modelset.base] + [e.source for e in cfg.modelset.experts.values()]
    assert all(s and s.startswith("hf:") for s in sources), sources
    assert cfg.benchmark.tasks


@pytest.mark.parametrize("name", ["mergebench", "cmm_chem", "medical_hier"])
def test_check_lists_what_a_paper_experiment_misses_offline(name, tmp_path, cache):
    out = run("mergeval.check", f"+experiment={name}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    problems = out.stderr.strip().splitlines()
    assert problems and all(
        p.startswith("mergeval: missing: ") and "fetch: " in p or "allow_code_execution" in p for p in problems
    ), problems
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={name}"])
    for source in [cfg.modelset.base] + [e.source for e in cfg.modelset.experts.values()]:
        assert source.removeprefix("hf:") in out.stdout + out.stderr
    assert not (tmp_path / "outputs").exists()


def test_check_calls_a_mistyped_local_path_missing_not_a_hub_download(tmp_path, cache):
    """It once said the path was not in the Hugging Face cache and offered `hf download /abs/path`."""
    out = run(
        "mergeval.check",
        "+experiment=tiny_registry",
        "modelset.experts.chem.domain=null",
        f"modelset.experts.chem.source={tmp_path / 'no' / 'such'}",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    line = next(p for p in out.stderr.splitlines() if "modelset.experts.chem" in p)
    assert "no such directory" in line and "hf download" not in line, line


def test_check_says_ready_when_everything_is_local(tmp_path, cache):
    out = run("mergeval.check", "+experiment=tiny_registry", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ready")
    assert "requests" in out.stdout and "gsm8k" in out.stdout and "local files" in out.stdout


def test_a_registry_run_reports_each_tasks_own_metric(tmp_path, cache):
    out = run("mergeval", "+experiment=tiny_registry", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(tmp_path.rglob("result.json")).read_text())
    metric = {t: result["scores"][t]["merged"]["metric"] for t in result["tasks"]}
    assert metric["hellaswag"] == "acc_norm,none"
    assert metric["gsm8k"] == "exact_match,flexible-extract"
    assert metric["wikitext"] == "word_perplexity,none"
    assert metric["mergeval_chem_count"] == "acc,none"
    assert result["rows"]["wikitext"]["higher_is_better"] is False
    assert "wikitext" in result["aggregates"]["excluded"]
    assert "exact_match,flexible-extract" in out.stdout and "lower is better" in out.stdout
    # Macro-Gain counts exactly the higher-is-better tasks (the experts as constituents)
    from mergeval.metrics.aggregates import macro_gain

    counted = [t for t in result["tasks"] if t != "wikitext"]
    merged = [result["scores"][t]["merged"]["value"] for t in counted]
    experts = [[result["scores"][t][e]["value"] for t in counted] for e in ("chem", "units")]
    assert result["aggregates"]["macro_gain"] == pytest.approx(macro_gain(merged, experts, scale="percent"))


@pytest.mark.parametrize(
    "override,field",
    [
        (
            "benchmark.tasks=[mergeval_chem_count,mergeval_unit_convert,hellaswagg]",
            "benchmark.tasks: unknown task 'hellaswagg'",
        ),
        ("+benchmark.metrics.hellaswag=bleu", "benchmark.metrics.hellaswag: 'bleu' is not reported"),
        (
            "benchmark.data.hellaswag.validation=shipped:data/gsm8k/test.jsonl",
            "benchmark.data.hellaswag: the files of its splits have different columns",
        ),
        ("metric.forgetting_tasks=[wikitext]", "metric.forgetting_tasks: 'wikitext' reports word_perplexity,none"),
        ("eval.device=cuda", "eval.device: cuda needs a CUDA GPU"),
        ("eval.backend=vllm", "eval.backend"),
    ],
)
def test_bad_benchmark_input_ends_in_one_line(override, field, tmp_path, cache):
    line = one_line(run("mergeval", "+experiment=tiny_registry", override, cwd=tmp_path), field)
    assert "; " in line  # the fix follows the problem
    assert not (tmp_path / "outputs").exists()
