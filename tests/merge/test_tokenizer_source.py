"""``tokenizer_source``: experts with different tokenizers merged token by token, against mergekit 0.1.5.

Tiny untied Llamas (embedding and lm_head both aligned) with real Hugging Face tokenizers built offline: the base
a byte-level BPE; expert ``extra`` the base's plus two added tokens and an added special token, with new rows;
expert ``moved`` the base's with its five last merges removed (tokens it lacks), every other id shuffled
(rows permuted to match) and one of ``extra``'s added tokens (a token the base lacks that two experts share: the
mean of their rows stands in for the others). mergekit orders the union's new tokens by set and hash order, so
ids beyond the base's are compared by token: every token's row must be the same bits in both merges, and every
other tensor too (float32 throughout: the stand-in means are one addition and one division in both).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from tests.child import run_module

requires_mergekit = pytest.mark.skipif(
    importlib.util.find_spec("mergekit") is None, reason="mergekit is not installed (pip install '.[test]')"
)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
CORPUS = [
    "the cat sat on the mat",
    "a dog ran to the park",
    "calcium chloride dissolves in water",
    "convert five meters to feet",
    "Question: how many atoms? Answer: three",
] * 20


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _save(path: Path, tensors: dict, tokenizer, config: dict) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(path))
    return path


def _base(root: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tok.save_pretrained(str(root / "base"))
    return root / "base"


def _tuned(base: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.02 * torch.randn(t.shape, generator=gen) for n, t in base.items()}


def _extra(root: Path, base_dir: Path) -> Path:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    tok.add_tokens(["<tool>", "zzq"])
    tok.add_tokens([AddedToken("<|im_start|>", special=True)], special_tokens=True)
    tensors, gen = _tuned(_tensors(base_dir), 1), torch.Generator().manual_seed(11)
    for name in VOCAB:
        t = tensors[name]
        tensors[name] = torch.cat([t, torch.randn(len(tok) - t.shape[0], t.shape[1], generator=gen)])
    config = json.loads((base_dir / "config.json").read_text())
    return _save(root / "extra", tensors, tok, {**config, "vocab_size": len(tok)})


def _moved(root: Path, base_dir: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    doc = json.loads((base_dir / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    dropped = set(sorted(vocab, key=vocab.get)[-5:])
    doc["model"]["merges"] = [
        m
        for m in doc["model"]["merges"]
        if "".join(m if isinstance(m, list) else m.split(" ")) not in dropped
        and not set(m if isinstance(m, list) else m.split(" ")) & dropped
    ]
    kept = [t for t in sorted(vocab, key=vocab.get) if t not in dropped]
    order = [kept[0]] + kept[1:][::2] + kept[1:][1::2]  # <|endoftext|> stays 0; the others shuffled
    doc["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    (root / "moved.json").write_text(json.dumps(doc))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(root / "moved.json"),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    tok.add_tokens(["<tool>"])
    tensors, gen = _tuned(_tensors(base_dir), 2), torch.Generator().manual_seed(12)
    for name in VOCAB:
        t = tensors[name]
        tensors[name] = torch.cat([t[[vocab[s] for s in order]], torch.randn(1, t.shape[1], generator=gen)])
    config = json.loads((base_dir / "config.json").read_text())
    return _save(root / "moved", tensors, tok, {**config, "vocab_size": len(tok)})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    base = _base(root)
    return {"base": base, "extra": _extra(root, base), "moved": _moved(root, base)}


def _doc(models: dict, source, method: str = "task_arithmetic") -> dict:
    params = {"ties": {"density": 0.5, "weight": 1.0}}.get(method, {"weight": 1.0})
    return {
        "merge_method": method,
        "base_model": str(models["base"]),
        "dtype": "float32",
        "models": [{"model": str(models[k]), "parameters": params} for k in ("extra", "moved")],
        "parameters": {"normalize": True} if method == "ties" else {},
        "tokenizer_source": source,
    }


def _mergekit(doc: dict, out: Path) -> Path:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(
        MergeConfiguration.model_validate(doc),
        str(out),
        MergeOptions(device="cpu", lazy_unpickle=False, write_model_card=False, quiet=True),
    )
    return out


def _mergeval(doc: dict, out: Path) -> Path:
    from omegaconf import OmegaConf

    from mergeval.merge import merge_to_disk
    from mergeval.methods import get_method
    from mergeval.run.mergekit_config import from_mergekit, tokenizer_choice

    method_cfg, modelset, _ = from_mergekit(doc)
    method = get_method(method_cfg["name"])
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(method.config), method_cfg))
    experts = {name: Path(e["source"]) for name, e in modelset["experts"].items()}
    return merge_to_disk(
        method, cfg, Path(modelset["base"]), experts, out, tokenizer_source=tokenizer_choice(doc, modelset)
    )


def assert_same_merge(ours: Path, theirs: Path) -> None:
    """The same vocabulary (the base's ids kept), every token's rows the same bits, every other tensor too."""
    from transformers import AutoTokenizer

    mine, their = (AutoTokenizer.from_pretrained(str(p)).get_vocab() for p in (ours, theirs))
    assert set(mine) == set(their)
    rows = [(mine[t], their[t]) for t in their]
    a, b = _tensors(ours), _tensors(theirs)
    assert set(a) == set(b)
    for name in a:
        if name in VOCAB:
            assert a[name].shape == b[name].shape == (len(their), a[name].shape[1])
            assert torch.equal(a[name][[i for i, _ in rows]], b[name][[j for _, j in rows]]), name
        else:
            assert torch.equal(a[name], b[name]), name
    assert json.loads((ours / "config.json").read_text())["vocab_size"] == len(their)


@requires_mergekit
@pytest.mark.parametrize(
    "source,method",
    [
        ("union", "task_arithmetic"),
        ("union", "ties"),
        ("base", "task_arithmetic"),
        ("extra", "task_arithmetic"),
        ("moved", "task_arithmetic"),
    ],
)
def test_the_same_vocabulary_and_tensors_as_mergekit(models, source, method, tmp_path):
    doc = _doc(models, str(models[source]) if source in models else source, method)
    theirs = _mergekit(doc, tmp_path / "mk")
    ours = _mergeval(doc, tmp_path / "ours")
    assert_same_merge(ours, theirs)


def test_the_union_keeps_the_base_ids_and_fills_tokens_as_mergekit_does(models, tmp_path):
    from transformers import AutoTokenizer

    out = _mergeval(_doc(models, "union"), tmp_path / "ours")
    vocab = AutoTokenizer.from_pretrained(str(out)).get_vocab()
    base_vocab = AutoTokenizer.from_pretrained(str(models["base"])).get_vocab()
    assert {t: vocab[t] for t in base_vocab} == base_vocab
    assert {"<tool>", "zzq", "<|im_start|>"} <= set(vocab) and len(vocab) == len(base_vocab) + 3
    merged, base = _tensors(out), _tensors(models["base"])
    extra, moved = _tensors(models["extra"]), _tensors(models["moved"])
    ev = AutoTokenizer.from_pretrained(str(models["extra"])).get_vocab()
    mv = AutoTokenizer.from_pretrained(str(models["moved"])).get_vocab()
    e = "model.embed_tokens.weight"
    # <tool>: in both experts, not the base: the mean of theirs stands in for the base's row
    mean = (extra[e][ev["<tool>"]] + moved[e][mv["<tool>"]]) / 2
    want = mean + (extra[e][ev["<tool>"]] - mean) + (moved[e][mv["<tool>"]] - mean)
    torch.testing.assert_close(merged[e][vocab["<tool>"]], want, rtol=0, atol=1e-6)
    # zzq: in extra alone: its row for every model, so the merge is that row
    assert torch.equal(merged[e][vocab["zzq"]], extra[e][ev["zzq"]])
    # a token moved lacks: the base's row stands in (a zero task vector)
    lacking = next(t for t in base_vocab if t not in mv)
    b = base[e][base_vocab[lacking]]
    torch.testing.assert_close(merged[e][vocab[lacking]], b + (extra[e][ev[lacking]] - b), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "patch,field,says",
    [
        ({"tokenizer_source": "/no/such/model"}, "mergekit.tokenizer_source", "no such model directory"),
        (
            {"tokenizer_source": None, "tokenizer": {"source": "union", "pad_to_multiple_of": 8}},
            "mergekit.tokenizer",
            "pad_to_multiple_of",
        ),
        ({"base_model": None, "merge_method": "linear"}, "mergekit.tokenizer_source", "base_model"),
    ],
)
def test_what_cannot_be_built_is_refused_by_key(models, patch, field, says):
    from mergeval.run.mergekit_config import from_mergekit

    doc = {**_doc(models, "union"), **patch}
    with pytest.raises(UserError) as err:
        from_mergekit({k: v for k, v in doc.items() if v is not None})
    assert err.value.field == field and says in str(err.value), err.value


def test_tokenizer_source_with_a_vocab_policy_or_an_unknown_name_is_one_line(models, tmp_path):
    from mergeval.merge.tokens import check_tokenizer_source

    with pytest.raises(UserError, match="drop one"):
        check_tokenizer_source("union", ["extra"], "truncate")
    with pytest.raises(UserError, match="use one of: base, union, extra"):
        check_tokenizer_source("other", ["extra"])


@requires_mergekit
def test_merge_only_from_a_mergekit_file_writes_a_model_transformers_loads(models, tmp_path):
    """``python -m mergeval.merge mergekit=FILE`` with tokenizer_source: union: mergekit's merge, a tokenizer and
    config that transformers loads and runs, and the exported mergekit.yaml keeps the tokenizer source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    doc = _doc(models, "union")
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(doc))
    out = run_module(
        "mergeval.merge",
        f"mergekit={tmp_path / 'merge.yaml'}",
        f"output={tmp_path / 'out'}",
        "+experiment=tiny",
        f"cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert_same_merge(tmp_path / "out", _mergekit(doc, tmp_path / "mk"))
    assert yaml.safe_load((tmp_path / "out" / "mergekit.yaml").read_text())["tokenizer_source"] == "union"
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    ids = tok("<tool> the cat zzq", return_tensors="pt").input_ids
    assert ids.max() >= 300 and model(ids).logits.shape[-1] == len(tok)
    shutil.rmtree(tmp_path / "mk")


def test_a_run_evaluates_the_merge_with_its_tokenizer_and_each_expert_with_its_own(models, tmp_path):
    """``python -m mergeval`` with tokenizer_source=union: the merge is written to merged_model with the union
    tokenizer and evaluated with it; each expert is evaluated with its own tokenizer (its identity says so)."""
    from transformers import AutoTokenizer

    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    overrides = [
        "+experiment=tiny",
        "benchmark.n_items=8",
        "eval.dtype=float32",
        f"modelset.base={models['base']}",
        "tokenizer_source=union",
        f"store.path={tmp_path / 's.sqlite'}",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    for role, model in (("chem", "extra"), ("units", "moved")):
        overrides += [f"modelset.experts.{role}.source={models[model]}", f"modelset.experts.{role}.domain=null"]
    outcome = app.run(compose_run_config(overrides), tmp_path / "run")
    assert [m.evaluated for m in outcome.models] == ["this run"] * 4
    merged = Path(outcome.models[-1].path)
    assert (
        len(AutoTokenizer.from_pretrained(str(merged)))
        == json.loads((merged / "config.json").read_text())["vocab_size"]
        == 303
    )
    assert len({m.fingerprint for m in outcome.models}) == 4
    with pytest.raises(UserError, match="tokenizer_source"):
        app.run(compose_run_config([*overrides, "metric.similarity=true"]), tmp_path / "run2")
