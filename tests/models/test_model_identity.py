"""A model's identity as evaluated (models/fingerprint.py): the weights and every file that can change its outputs.

The results store keys scores and merges by it, so two checkpoints with the same weights but another config,
generation config or tokenizer never share a score; files that cannot change an output (README, .gitattributes,
a licence, a model card's pictures, mergeval's own notes) leave it as it is.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from mergeval.models.fingerprint import TOKENIZER_FILES, fingerprint, fingerprint_state_dict, is_inert, model_identity


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value, indent=2))


# Every way a file of a checkpoint can change what a model computes or how its prompts are tokenized.
SCORING_CHANGES = {
    "config: activation": lambda d: _edit_json(d / "config.json", hidden_act="relu"),
    "config: norm epsilon": lambda d: _edit_json(d / "config.json", rms_norm_eps=1e-2),
    "config: rope scaling": lambda d: _edit_json(d / "config.json", rope_scaling={"type": "linear", "factor": 2.0}),
    "generation config": lambda d: _edit_json(d / "generation_config.json", repetition_penalty=1.3),
    "tokenizer: normalizer": lambda d: _edit_json(d / "tokenizer.json", normalizer={"type": "Lowercase"}),
    "tokenizer: chat template": lambda d: _edit_json(d / "tokenizer_config.json", chat_template="{{ messages }}"),
    "tokenizer: special tokens": lambda d: (d / "special_tokens_map.json").write_text('{"bos_token": "<s>"}'),
    "tokenizer: chat template file": lambda d: (d / "chat_template.jinja").write_text("{{ messages }}"),
    "custom code": lambda d: (d / "modeling_custom.py").write_text("X = 1\n"),
    "config that does not parse": lambda d: (d / "config.json").write_text("{not json"),
}
# ... and files or changes that cannot.
INERT_CHANGES = {
    "README": lambda d: (d / "README.md").write_text("# a model card\n"),
    ".gitattributes": lambda d: (d / ".gitattributes").write_text("*.safetensors filter=lfs\n"),
    "licence": lambda d: (d / "LICENSE").write_text("Apache-2.0\n"),
    "a picture": lambda d: (d / "results.png").write_bytes(b"\x89PNG"),
    "mergeval's training notes": lambda d: (d / "mergeval-expert.json").write_text('{"last_loss": 0.1}'),
    "another transformers version": lambda d: _edit_json(d / "config.json", transformers_version="9.9.9"),
    "another name_or_path": lambda d: _edit_json(d / "config.json", _name_or_path="/somewhere/else"),
    "JSON whitespace": lambda d: (d / "config.json").write_text(
        json.dumps(json.loads((d / "config.json").read_text()), indent=7)
    ),
    "a shard index": lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {}}'),
    "a subfolder": lambda d: ((d / "original").mkdir(), (d / "original" / "params.json").write_text("{}")),
}


@pytest.mark.parametrize("name", sorted(SCORING_CHANGES))
def test_every_file_that_can_change_scores_changes_the_identity(name, tiny_dir, tmp_path):
    weights = fingerprint(tiny_dir)
    copy = _copy(tiny_dir, tmp_path / "copy")
    assert model_identity(weights, copy) == model_identity(weights, tiny_dir)  # a copy is the same model
    SCORING_CHANGES[name](copy)
    assert fingerprint(copy) == weights  # the tensors did not change ...
    assert model_identity(weights, copy) != model_identity(weights, tiny_dir)  # ... the model did


@pytest.mark.parametrize("name", sorted(INERT_CHANGES))
def test_a_file_that_cannot_change_scores_keeps_the_identity(name, tiny_dir, tmp_path):
    weights = fingerprint(tiny_dir)
    copy = _copy(tiny_dir, tmp_path / "copy")
    INERT_CHANGES[name](copy)
    assert model_identity(weights, copy) == model_identity(weights, tiny_dir)


def test_every_file_of_a_checkpoint_is_either_covered_or_inert(tiny_dir):
    """No file of the tiny checkpoint escapes: the weights are the fingerprint's, the rest the identity's."""
    for path in tiny_dir.iterdir():
        covered = path.suffix == ".safetensors" or path.name in TOKENIZER_FILES or path.name.endswith(".json")
        assert covered and not is_inert(path.name), path.name


def test_the_identity_follows_the_tokenizer_the_evaluation_uses(tiny_dir, tmp_path):
    """A run evaluates every model with the base's tokenizer: an expert's own tokenizer files do not change its
    identity there, the base's do."""
    weights = fingerprint(tiny_dir)
    base, expert = _copy(tiny_dir, tmp_path / "base"), _copy(tiny_dir, tmp_path / "expert")
    before = model_identity(weights, expert, base)
    _edit_json(expert / "tokenizer.json", normalizer={"type": "Lowercase"})
    assert model_identity(weights, expert, base) == before
    _edit_json(base / "tokenizer.json", normalizer={"type": "Lowercase"})
    assert model_identity(weights, expert, base) != before


def test_the_weights_differ_by_dtype_even_with_equal_bytes():
    t = torch.arange(8, dtype=torch.int16)
    assert fingerprint_state_dict({"w": t}) != fingerprint_state_dict({"w": t.view(torch.bfloat16)})
    assert fingerprint_state_dict({"w": t}) != fingerprint_state_dict({"w": t.view(torch.float16)})


def test_the_identity_is_the_documented_formula(tiny_dir):
    from blake3 import blake3

    weights = fingerprint(tiny_dir)
    h = blake3()
    h.update(f"identity-1|weights|{weights}|".encode())
    for label, names in (
        ("model", ["config.json", "generation_config.json"]),
        ("tokenizer", ["tokenizer.json", "tokenizer_config.json"]),
    ):
        for name in names:
            value = {
                k: v
                for k, v in json.loads((tiny_dir / name).read_text()).items()
                if k not in ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")
            }
            data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
            h.update(f"{label}|{name}|{len(data)}|".encode())
            h.update(data)
    assert model_identity(weights, tiny_dir) == h.hexdigest(length=16)


# the results store, end to end


def _settings(tmp_path: Path, base: Path, experts: dict[str, Path], *extra: str) -> list[str]:
    return [
        "+experiment=tiny",
        "benchmark.n_items=8",
        "eval.dtype=float32",
        f"modelset.base={base}",
        *[
            o
            for name, path in experts.items()
            for o in (f"modelset.experts.{name}.source={path}", f"modelset.experts.{name}.domain=null")
        ],
        f"store.path={tmp_path / 'store.sqlite'}",
        *extra,
    ]


def test_copies_with_another_config_never_share_scores(tmp_path, cache):
    """The review's case: copies of the base and experts with the same tensors but another activation and norm
    epsilon were served the originals' scores, and ``eval.force`` on the copies overwrote the originals'."""
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    built = app.run(
        compose_run_config(
            [
                "+experiment=tiny",
                "benchmark.n_items=8",
                "modelset.train.steps=1",
                "eval.dtype=float32",
                f"store.path={tmp_path / 'zoo.sqlite'}",
            ]
        ),
        tmp_path / "zoo",
    )
    paths = {m.role: Path(m.path) for m in built.models if m.path}
    originals = {role: _copy(path, tmp_path / "a" / role) for role, path in paths.items()}
    changed = {role: _copy(path, tmp_path / "b" / role) for role, path in paths.items()}
    for path in changed.values():
        _edit_json(path / "config.json", hidden_act="relu", rms_norm_eps=0.5)

    def run(models: dict[str, Path], name: str, *extra: str):
        experts = {r: p for r, p in models.items() if r != "base"}
        return app.run(compose_run_config(_settings(tmp_path, models["base"], experts, *extra)), tmp_path / name)

    first = run(originals, "first")
    assert [m.evaluated for m in first.models] == ["this run"] * 4
    other = run(changed, "other")
    assert [m.evaluated for m in other.models] == ["this run"] * 4  # nothing of the originals is served
    assert other.models[-1].merge == "this run"  # nor their merge
    assert {m.weights for m in other.models} == {m.weights for m in first.models}  # the same tensors
    assert other.scores != first.scores  # which score differently with this config
    run(changed, "forced", "eval.force=true")
    again = run(originals, "again")
    assert [m.evaluated for m in again.models] == ["reused from the results store"] * 4
    assert again.scores == first.scores  # force on the copies replaced only their rows

    for path in originals.values():
        (path / "README.md").write_text("# card\n")
        (path / ".gitattributes").write_text("* text=auto\n")
    inert = run(originals, "inert")
    assert [m.evaluated for m in inert.models] == ["reused from the results store"] * 4
    for path in originals.values():  # the review's lowercasing tokenizer (a run refuses experts whose differs)
        _edit_json(path / "tokenizer.json", normalizer={"type": "Lowercase"})
    retokenized = run(originals, "retokenized")
    assert [m.evaluated for m in retokenized.models] == ["this run"] * 4


def test_a_v5_store_is_migrated_without_serving_its_scores_and_says_so_once(tmp_path, capsys):
    from mergeval.results.backends.schema import _CURRENT, _NEW_IN_V2, _NEW_IN_V5, SCHEMA_VERSION
    from mergeval.results.store import Store

    path = tmp_path / "v5.sqlite"
    with sqlite3.connect(path) as db:
        for statement in _CURRENT + _NEW_IN_V2 + _NEW_IN_V5:
            db.execute(statement)
        db.execute("INSERT INTO meta VALUES ('schema_version', '5')")
        db.execute(
            "INSERT INTO evaluations VALUES ('w', 'd', 's', 't', '{}', '{\"acc,none\": [0.4, 0.1]}', 10, 1.0, NULL)"
        )
        db.execute("INSERT INTO merges VALUES ('k', '[]', '{}', 0, '{}', 'w2', 1.0)")
    store = Store(path)
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "1 stored evaluations and 1 merges stay for the record but are not reused" in said
    assert store.schema_version() == SCHEMA_VERSION
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0] == 1  # kept for the record
    Store(path)
    assert capsys.readouterr().out == ""  # once
