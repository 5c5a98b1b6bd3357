"""Layer slices (frankenmerges, mergeval/merge/slices.py) and passthrough, against mergekit 0.1.5.

Two tiny Llama checkpoints with different layer counts (3 and 4) and untied lm_heads, so that the rule
for the tensors outside the layers (embeddings from the first slice's models, final norm and lm_head
from the last slice's, as mergekit takes them) is seen. Passthrough merges give mergekit's tensors bit
for bit and its config.json layer count; slerp over slices (per-slice depth gradients) within 1e-6, as
slerp itself (test_mergekit_parity.py). The merged model loads with transformers, and a run merges
and evaluates one in memory.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from mergeval.merge import merge_to_disk
from mergeval.merge.slices import parse, sliced_config
from mergeval.methods import get_method
from mergeval.run.mergekit_config import from_mergekit, sliced_to_mergekit
from tests.child import run_module
from tests.methods.test_mergekit_parity import _save, requires_mergekit
from tests.run.test_mergekit_config import close, mergekit_merge

ARCH = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("slices")
    out = {}
    for seed, (name, layers) in enumerate([("a", 3), ("b", 4)]):
        config = LlamaConfig(**ARCH, num_hidden_layers=layers, architectures=["LlamaForCausalLM"])
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            tensors = {k: v.detach().clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
        g = torch.Generator().manual_seed(seed)
        tensors = {
            k: (1 + 0.1 * torch.randn(v.shape, generator=g)) if k.endswith("norm.weight") else v
            for k, v in tensors.items()
        }
        out[name] = _save(root / name, config, tensors)
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict[str, Path]:
    """Qwen3-shaped checkpoints (3 and 4 layers): their config.json lists layer_types, one entry per layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("slices-qwen3")
    out = {}
    for seed, (name, layers) in enumerate([("a", 3), ("b", 4)]):
        config = Qwen3Config(**ARCH, num_hidden_layers=layers, head_dim=8, architectures=["Qwen3ForCausalLM"])
        with torch.random.fork_rng():
            torch.manual_seed(10 + seed)
            tensors = {k: v.detach().clone() for k, v in Qwen3ForCausalLM(config).state_dict().items()}
        out[name] = _save(root / name, config, tensors)
    return out


def doc_of(models, method: str, slices: list[list[tuple[str, int, int]]], **extra) -> dict:
    return {
        "merge_method": method,
        "base_model": str(models["a"]),
        "dtype": "float32",
        "slices": [
            {"sources": [{"model": str(models[m]), "layer_range": [s, e]} for m, s, e in sources]} for sources in slices
        ],
        **extra,
    }


def mergeval_merge(doc: dict, out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """merge_to_disk of the imported configuration: (tensors, config.json)."""
    from omegaconf import OmegaConf

    method_cfg, modelset, _ = from_mergekit(doc)
    method = get_method(method_cfg["name"])
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(method.config), method_cfg))
    experts = {name: Path(e["source"]) for name, e in modelset["experts"].items()}
    slices = parse(modelset["slices"], ["base", *experts])
    merge_to_disk(method, cfg, Path(modelset["base"]), experts, out, slices=slices)
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


def mergekit_dir(doc: dict, root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    out = root / f"mk-{uuid.uuid4().hex}"
    run_merge(
        MergeConfiguration.model_validate(doc),
        str(out),
        MergeOptions(device="cpu", lazy_unpickle=False, copy_tokenizer=False, write_model_card=False, quiet=True),
    )
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


PASSTHROUGH = {
    "two_models": [[("a", 0, 2)], [("b", 1, 3)]],  # A's first two layers, then B's middle two
    "one_model": [[("b", 1, 3)]],  # a shallower model from one range
    "repeated": [[("a", 0, 2)], [("a", 1, 3)], [("b", 3, 4)]],  # layer 1 of A twice (a deeper model)
}


@requires_mergekit
@pytest.mark.parametrize("name", sorted(PASSTHROUGH))
def test_passthrough_gives_mergekits_tensors_bit_for_bit(models, tmp_path, name):
    doc = doc_of(models, "passthrough", PASSTHROUGH[name])
    ours, our_config = mergeval_merge(doc, tmp_path / "ours")
    theirs, their_config = mergekit_dir(doc, tmp_path)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), [
        k for k in theirs if not torch.equal(ours[k], theirs[k])
    ]
    layers = sum(e - s for (_, s, e), *_ in PASSTHROUGH[name])
    assert our_config["num_hidden_layers"] == their_config["num_hidden_layers"] == layers
    last = PASSTHROUGH[name][-1][0][0]  # lm_head and the final norm from the last slice's model
    assert torch.equal(ours["lm_head.weight"], load_file(str(models[last] / "model.safetensors"))["lm_head.weight"])


@requires_mergekit
def test_passthrough_scale_filters_as_mergekit(models, tmp_path):
    doc = doc_of(
        models,
        "passthrough",
        PASSTHROUGH["two_models"],
        parameters={"scale": [{"filter": "o_proj", "value": 0.0}, {"filter": "mlp", "value": 0.5}, {"value": 1.0}]},
    )
    ours, _ = mergeval_merge(doc, tmp_path / "ours")
    theirs, _ = mergekit_dir(doc, tmp_path)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert not ours["model.layers.0.self_attn.o_proj.weight"].any()


@requires_mergekit
def test_slerp_over_slices_as_mergekit_with_per_slice_depths(models, tmp_path):
    """A gradient of t over slices of different lengths, one listing the base's range second: each slice's
    own depths, the base's source as slerp's base."""
    doc = doc_of(
        models,
        "slerp",
        [[("a", 0, 2), ("b", 1, 3)], [("b", 2, 4), ("a", 1, 3)], [("a", 2, 3), ("b", 0, 1)]],
        parameters={"t": [{"filter": "self_attn", "value": [0.1, 0.6, 0.9]}, {"value": 0.3}]},
    )
    ours, config = mergeval_merge(doc, tmp_path / "ours")
    theirs, their_config = mergekit_dir(doc, tmp_path)
    close(ours, theirs)
    assert config["num_hidden_layers"] == their_config["num_hidden_layers"] == 5
    method_cfg, modelset, _ = from_mergekit(doc)  # exported back: mergekit merges it to the same tensors
    method = get_method("slerp")
    exported = sliced_to_mergekit(
        method.config(**method_cfg),
        {"base": modelset["base"], **{n: e["source"] for n, e in modelset["experts"].items()}},
        parse(modelset["slices"], ["base", *modelset["experts"]]),
    )
    close(mergekit_merge(exported, tmp_path), ours)


MERGING = {  # over two slices, the base's range listed second in the second one
    "linear": {"parameters": {"weight": 0.5}, "base_model": None},  # the first source's model is the base
    "task_arithmetic": {"parameters": {"weight": [0.2, 0.8], "lambda": 0.9}},
    "ties": {"parameters": {"weight": 1.0, "density": 0.5}},
}


@requires_mergekit
@pytest.mark.parametrize("method", sorted(MERGING))
def test_methods_over_slices_give_mergekits_tensors(models, tmp_path, method):
    doc = doc_of(models, method, [[("a", 0, 2), ("b", 1, 3)], [("b", 2, 4), ("a", 1, 3)]], **MERGING[method])
    doc = {k: v for k, v in doc.items() if v is not None}
    ours, config = mergeval_merge(doc, tmp_path / "ours")
    theirs, their_config = mergekit_dir(doc, tmp_path)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert config["num_hidden_layers"] == their_config["num_hidden_layers"] == 4


@requires_mergekit
def test_merge_command_imports_slices_writes_the_model_and_exports_it(models, tmp_path):
    from transformers import AutoModelForCausalLM

    doc = doc_of(models, "passthrough", PASSTHROUGH["two_models"])
    path = tmp_path / "franken.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = tmp_path / "merged"
    done = run_module(
        "mergeval.merge",
        f"mergekit={path}",
        f"output={out}",
        f"cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    ours = load_file(str(out / "model.safetensors"))
    theirs, _ = mergekit_dir(doc, tmp_path)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    again, _ = mergekit_dir(yaml.safe_load((out / "mergekit.yaml").read_text()), tmp_path)
    assert all(torch.equal(ours[k], again[k]) for k in again)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(model.model.layers) == 4
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    bad = tmp_path / "bad.yaml"  # a range past the model's layers: one line naming the source, exit 2
    bad.write_text(yaml.safe_dump(doc_of(models, "passthrough", [[("a", 0, 2)], [("b", 2, 6)]])))
    done = run_module(
        "mergeval.merge",
        f"mergekit={bad}",
        f"output={tmp_path / 'no'}",
        f"cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "modelset.slices[1].sources[0].layer_range" in done.stderr and "at most 4" in done.stderr
    assert not (tmp_path / "no").exists()


@requires_mergekit
def test_a_qwen3_frankenmerge_as_mergekit_and_its_layer_types(qwen3, tmp_path):
    """Bit for bit with mergekit where it can write the model (the base's layer count); with another count,
    mergekit 0.1.5 leaves config.json's layer_types at the base's length, which transformers refuses to save
    (it fails), while mergeval rebuilds them and the model loads."""
    from transformers import AutoModelForCausalLM

    same = doc_of(qwen3, "passthrough", [[("a", 0, 2)], [("b", 3, 4)]])
    ours, config = mergeval_merge(same, tmp_path / "same")
    theirs, their_config = mergekit_dir(same, tmp_path)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert config["num_hidden_layers"] == their_config["num_hidden_layers"] == 3
    assert config["layer_types"] == their_config["layer_types"]
    deeper = doc_of(qwen3, "passthrough", [[("a", 0, 2)], [("b", 1, 4)]])
    _, config = mergeval_merge(deeper, tmp_path / "deeper")
    assert config["num_hidden_layers"] == len(config["layer_types"]) == 5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "deeper")
    assert len(model.model.layers) == 5 and torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize(
    "slices,field,words",
    [
        (
            [{"sources": [{"model": "base", "layer_range": [0, 2]}, {"model": "b", "layer_range": [0, 3]}]}],
            "modelset.slices[0].sources",
            "same number of layers",
        ),
        (
            [{"sources": [{"model": "base", "layer_range": [2, 2]}]}],
            "modelset.slices[0].sources[0].layer_range",
            "start < end",
        ),
        ([{"sources": [{"model": "base", "layer_range": [0]}]}], "modelset.slices[0].sources[0].layer_range", "[0, 4]"),
        ([{"sources": [{"model": "c", "layer_range": [0, 1]}]}], "modelset.slices[0].sources[0].model", "base, b"),
        ([{"sources": []}], "modelset.slices[0].sources", "layer_range"),
        (
            [{"sources": [{"model": "b", "layer_range": [0, 1]}, {"model": "b", "layer_range": [1, 2]}]}],
            "modelset.slices[0].sources",
            "exactly one range of the base",
        ),
        (
            [
                {"sources": [{"model": "base", "layer_range": [0, 1]}]},
                {"sources": [{"model": "base", "layer_range": [0, 1]}, {"model": "b", "layer_range": [1, 2]}]},
            ],
            "modelset.slices[1].sources",
            "same number of sources",
        ),
    ],
)
def test_bad_slices_are_one_error_naming_the_field_and_the_fix(slices, field, words):
    with pytest.raises(UserError) as err:
        parse(slices, ["base", "b"])
    assert err.value.field == field and words in err.value.fix, err.value


def test_passthrough_of_several_inputs_is_refused_with_the_fix():
    method = get_method("passthrough")
    with pytest.raises(UserError) as err:
        method.validate(method.config(), 1)
    assert "modelset.slices" in err.value.fix


def test_config_gets_the_layer_count_and_per_layer_lists_from_the_source_layers():
    config = {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "layer_types": ["a0", "a1", "a2", "a3"],
        "architectures": ["Qwen3ForCausalLM"],
    }
    deeper = {**config, "num_hidden_layers": 6, "layer_types": [f"b{i}" for i in range(6)]}
    slices = parse(
        [{"sources": [{"model": "base", "layer_range": [2, 4]}]}, {"sources": [{"model": "b", "layer_range": [3, 6]}]}],
        ["base", "b"],
    )
    out = sliced_config(config, slices, {"base": config, "b": deeper})
    assert out["num_hidden_layers"] == 5 and out["layer_types"] == ["a2", "a3", "b3", "b4", "b5"]
    assert out["architectures"] == ["Qwen3ForCausalLM"] and config["num_hidden_layers"] == 4
    with pytest.raises(UserError) as err:  # a model whose config does not list its layers' entries
        sliced_config(config, slices, {"base": config, "b": {**deeper, "layer_types": ["b0"]}})
    assert err.value.field == "modelset.slices" and "layer_types" in err.value.problem


def test_mergekit_slices_keys_mergeval_cannot_express_are_refused_by_key(models):
    doc = doc_of(models, "passthrough", PASSTHROUGH["two_models"])
    doc["slices"][0]["sources"][0]["parameters"] = {"scale": 0.5}
    with pytest.raises(UserError) as err:
        from_mergekit(doc)
    assert err.value.field == "mergekit.slices[0].sources[0].parameters"
    with pytest.raises(UserError) as err:
        from_mergekit({**doc_of(models, "passthrough", PASSTHROUGH["two_models"]), "models": [{"model": "x"}]})
    assert err.value.field == "mergekit.models"
    with pytest.raises(UserError) as err:
        from_mergekit({"merge_method": "passthrough", "models": [{"model": str(models["a"])}]})
    assert err.value.field == "mergekit.merge_method" and "slices" in err.value.fix


def test_a_run_merges_a_frankenmerge_in_memory_and_evaluates_it(tiny_dir, tmp_path):
    """The tiny experiment with a passthrough of the base's layers and a perturbed copy's: the live model has
    the sliced layer count, is evaluated, and save_merged writes the same model with its config."""
    from mergeval.run import app
    from mergeval.run.lm_eval_import import compose_run_config

    n = json.loads((tiny_dir / "config.json").read_text())["num_hidden_layers"]
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in load_file(str(tiny_dir / "model.safetensors")).items()
        },
        str(other / "model.safetensors"),
        metadata={"format": "pt"},
    )
    slices = (
        f"[{{sources: [{{model: base, layer_range: [0, {n}]}}]}}, "
        f"{{sources: [{{model: chem, layer_range: [{n - 1}, {n}]}}]}}]"
    )
    overrides = [
        "+experiment=tiny",
        "benchmark.n_items=8",
        "eval.dtype=float32",
        f"modelset.base={tiny_dir}",
        f"modelset.experts.chem.source={other}",
        "modelset.experts.chem.domain=null",
        "~modelset.experts.units",
        "method=passthrough",
        f"modelset.slices={slices}",
        "save_merged=true",
        "benchmark.tasks=[mergeval_chem_count]",
        "modelset.experts.chem.calibration=null",
        f"store.path={tmp_path / 's.sqlite'}",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    outcome = app.run(compose_run_config(overrides), tmp_path / "run")
    merged = outcome.models[-1]
    assert merged.evaluated == "this run"
    written = Path(merged.path)
    assert json.loads((written / "config.json").read_text())["num_hidden_layers"] == n + 1
    tensors = load_file(str(next(written.glob("*.safetensors"))))
    top = load_file(str(other / "model.safetensors"))
    assert torch.equal(tensors[f"model.layers.{n}.mlp.up_proj.weight"], top[f"model.layers.{n - 1}.mlp.up_proj.weight"])
