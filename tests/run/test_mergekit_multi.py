"""mergekit-multi files (mergekit=FILE with several configurations) run as stages by python -m mergeval.merge.

A three-stage file over the tiny Llama checkpoints of test_mergekit_config, each stage a method whose
single-stage parity with mergekit is bit for bit (test_mergekit_parity): mergekit-multi and mergeval give
the same final tensors, atol=0. The stages' cache: a rerun reuses every intermediate merge (not rewritten),
a changed input misses; the file's mistakes are one line naming the field.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from mergeval.run import mergekit_multi
from tests.child import run_module
from tests.methods.test_mergekit_parity import requires_mergekit
from tests.run.test_mergekit_config import models  # noqa: F401  (the fixture)


def three_stages(m: dict[str, Path]) -> list[dict]:
    b, x, y, z = (str(m[k]) for k in ("base", "math", "code", "chat"))
    return [
        {
            "name": "pair",
            "merge_method": "multislerp",
            "base_model": b,
            "dtype": "float32",
            "models": [{"model": x, "parameters": {"weight": 1.0}}, {"model": y, "parameters": {"weight": 0.4}}],
        },
        {"name": "mean", "merge_method": "karcher", "dtype": "float32", "models": [{"model": z}, {"model": "pair"}]},
        {
            "merge_method": "nuslerp",
            "base_model": b,
            "dtype": "float32",
            "models": [
                {"model": "mean", "parameters": {"weight": 0.7}},
                {"model": "pair", "parameters": {"weight": 0.3}},
            ],
        },
    ]


def write(path: Path, docs: list[dict]) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def tensors(out: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        merged.update(load_file(str(shard)))
    return merged


def merge(file: Path, out: Path, cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    done = run_module("mergeval.merge", f"mergekit={file}", f"output={out}", f"cache_dir={cache}", cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def stage_lines(done: subprocess.CompletedProcess) -> list[tuple[str, str]]:
    """(stage, merging or reused) for each stage the command reports, in order."""
    return [
        (line.split("'")[1], line.split(": ", 1)[1].split(" ")[0])
        for line in done.stdout.splitlines()
        if line.startswith("mergekit stage '")
    ]


@requires_mergekit
def test_three_stages_give_mergekit_multis_tensors_and_are_reused_from_the_cache(models, tmp_path):  # noqa: F811
    file = write(tmp_path / "multi.yaml", three_stages(models))
    theirs = tmp_path / "mergekit-out"
    done = subprocess.run(
        [
            "mergekit-multi",
            str(file),
            "--out-path",
            str(theirs),
            "-I",
            str(tmp_path / "mk-stages"),
            "--no-copy-tokenizer",
            "--no-lazy-unpickle",
            "--no-write-model-card",
            "--quiet",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    cache = tmp_path / "cache"
    first = merge(file, tmp_path / "ours", cache, tmp_path)
    assert stage_lines(first) == [("pair", "merging"), ("mean", "merging")], first.stdout
    ours = tensors(tmp_path / "ours")
    reference = tensors(theirs)
    assert sorted(ours) == sorted(reference)
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")

    stages = sorted((cache / mergekit_multi.STAGES_DIR).iterdir())
    stages = [p for p in stages if not p.name.startswith(".")]
    assert len(stages) == 2
    written = {p: (p / "model.safetensors").stat().st_mtime_ns for p in stages}
    again = merge(file, tmp_path / "again", cache, tmp_path)  # the same file: both stages reused, not merged
    assert stage_lines(again) == [("pair", "reused"), ("mean", "reused")], again.stdout
    assert {p: (p / "model.safetensors").stat().st_mtime_ns for p in stages} == written
    assert tensors(tmp_path / "again").keys() == ours.keys()
    assert all(torch.equal(t, ours[n]) for n, t in tensors(tmp_path / "again").items())

    # another file that shares the first stage under another name, over a changed third model: 'pair' is
    # reused, the stage over the changed model ('mean') is merged anew
    chat = tmp_path / "chat2"
    shutil.copytree(models["chat"], chat)
    changed = {k: v * 1.01 for k, v in load_file(str(chat / "model.safetensors")).items()}
    save_file(changed, str(chat / "model.safetensors"), metadata={"format": "pt"})
    docs = three_stages({**models, "chat": chat})
    docs[0]["name"] = "two"
    docs[1]["models"][1]["model"] = "two"
    docs[2]["models"][1]["model"] = "two"
    other = merge(write(tmp_path / "other.yaml", docs), tmp_path / "other", cache, tmp_path)
    assert stage_lines(other) == [("two", "reused"), ("mean", "merging")], other.stdout


def test_the_final_merge_names_the_stages_it_uses(models, tmp_path):  # noqa: F811
    """The stages' directories replace their names; those the final does not use are not merged."""
    docs = three_stages(models)
    named, final = mergekit_multi.stages(
        docs + [{"name": "spare", **{k: v for k, v in docs[0].items() if k != "name"}}]
    )
    assert list(named) == ["pair", "mean", "spare"]
    assert mergekit_multi.order(named, final, "mergekit[3]") == ["pair", "mean"]
    out = mergekit_multi.substituted(final, {"mean": "/m", "pair": "/p"}, "mergekit[3]")
    assert [m["model"] for m in out["models"]] == ["/m", "/p"] and out["base_model"] == str(models["base"])
    mergekit_multi.check_all(named, final, "mergekit[3]")


def _error(docs: list[dict]) -> UserError:
    with pytest.raises(UserError) as err:
        named, final = mergekit_multi.stages(docs)
        where = mergekit_multi.final_label(docs)
        mergekit_multi.order(named, final, where)
        mergekit_multi.check_all(named, final, where)
    return err.value


def test_the_files_mistakes_are_named_by_field(models):  # noqa: F811
    docs = three_stages(models)
    cycle = [
        dict(docs[0], models=[{"model": "mean", "parameters": {"weight": 1.0}}, *docs[0]["models"][1:]]),
        *docs[1:],
    ]
    err = _error(cycle)
    assert err.field == "mergekit[pair]" and "pair -> mean -> pair" in err.problem
    self_use = [dict(docs[1], models=[{"model": "mean"}, {"model": str(models["chat"])}]), docs[2]]
    assert "mean -> mean" in _error(self_use).problem
    unknown = [*docs[:2], dict(docs[2], models=[{"model": "maen"}, {"model": "pair"}])]
    err = _error(unknown)
    assert err.field == "mergekit[2].models[0].model" and "mean, pair" in err.fix
    err = _error([docs[0], dict(docs[1], name="pair"), docs[2]])
    assert err.field == "mergekit[1].name" and "named twice" in err.problem
    err = _error([{k: v for k, v in docs[0].items() if k != "name"}, *docs[1:]])
    assert err.field == "mergekit[2].name" and "name: STAGE" in err.fix
    err = _error(docs[:2])
    assert err.field == "mergekit" and "remove name:" in err.fix
    err = _error([docs[0], dict(docs[1], name=""), docs[2]])
    assert err.field == "mergekit[1].name"
    bad = [docs[0], dict(docs[1], merge_method="nope"), docs[2]]  # a later stage's mistake, before any merge
    assert _error(bad).field == "mergekit[mean].merge_method"


def test_a_multi_stage_mistake_ends_the_command_in_one_line(models, tmp_path):  # noqa: F811
    docs = three_stages(models)
    file = write(tmp_path / "bad.yaml", [docs[0], dict(docs[1], name="pair"), docs[2]])
    done = run_module(
        "mergeval.merge",
        f"mergekit={file}",
        f"output={tmp_path / 'out'}",
        f"cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "mergekit[1].name" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_run_builds_the_stages_and_evaluates_the_final_merge(tmp_path, tiny_dir, cache):
    """python -m mergeval mergekit=FILE: the earlier stages are merged into the cache (reused by a second run),
    and the final stage is the run's merge, over the stages' directories, which are evaluated as its experts."""
    import json

    from tests.merge.test_engine import make_expert
    from tests.run.test_cli import mergeval

    a, b, c = (str(make_expert(tiny_dir, tmp_path / f"e{i}", seed=i)) for i in (1, 2, 3))
    docs = [
        {
            "name": "ab",
            "merge_method": "linear",
            "base_model": str(tiny_dir),
            "dtype": "float32",
            "models": [{"model": a, "parameters": {"weight": 0.5}}, {"model": b, "parameters": {"weight": 0.5}}],
        },
        {
            "merge_method": "task_arithmetic",
            "base_model": str(tiny_dir),
            "dtype": "float32",
            "models": [{"model": "ab", "parameters": {"weight": 1.0}}, {"model": c, "parameters": {"weight": 0.5}}],
        },
    ]
    file = write(tmp_path / "multi.yaml", docs)
    store = f"store.path={tmp_path / 'r.sqlite'}"
    out = mergeval(f"mergekit={file}", "benchmark=tiny", "eval.dtype=float32", store, "hydra.run.dir=one", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert stage_lines(out) == [("ab", "merging")], out.stdout
    rows = {m["role"]: m for m in json.loads((tmp_path / "one" / "result.json").read_text())["models"]}
    assert list(rows) == ["base", "ab", "e3", "merged"] and rows["ab"]["evaluated"] == "this run"
    assert Path(rows["ab"]["path"]).parent == cache / mergekit_multi.STAGES_DIR
    again = mergeval(
        f"mergekit={file}", "benchmark=tiny", "eval.dtype=float32", store, "hydra.run.dir=two", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert stage_lines(again) == [("ab", "reused")], again.stdout
