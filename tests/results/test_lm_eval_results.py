"""lm-eval results in and out: a real ``lm_eval`` results file imported as the base's evaluation is what a run
then reuses (same numbers); refusals name the setting that differs; a run's models exported in lm-eval's shape
are read by lm-eval's own table writer and import back; the run's saved merge is a loadable model directory whose card
holds the evaluation table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mergeval.core.errors import UserError
from mergeval.results.store import Store
from mergeval.run.lm_eval_import import compose_run_config, import_results
from mergeval.run.lm_eval_import import main as import_main

TASK = "mergeval_chem_count"


def overrides(store: Path) -> list[str]:
    return [
        "+experiment=tiny",
        f"benchmark.tasks=[{TASK}]",
        "benchmark.n_items=8",
        "modelset.train.steps=1",
        "modelset.experts.units.task=null",
        "eval.backend=hflm",
        "eval.batch_size=1",
        "eval.dtype=float32",
        f"store.path={store}",
    ]


def lm_eval_cli(model_dir: Path, cache: Path, out: Path) -> Path:
    """The lm_eval command line on ``model_dir`` over mergeval's generated task (the files a run reads); the
    results file it wrote."""
    from mergeval.eval.tasks import write_tasks

    tasks = write_tasks([TASK], 8, cache)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model_dir},dtype=float32",
            "--tasks",
            TASK,
            "--include_path",
            str(tasks),
            "--batch_size",
            "1",
            "--device",
            "cpu",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return next(out.rglob("results_*.json"))


@pytest.fixture(scope="module")
def lm_eval_out(tiny_dir, cache, tmp_path_factory) -> Path:
    return lm_eval_cli(tiny_dir, cache, tmp_path_factory.mktemp("lm_eval"))


def test_the_saved_merge_scores_with_the_lm_eval_cli_as_the_run_recorded(imported_run, cache, tmp_path):
    """The saved merge is what was scored: lm_eval's hf backend on the directory gives the run's numbers."""
    merged = imported_run["outcome"].models[-1]
    file = json.loads(lm_eval_cli(Path(merged.path), cache, tmp_path).read_text())["results"][TASK]
    got = imported_run["outcome"].scores[TASK]["merged"]
    assert (file["acc,none"], file["acc_stderr,none"]) == pytest.approx((got["value"], got["stderr"]), abs=1e-12)


@pytest.fixture(scope="module")
def imported_run(lm_eval_out, tmp_path_factory) -> dict:
    """The file imported as zoo:tiny's evaluation, then a run of the same config (finished, in the store)."""
    from mergeval.run.app import run, write_result

    tmp = tmp_path_factory.mktemp("run")
    cfg = compose_run_config(overrides(tmp / "store.sqlite") + ["save_merged=true"])
    imported = import_results(cfg, lm_eval_out, "zoo:tiny")
    outcome = run(cfg, tmp / "job")
    write_result(cfg, outcome, tmp / "job")
    return {"cfg": cfg, "imported": imported, "outcome": outcome, "store": Store(tmp / "store.sqlite"), "tmp": tmp}


def test_a_run_reuses_the_imported_evaluation_with_its_numbers(lm_eval_out, imported_run):
    file = json.loads(lm_eval_out.read_text())["results"][TASK]
    base, merged = imported_run["outcome"].models[0], imported_run["outcome"].models[-1]
    assert (base.role, base.evaluated) == ("base", "reused from the results store")
    assert merged.evaluated == "this run"
    got = imported_run["outcome"].scores[TASK]["base"]
    assert (got["value"], got["stderr"], got["n"]) == (file["acc,none"], file["acc_stderr,none"], 8)


def test_imported_samples_become_mergevals_per_choice_log_likelihoods(lm_eval_out, imported_run):
    from mergeval.eval.samples import read

    logged = {
        r["doc_id"]: r
        for r in map(json.loads, next(lm_eval_out.parent.glob(f"samples_{TASK}_*.jsonl")).read_text().splitlines())
    }
    kept = read(imported_run["imported"]["samples"])[TASK]
    assert len(kept) == len(logged) == 8
    for row in kept:
        lm = logged[row["doc_id"]]
        assert row["lls"] == [float(r[0]) for r in lm["filtered_resps"]] and len(row["lls"]) == 4
        assert row["gold"] == lm["doc"]["answer"]
        assert float(max(range(4), key=row["lls"].__getitem__) == row["gold"]) == lm["acc"]


def _edit(data: dict, samples: list[dict], what: str) -> None:
    config = data["configs"][TASK]
    edits = {
        "versions.": lambda: data["versions"].update({TASK: 2}),
        "n-shot.": lambda: data["n-shot"].update({TASK: 5}),
        "n-samples.": lambda: data["n-samples"][TASK].update({"effective": 7}),
        "benchmark.limit": lambda: data["config"].update({"limit": 4}),
        "eval.batch_size": lambda: data["config"].update({"batch_size": "8"}),
        "eval.dtype": lambda: data["config"]["model_args"].update({"dtype": "bfloat16"}),
        "eval.backend": lambda: data["config"].update({"model": "vllm"}),
        "lm_eval:": lambda: data.update({"lm_eval_version": "0.4.2"}),
        "configs.": lambda: config.update({"doc_to_text": "{{question}}"}),
        "RESULTS.": lambda: samples[3]["doc"].update({"question": "How many?"}),
    }
    edits[what]()


@pytest.mark.parametrize(
    "what",
    [
        "versions.",
        "n-shot.",
        "n-samples.",
        "benchmark.limit",
        "eval.batch_size",
        "eval.dtype",
        "eval.backend",
        "lm_eval:",
        "configs.",
        "RESULTS.",
    ],
)
def test_a_file_that_differs_from_the_run_is_refused_in_one_line(what, lm_eval_out, tmp_path, capsys):
    data = json.loads(lm_eval_out.read_text())
    samples_file = next(lm_eval_out.parent.glob(f"samples_{TASK}_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    _edit(data, samples, what)
    (tmp_path / lm_eval_out.name).write_text(json.dumps(data))
    (tmp_path / samples_file.name).write_text("".join(json.dumps(s) + "\n" for s in samples))
    store = tmp_path / "store.sqlite"
    assert import_main([str(tmp_path / lm_eval_out.name), "--model", "zoo:tiny", *overrides(store)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mergeval: error: {what}") and "; " in err[0], err
    assert not store.exists() or _no_evaluations(store)  # nothing stored


def _no_evaluations(path: Path) -> bool:
    import sqlite3

    with sqlite3.connect(path) as db:
        return db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0] == 0


def test_results_of_another_model_are_refused(lm_eval_out, tiny_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    tensors = load_file(other / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    assert import_main([str(lm_eval_out), "--model", str(other), *overrides(tmp_path / "s.sqlite")]) == 2
    assert capsys.readouterr().err.startswith(f"mergeval: error: --model: the results are of {tiny_dir}")


def test_exported_files_are_read_where_lm_eval_puts_numbers_and_import_back(lm_eval_out, imported_run, tmp_path):
    from lm_eval.utils import make_table

    from mergeval.results.lm_eval_export import export_run

    outcome, lm = imported_run["outcome"], json.loads(lm_eval_out.read_text())
    written = export_run(imported_run["store"], outcome.run_id[:8], tmp_path / "out")
    assert sorted(p.name for p in written) == [
        "results_base.json",
        "results_chem.json",
        "results_merged.json",
        "results_units.json",
    ]
    base = json.loads((tmp_path / "out" / "results_base.json").read_text())
    for key in ("acc,none", "acc_stderr,none"):
        assert base["results"][TASK][key] == lm["results"][TASK][key]
    for key in ("versions", "n-shot", "higher_is_better"):
        assert base[key] == lm[key]
    assert base["config"]["model_args"]["pretrained"] == lm["config"]["model_args"]["pretrained"]
    merged = json.loads((tmp_path / "out" / "results_merged.json").read_text())
    score = outcome.scores[TASK]["merged"]
    table = make_table(merged)  # lm-eval's own reader of a results dict
    row = next(line for line in table.splitlines() if TASK in line).replace(" ", "").split("|")
    assert row[2:7] == ["1", "none", "0", "acc", "↑"] and row[8] == "±", row
    assert (float(row[7]), float(row[9])) == (round(score["value"], 4), round(score["stderr"], 4)), row
    # an exported constituent imports into another store as that model's evaluation
    chem = next(m for m in outcome.models if m.role == "chem")
    cfg = compose_run_config(overrides(tmp_path / "other.sqlite"))
    again = import_results(cfg, tmp_path / "out" / "results_chem.json", chem.path)
    assert again["stored"][TASK]["value"] == outcome.scores[TASK]["chem"]["value"]
    # the same run exported again replaces its own files; another run's are refused (once silently replaced)
    assert export_run(imported_run["store"], outcome.run_id[:8], tmp_path / "out", rebuild=False) == written
    merged["mergeval"]["run_id"] = "f" * 32
    (tmp_path / "out" / "results_merged.json").write_text(json.dumps(merged))
    with pytest.raises(UserError, match="results_merged.json is from run ffffffff; export each run into a dir"):
        export_run(imported_run["store"], outcome.run_id[:8], tmp_path / "out", rebuild=False)
    assert json.loads((tmp_path / "out" / "results_merged.json").read_text())["mergeval"]["run_id"] == "f" * 32


def test_the_saved_merge_loads_and_its_card_has_inputs_and_evaluation(imported_run):
    from transformers import AutoModelForCausalLM

    from mergeval.models.fingerprint import fingerprint

    outcome = imported_run["outcome"]
    merged = outcome.models[-1]
    where = Path(merged.path)
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= {p.name for p in where.iterdir()}
    assert AutoModelForCausalLM.from_pretrained(where).num_parameters() > 0
    assert fingerprint(where) == merged.weights  # the bytes saved are the merge that was scored
    card = (where / "README.md").read_text()
    assert all(m.weights in card for m in outcome.models[:-1]) and "task_arithmetic" in card
    row = next(line for line in card.splitlines() if line.startswith(f"| {TASK} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == [TASK, "acc,none", "8"]
    assert cells[3:] == [
        f"{outcome.scores[TASK][m.role]['value']:.4f} ± {outcome.scores[TASK][m.role]['stderr']:.4f}"
        for m in outcome.models
    ]
