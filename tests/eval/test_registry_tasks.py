"""Registry tasks of every output type: mergeval's scores equal the ``lm_eval`` command line's on the same model.

The tasks are lm-eval's own (hellaswag, mmlu_high_school_chemistry, medqa_4options: multiple_choice; gsm8k:
generate_until with its regex filters; wikitext: loglikelihood_rolling) over the small data sets mergeval ships
in their schemas. The command line gets them the way a user would: an ``--include_path`` YAML per task that
``include:``s the registry YAML and points it at the files (written here, independently of mergeval's own).
Float32 on the tiny zoo model: the same answers, log-likelihoods within 1e-4, the same generated text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from mergeval.eval.suite import SHIPPED
from mergeval.run.config import BenchmarkConfig, EvalConfig

DATA = {
    "hellaswag": {"validation": "hellaswag/validation.jsonl", "train": "hellaswag/train.jsonl"},
    "mmlu_high_school_chemistry": {
        "test": "mmlu_high_school_chemistry/test.jsonl",
        "dev": "mmlu_high_school_chemistry/dev.jsonl",
    },
    "medqa_4options": {
        "test": "medqa_4options/test.jsonl",
        "validation": "medqa_4options/validation.jsonl",
        "train": "medqa_4options/train.jsonl",
    },
    "gsm8k": {"test": "gsm8k/test.jsonl", "train": "gsm8k/train.jsonl"},
    "wikitext": {
        "test": "wikitext/test.jsonl",
        "validation": "wikitext/validation.jsonl",
        "train": "wikitext/validation.jsonl",
    },
}
TASKS = list(DATA)
MAX_GEN = 16


def _files(task: str) -> dict[str, str]:
    return {split: str(SHIPPED / "data" / rel) for split, rel in DATA[task].items()}


def bench(tasks: list[str] = TASKS, **over) -> BenchmarkConfig:
    """The shipped data of ``tasks`` as their benchmark.data overrides."""
    cfg = OmegaConf.structured(
        BenchmarkConfig(
            name="t",
            tasks=list(tasks),
            n_items=24,
            data={t: {s: f"shipped:data/{r}" for s, r in DATA[t].items()} for t in tasks},
        )
    )
    return OmegaConf.merge(cfg, over)


def eval_cfg(**over):
    return OmegaConf.merge(
        OmegaConf.structured(EvalConfig(dtype="float32", gen_kwargs={"max_gen_toks": MAX_GEN})), over
    )


def lm_eval_cli(model_dir, cache, where, dtype: str = "float32", tasks: list[str] = TASKS) -> dict:
    """The lm_eval command line (batch size 1) on a model over the shipped files: results and per-sample outputs
    per task. ``where``: an empty directory for its include path and output."""
    from mergeval.eval.task_index import task_manager

    registry = task_manager(None, include_defaults=True, cache=cache)
    inc, out = where / "include", where / "cli"
    inc.mkdir()
    for task in tasks:
        cfg = {
            "include": str(registry.task_index[task].yaml_path),
            "task": task,
            "tag": None,
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": _files(task)},
        }
        (inc / f"{task}.yaml").write_text(json.dumps(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},dtype={dtype}",
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(inc),
        "--batch_size",
        "1",
        "--device",
        "cpu",
        "--output_path",
        str(out),
        "--log_samples",
        "--gen_kwargs",
        f"max_gen_toks={MAX_GEN}",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for task in tasks:
        path = next(out.rglob(f"samples_{task}_*.jsonl"))
        samples[task] = {row["doc_id"]: row for row in map(json.loads, path.read_text().splitlines())}
    return {"results": results["results"], "samples": samples}


@pytest.fixture(scope="module")
def cli(tiny_dir, cache, tmp_path_factory) -> dict:
    """The lm_eval command line on the tiny model in float32."""
    return lm_eval_cli(tiny_dir, cache, tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def ours(tiny_dir, cache) -> dict:
    """mergeval's harness (shared-prefix scorer, batches of 8) on the same model and files."""
    from transformers import AutoTokenizer

    from mergeval.eval.harness import Harness
    from mergeval.eval.suite import build_suite
    from mergeval.models.checkpoint import load_model

    suite = build_suite(bench(), eval_cfg(), cache)
    harness = Harness(suite, suite.entries, batch_size=8, limit=None)
    model = load_model(tiny_dir, None, torch.float32)
    scores = harness.score(model, AutoTokenizer.from_pretrained(tiny_dir))
    instances = {t: task.instances for t, task in harness.task_dict["tasks"].items()}
    return {"suite": suite, "scores": scores, "instances": instances}


def test_every_output_type_is_loaded(ours):
    types = {r.output_type for r in ours["suite"].rows.values()}
    assert types == {"multiple_choice", "generate_until", "loglikelihood_rolling"}


@pytest.mark.parametrize("task", TASKS)
def test_every_metric_equals_the_command_line(cli, ours, task):
    mine = ours["scores"][task].metrics
    theirs = {k: v for k, v in cli["results"][task].items() if "," in k and "_stderr" not in k}
    assert set(mine) == set(theirs)
    for key, value in theirs.items():
        assert mine[key][0] == pytest.approx(value, rel=1e-5, abs=1e-9), key


@pytest.mark.parametrize("task", ["hellaswag", "mmlu_high_school_chemistry", "medqa_4options"])
def test_multiple_choice_loglikelihoods_equal_the_command_line(cli, ours, task):
    """Same prompts (the task's own process_docs and templates), log-likelihoods within 1e-4, same argmax."""
    by_doc: dict[int, dict[int, float]] = {}
    for inst in ours["instances"][task]:
        by_doc.setdefault(inst.doc_id, {})[inst.idx] = inst.resps[0][0]
        assert list(inst.args) == list(cli["samples"][task][inst.doc_id]["arguments"][f"gen_args_{inst.idx}"].values())
    worst = 0.0
    for doc_id, lls in by_doc.items():
        theirs = [float(r[0][0]) for r in cli["samples"][task][doc_id]["resps"]]
        mine = [lls[i] for i in sorted(lls)]
        worst = max(worst, max(abs(a - b) for a, b in zip(mine, theirs)))
        assert mine.index(max(mine)) == theirs.index(max(theirs))
    print(f"\n{task}: largest log-likelihood difference from the command line {worst:.2e}")
    assert worst < 1e-4, f"largest log-likelihood difference {worst:.2e}"


def test_generation_in_batches_gives_the_command_lines_greedy_text(cli, ours):
    """gsm8k: our batches of 8 against the command line's batches of 1, the same generated text per item."""
    for inst in ours["instances"]["gsm8k"]:
        assert inst.resps[0] == cli["samples"]["gsm8k"][inst.doc_id]["resps"][0][0]


def test_rolling_loglikelihood_equals_the_command_line(cli, ours):
    for inst in ours["instances"]["wikitext"]:
        theirs = float(cli["samples"]["wikitext"][inst.doc_id]["resps"][0][0])
        assert inst.resps[0] == pytest.approx(theirs, abs=1e-3)


def test_the_shipped_chembench_suite_runs_offline_on_its_schema(tiny_dir, cache):
    """chembench_nc (mergeval/eval/shipped/suites) over authored items in ChemBench4K's record schema: the gold
    letter maps to its choice and acc is the share of items whose best letter is the gold one."""
    from transformers import AutoTokenizer

    from mergeval.eval.harness import Harness
    from mergeval.eval.suite import build_suite
    from mergeval.models.checkpoint import load_model

    files = {"test": "shipped:data/chembench_nc/test.jsonl", "dev": "shipped:data/chembench_nc/dev.jsonl"}
    cfg = OmegaConf.structured(
        BenchmarkConfig(
            name="c", tasks=["chembench_nc"], include_path=["shipped:suites/chembench"], data={"chembench_nc": files}
        )
    )
    suite = build_suite(cfg, eval_cfg(), cache)
    assert suite.task("chembench_nc").get_config("num_fewshot") == 5
    harness = Harness(suite, suite.entries, batch_size=8, limit=None)
    score = harness.score(load_model(tiny_dir, None, torch.float32), AutoTokenizer.from_pretrained(tiny_dir))
    rows = harness.samples["chembench_nc"]
    golds = [json.loads(line)["answer"] for line in (SHIPPED / "data/chembench_nc/test.jsonl").read_text().splitlines()]
    assert [r["gold"] for r in rows] == ["ABCD".index(g) for g in golds]
    right = sum(r["lls"].index(max(r["lls"])) == r["gold"] for r in rows)
    assert score["chembench_nc"].value == pytest.approx(right / len(rows))


def test_smollm2_batched_generation_gives_the_command_lines_greedy_text(cache, tmp_path):
    """The same check on a real model (SmolLM2-135M-Instruct, float32), whose answers differ item to item:
    gsm8k's 5-shot prompts, 3 items of up to 24 new tokens, our batch of 3 against the command line's batches
    of 1."""
    from transformers import AutoTokenizer

    from mergeval.eval.harness import Harness
    from mergeval.eval.suite import build_suite
    from mergeval.eval.task_index import task_manager
    from mergeval.models.checkpoint import load_model
    from mergeval.models.smollm2 import smollm2_dir

    model_dir, limit = smollm2_dir(cache, "test"), 3
    cfg = {
        "include": str(task_manager(None, True, cache).task_index["gsm8k"].yaml_path),
        "task": "gsm8k",
        "tag": None,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": _files("gsm8k")},
    }
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "gsm8k.yaml").write_text(json.dumps(cfg))
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
            "gsm8k",
            "--include_path",
            str(tmp_path / "inc"),
            "--batch_size",
            "1",
            "--device",
            "cpu",
            "--limit",
            str(limit),
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
            "--gen_kwargs",
            "max_gen_toks=24",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = {
        row["doc_id"]: row["resps"][0][0]
        for row in map(json.loads, next((tmp_path / "out").rglob("samples_gsm8k_*.jsonl")).read_text().splitlines())
    }

    suite = build_suite(bench(["gsm8k"]), eval_cfg(gen_kwargs={"max_gen_toks": 24}), cache)
    harness = Harness(suite, suite.entries, batch_size=3, limit=limit)
    harness.score(load_model(model_dir, None, torch.float32), AutoTokenizer.from_pretrained(model_dir))
    ours = {inst.doc_id: inst.resps[0] for inst in harness.task_dict["tasks"]["gsm8k"].instances}
    assert len(ours) == limit and len(set(ours.values())) > 1  # a real model: the answers differ
    assert ours == theirs


def test_a_group_reports_its_aggregate_and_its_members_over_local_data(tiny_dir, cache, tmp_path):
    """A group of two registry tasks (a YAML of the user's, in benchmark.include_path) whose members read the
    shipped files: one counted row for the group, its size-weighted mean of the members' acc, members shown."""
    from transformers import AutoTokenizer

    from mergeval.eval.harness import Harness
    from mergeval.eval.suite import build_suite
    from mergeval.models.checkpoint import load_model

    (tmp_path / "my_group.yaml").write_text(
        json.dumps(
            {
                "group": "my_group",
                "task": ["hellaswag", "mmlu_high_school_chemistry"],
                "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
            }
        )
    )
    cfg = bench(["hellaswag", "mmlu_high_school_chemistry"])
    cfg.tasks, cfg.include_path = ["my_group"], [str(tmp_path)]
    suite = build_suite(cfg, eval_cfg(), cache)
    assert [(r.name, r.kind, r.counted) for r in suite.rows.values()] == [
        ("my_group", "group", True),
        ("hellaswag", "task", False),
        ("mmlu_high_school_chemistry", "task", False),
    ]
    assert suite.rows["my_group"].metric == "acc,none"
    scores = Harness(suite, suite.entries, batch_size=8, limit=None).score(
        load_model(tiny_dir, None, torch.float32), AutoTokenizer.from_pretrained(tiny_dir)
    )
    members = [scores["hellaswag"], scores["mmlu_high_school_chemistry"]]
    want = sum(m.metrics["acc,none"][0] * m.n for m in members) / sum(m.n for m in members)
    assert scores["my_group"].value == pytest.approx(want) and scores["my_group"].n == 16 + 12
    # exported in lm-eval's shape, the group keeps its members: lm-eval's own table nests them under it
    from lm_eval.utils import make_table

    from mergeval.results.lm_eval_export import group_subtasks, lm_eval_results

    rows = {
        n: {
            "metric": r.metric,
            "higher_is_better": r.higher_is_better,
            "output_type": r.output_type,
            "entry": r.entry,
            "counted": r.counted,
        }
        for n, r in suite.rows.items()
    }
    names = list(rows)
    run = {
        "config": {"benchmark": {"limit": None}, "eval": OmegaConf.to_container(OmegaConf.structured(eval_cfg()))},
        "result": {"tasks": names, "rows": rows, "task_digests": {n: suite.digests.get(n) for n in names}},
        "scores": {n: {"base": scores[n].as_dict()} for n in names},
        "created": "now",
        "models": [{"role": "base", "path": str(tiny_dir), "source": "zoo:tiny", "fingerprint": "f"}],
        "run_id": "r",
    }
    members = ["hellaswag", "mmlu_high_school_chemistry"]
    out = lm_eval_results(run, "base", {}, suite)
    assert out["group_subtasks"] == {"my_group": members} and list(out["groups"]) == ["my_group"]
    assert group_subtasks(names, rows) == {"my_group": members}  # from the stored rows alone, without the suite
    table = make_table(out)
    named = [line.split("|")[1].rstrip() for line in table.splitlines()[2:] if line.split("|")[1].strip()]
    assert named == ["my_group", " - hellaswag", " - mmlu_high_school_chemistry"], table


def test_a_registry_tasks_digest_does_not_depend_on_where_things_are_installed(cache, tmp_path):
    """A task's digest is its config and data, not where its YAML, its data files or the cache lie: lm-eval's
    ``metadata.config_source`` (the path of the YAML the task came from) made every registry task with local
    data a new task in another checkout or cache, re-evaluated in full (found running the README in a second
    clone of the same commit)."""
    import shutil

    from mergeval.eval.suite import build_suite

    tasks = ["hellaswag", "gsm8k"]
    here = build_suite(bench(tasks), eval_cfg(), cache)
    moved = tmp_path / "elsewhere"
    for task in tasks:  # the same files at another place (a second checkout's shipped data)
        for rel in DATA[task].values():
            (moved / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(SHIPPED / "data" / rel, moved / rel)
    data = {t: {s: str(moved / r) for s, r in DATA[t].items()} for t in tasks}
    other_cache = tmp_path / "cache"
    shutil.copytree(cache / "lm_eval_index", other_cache / "lm_eval_index")  # the registry's index, not rebuilt
    there = build_suite(OmegaConf.merge(bench(tasks), {"data": data}), eval_cfg(), other_cache)
    assert (
        here.task("hellaswag").dump_config()["metadata"]["config_source"]
        != there.task("hellaswag").dump_config()["metadata"]["config_source"]
    )
    assert here.digests == there.digests


def test_a_data_split_the_task_does_not_read_is_refused(cache):
    """benchmark.data.gsm8k.tset (for test) was written into the override and never read: gsm8k went on
    evaluating its own test file."""
    from mergeval.core.errors import UserError
    from mergeval.eval.suite import build_suite

    cfg = OmegaConf.merge(bench(["gsm8k"]), {"data": {"gsm8k": {"tset": "shipped:data/gsm8k/test.jsonl"}}})
    with pytest.raises(UserError) as err:
        build_suite(cfg, eval_cfg(), cache)
    assert err.value.field == "benchmark.data.gsm8k.tset" and "test, train" in err.value.fix


def test_more_shots_than_the_task_has_examples_is_one_line_before_any_model(cache):
    """benchmark.num_fewshot=5 on the shipped medqa_4options (4 training rows) was lm-eval's sampler's
    ValueError traceback, at the first model's evaluation."""
    from mergeval.core.errors import UserError
    from mergeval.eval.suite import build_suite

    with pytest.raises(UserError) as err:
        build_suite(bench(["medqa_4options"], num_fewshot=5), eval_cfg(), cache)
    assert err.value.field == "benchmark.num_fewshot" and "has 4 few-shot examples, 5 asked" in err.value.problem
    build_suite(bench(["medqa_4options"], fewshot={"medqa_4options": 4}), eval_cfg(), cache)  # all four: fine
    with pytest.raises(UserError) as err:
        build_suite(bench(["medqa_4options"], fewshot={"medqa_4options": 5}), eval_cfg(), cache)
    assert err.value.field == "benchmark.fewshot.medqa_4options"
