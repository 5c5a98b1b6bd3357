"""What a new user meets first: help, quiet output, settings that take effect, nothing written where it should not be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mergeval.core.outcome import fixed
from mergeval.metrics.aggregates import band
from tests.child import run_module


def run(module: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return run_module(module, *args, cwd=cwd, env=full, timeout=900)


@pytest.mark.parametrize("module", ["mergeval", "mergeval.check", "mergeval.merge", "mergeval.staged"])
def test_help_describes_mergeval_and_its_real_choices(module, tmp_path):
    out = run(module, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("mergeval: merge LLM checkpoints") and f"python -m {module} " in text
    for choice in (
        "task_arithmetic",
        "ties",
        "quickstart_registry",
        "cmm_chem",
        "cmm_overall",
        "mergeval.check",
        "result.json",
        "results.sqlite",
        "offline=false",
    ):
        assert choice in text, choice
    assert "_schema" not in text and "powered by Hydra" not in text
    assert not (tmp_path / "outputs").exists()


def test_importing_the_evaluator_leaves_the_hub_switch_alone():
    """offline=false must reach the model resolver: no module may force HF_HUB_OFFLINE on import."""
    code = (
        "import os; os.environ.pop('HF_HUB_OFFLINE', None); import mergeval.eval.harness, mergeval.eval.suite, "
        "mergeval.run.app; print(os.environ.get('HF_HUB_OFFLINE'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "None", out.stderr


def test_offline_false_reaches_the_hub_client():
    import huggingface_hub.constants as hub

    from mergeval.core.runtime import apply_offline

    try:
        apply_offline(False)
        assert os.environ["HF_HUB_OFFLINE"] == "0" and hub.HF_HUB_OFFLINE is False
    finally:
        apply_offline(True)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and hub.HF_HUB_OFFLINE is True


def test_a_run_is_quiet_caches_only_where_asked_and_warns_when_experts_did_not_learn(tmp_path, cache):
    """lm-eval's bars stay off (mergeval prints one progress line per model), the datasets library caches under
    the chosen cache directory and not in ~/.cache, and the tiny zoo's experts, which do not beat the base on
    their own tasks, get a warning that their normalized scores mean nothing."""
    home, own_cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    out = run(
        "mergeval", "+experiment=tiny_registry", cwd=tmp_path, env={"HOME": str(home), "MERGEVAL_CACHE": str(own_cache)}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Tokenizing inputs" not in out.stderr and "it/s]" not in out.stderr.replace("step/s", "")
    # the merge is evaluated first (then released, so one model is in memory at a time), the constituents after
    assert "[1/4] merged: evaluating on 7 of 7 tasks" in out.stdout and "[2/4] base: 366 requests" in out.stdout
    assert not (home / ".cache" / "huggingface").exists(), sorted(p.name for p in home.rglob("*"))[:10]
    assert (own_cache / "hf_datasets").is_dir()
    assert "does not beat the base on its own task mergeval_chem_count" in out.stdout
    verbose = run(
        "mergeval",
        "+experiment=tiny_registry",
        "verbose=true",
        "eval.force=true",
        cwd=tmp_path,
        env={"HOME": str(home), "MERGEVAL_CACHE": str(own_cache)},
    )
    assert verbose.returncode == 0 and "Tokenizing inputs" in verbose.stderr


def test_merge_to_a_given_output_leaves_no_job_directory(tmp_path, cache):
    out = run("mergeval.merge", "+experiment=tiny", f"output={tmp_path / 'merged'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "merged" / "config.json").is_file() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "value,want",
    [
        ((0.3 - 0.2) / (0.4 - 0.2), "moderate"),  # 0.4999999999999999
        ((0.4 + 0.6) / 2, "moderate"),
        ((0.8 + 0.9) / 2, "good"),
        ((0.7 + 0.9) / 2, "moderate"),
        (0.495, "failing"),
    ],
)
def test_a_score_shown_as_the_band_edge_gets_that_band(value, want):
    assert f"{value:.2f}" != "0.50" or want == "moderate"
    assert band(value) == want


def test_no_negative_zero_is_printed():
    assert fixed(-0.001) == "0.00" and fixed(-0.006) == "-0.01" and fixed(0.0) == "0.00"


def test_scores_of_older_result_files_are_read_as_acc():
    from mergeval.core.outcome import score_metric, score_value

    assert score_value({"value": 0.5}) == 0.5 and score_value({"acc": 0.25}) == 0.25
    assert score_metric({"acc": 0.25}) == "acc,none" and score_metric({"metric": "x,y", "value": 1}) == "x,y"


def test_every_package_of_the_source_tree_is_installed():
    """A wheel holds only the packages pyproject lists: a new subpackage missing there imports fine from a
    checkout (editable install) and fails after `pip install .` (the README's commands)."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "mergeval").rglob("__init__.py")}
    assert found - {"mergeval.run.conf"} <= listed, sorted(found - listed)


def test_an_editable_install_puts_the_checkout_on_the_path(tmp_path):
    """`pip install -e .` (how contributors work) must be a plain path entry: Hydra finds its plugins
    (hydra/sweeper=staged, hydra/launcher=ray) by listing ``hydra_plugins`` on the path, which setuptools'
    import-finder editable mode hides. The editable wheel the build backend makes holds a .pth naming the
    checkout and no finder module."""
    import zipfile

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"""
import os
os.chdir({str(root)!r})
from setuptools import build_meta
print(build_meta.build_editable({str(tmp_path)!r}))""",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = zipfile.ZipFile(tmp_path / done.stdout.split()[-1]).namelist()
    pth = [n for n in names if n.endswith(".pth")]
    assert len(pth) == 1 and not [n for n in names if "finder" in n], names
    text = zipfile.ZipFile(tmp_path / done.stdout.split()[-1]).read(pth[0]).decode()
    assert Path(text.strip()).resolve() == root, text
