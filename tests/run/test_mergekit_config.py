"""mergekit configurations in (mergekit=PATH) and out (mergekit.yaml), checked against mergekit 0.1.5 itself.

The configurations are shaped like mergekit's documented examples (per-model density and weight
gradients, weight filters, normalize/int8_mask, slerp's filtered t gradients written with models:
instead of slices:) over tiny 5-layer Llama checkpoints, so a gradient takes five distinct depths.
Each is merged by mergekit and by mergeval from the imported configuration (within 1e-6), and the
configuration mergeval exports for its merge is merged again by mergekit (same tensors).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from mergeval.merge import merge_tensors
from mergeval.methods import get_method
from mergeval.run.mergekit_config import from_mergekit, to_mergekit
from tests.child import run_module
from tests.methods.test_mergekit_parity import requires_mergekit

ARCH = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("mkcfg")
    config = LlamaConfig(**ARCH, architectures=["LlamaForCausalLM"])
    with torch.random.fork_rng():
        torch.manual_seed(1)
        base = {
            k: v.detach().clone() for k, v in LlamaForCausalLM(config).state_dict().items() if k != "lm_head.weight"
        }
    g = torch.Generator().manual_seed(1)
    base = {
        k: (1 + 0.1 * torch.randn(v.shape, generator=g)) if k.endswith("norm.weight") else v for k, v in base.items()
    }
    common = {k: torch.randn(v.shape, generator=g) for k, v in base.items()}
    out = {}
    for name, scale in [("base", None), ("math", 1.0), ("code", -0.6), ("chat", 1.3)]:
        tensors = (
            base
            if scale is None
            else {k: v + 0.03 * (scale * common[k] + torch.randn(v.shape, generator=g)) for k, v in base.items()}
        )
        path = root / name
        path.mkdir()
        config.save_pretrained(path)
        save_file(
            {k: t.contiguous() for k, t in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
        )
        out[name] = path
    return out


def mergekit_merge(doc: dict, root: Path) -> dict[str, torch.Tensor]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    out = root / f"mk-{uuid.uuid4().hex}"
    run_merge(
        MergeConfiguration.model_validate(doc),
        str(out),
        MergeOptions(device="cpu", lazy_unpickle=False, copy_tokenizer=False, write_model_card=False, quiet=True),
    )
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    shutil.rmtree(out)
    return tensors


def mergeval_merge(doc: dict) -> tuple[dict[str, torch.Tensor], object, str, list[str]]:
    """(merged tensors, typed method config, base path, expert paths) from the imported configuration."""
    method_cfg, modelset, _ = from_mergekit(doc)
    method = get_method(method_cfg["name"])
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(method.config), method_cfg))
    experts = [e["source"] for e in modelset["experts"].values()]
    method.validate(cfg, len(experts))
    load = lambda p: load_file(str(Path(p) / "model.safetensors"))  # noqa: E731
    merged = merge_tensors(method, cfg, load(modelset["base"]), [load(p) for p in experts], 0, progress=False)
    return merged, cfg, modelset["base"], experts


def close(ours, theirs, atol=1e-6):
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def examples(m: dict[str, Path]) -> dict[str, dict]:
    b, x, y, z = (str(m[k]) for k in ("base", "math", "code", "chat"))
    return {
        "ties": {  # mergekit's README TIES example, on our models
            "models": [
                {"model": x, "parameters": {"density": [1, 0.7, 0.1], "weight": 1.0}},
                {"model": y, "parameters": {"density": 0.5, "weight": [0, 0.3, 0.7, 1]}},
                {
                    "model": z,
                    "parameters": {"density": 0.33, "weight": [{"filter": "mlp", "value": 0.5}, {"value": 0}]},
                },
            ],
            "merge_method": "ties",
            "base_model": b,
            "parameters": {"normalize": True, "int8_mask": True},
            "dtype": "float32",
        },
        "slerp": {
            "models": [{"model": b}, {"model": x}],
            "merge_method": "slerp",
            "base_model": b,
            "parameters": {
                "t": [
                    {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
                    {"value": 0.5},
                ]
            },
            "dtype": "float32",
        },
        "breadcrumbs_ties": {
            "models": [
                {"model": b},
                {"model": x, "parameters": {"weight": 0.7, "density": 0.45}},
                {"model": y, "parameters": {"weight": 0.5, "gamma": 0.02}},
            ],
            "merge_method": "breadcrumbs_ties",
            "base_model": b,
            "parameters": {"density": 0.3, "gamma": 0.05, "lambda": 0.9},
        },
        "task_arithmetic": {
            "models": [
                {"model": x, "parameters": {"weight": [{"filter": "embed", "value": 0.2}, {"value": [0.3, 1.0]}]}},
                {"model": y, "parameters": {"weight": 0.5}},
            ],
            "merge_method": "task_arithmetic",
            "base_model": b,
            "parameters": {"lambda": [0.5, 1.0], "normalize": False},
        },
        "linear": {
            "models": [
                {"model": x, "parameters": {"weight": 1.0}},
                {"model": y, "parameters": {"weight": 0.3}},
                {"model": z, "parameters": {"weight": [0.2, 0.9]}},
            ],
            "merge_method": "linear",
        },
        "model_stock": {
            "models": [{"model": b}, {"model": x}, {"model": y}, {"model": z}],
            "merge_method": "model_stock",
            "base_model": b,
        },
        "sce": {
            "models": [{"model": x}, {"model": y}, {"model": z}],
            "merge_method": "sce",
            "base_model": b,
            "parameters": {"select_topk": 0.35},
        },
        "nuslerp": {
            "models": [{"model": x, "parameters": {"weight": 1.0}}, {"model": y, "parameters": {"weight": [0.2, 0.8]}}],
            "merge_method": "nuslerp",
            "base_model": b,
            "parameters": {"nuslerp_flatten": False},
        },
        "nuslerp-no-base": {
            "models": [{"model": b, "parameters": {"weight": 0.4}}, {"model": x, "parameters": {"weight": 0.9}}],
            "merge_method": "nuslerp",
            "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": True},
        },
        "multislerp": {
            "models": [
                {"model": x, "parameters": {"weight": 1.0}},
                {"model": y, "parameters": {"weight": 0.5}},
                {"model": z, "parameters": {"weight": [{"filter": "mlp", "value": 2.0}, {"value": 1.0}]}},
            ],
            "merge_method": "multislerp",
            "base_model": b,
        },
        "multislerp-no-base": {
            "models": [
                {"model": b, "parameters": {"weight": 0.5}},
                {"model": x, "parameters": {"weight": 0.3}},
                {"model": z, "parameters": {"weight": 0.4}},
            ],
            "merge_method": "multislerp",
            "parameters": {"normalize_weights": False, "eps": 1e-6},
        },
        "karcher": {
            "models": [{"model": x}, {"model": y}, {"model": z}],
            "merge_method": "karcher",
            "base_model": b,
            "parameters": {"max_iter": 20, "tol": 1e-6},
        },
        "karcher-no-base": {"models": [{"model": x}, {"model": z}], "merge_method": "karcher"},
        "ram": {
            "models": [{"model": x}, {"model": y}, {"model": z}],
            "merge_method": "ram",
            "base_model": b,
            "parameters": {"epsilon": [{"filter": "mlp", "value": 0.03}, {"value": [0.0, 0.05]}]},
        },
        "ramplus_tl": {
            "models": [{"model": x}, {"model": y}],
            "merge_method": "ramplus_tl",
            "base_model": b,
            "parameters": {
                "r": [0.1, 0.6],
                "alpha": [{"filter": "self_attn", "value": 2.0}, {"value": 0.5}],
                "epsilon": 0.04,
            },
        },
        "arcee_fusion": {"models": [{"model": b}, {"model": y}], "merge_method": "arcee_fusion", "base_model": b},
    }


@requires_mergekit
@pytest.mark.parametrize(
    "name",
    [
        "ties",
        "slerp",
        "breadcrumbs_ties",
        "task_arithmetic",
        "linear",
        "model_stock",
        "sce",
        "nuslerp",
        "nuslerp-no-base",
        "multislerp",
        "multislerp-no-base",
        "karcher",
        "karcher-no-base",
        "ram",
        "ramplus_tl",
        "arcee_fusion",
    ],
)
def test_imported_config_gives_mergekits_tensors_and_exports_it_back(models, tmp_path, name):
    doc = examples(models)[name]
    theirs = mergekit_merge(doc, tmp_path)
    ours, cfg, base, experts = mergeval_merge(doc)
    atol = 0 if get_method(cfg.name).mergekit.own else 1e-6  # mergekit's own methods: the same bits
    close(ours, theirs, atol)
    exported = to_mergekit(cfg, base, experts)
    assert exported is not None
    close(mergekit_merge(yaml.safe_load(yaml.safe_dump(exported)), tmp_path), ours, atol)
    again, *_ = mergeval_merge(exported)  # the export imports back to the same merge
    close(again, ours, atol=0)


def test_per_model_gradients_and_filters_become_expert_rules_in_mergekits_precedence(models):
    """Per-model settings are rules with expert: i after the global ones; filters reversed (first match wins)."""
    _, cfg, *_ = mergeval_merge(examples(models)["ties"])
    rules = [{k: v for k, v in vars(r).items() if v is not None} for r in cfg.rules]
    assert rules == [
        {"match": "*", "expert": 0, "density": [1, 0.7, 0.1]},
        {"match": "*", "expert": 0, "weight": 1.0},
        {"match": "*", "expert": 1, "density": 0.5},
        {"match": "*", "expert": 1, "weight": [0, 0.3, 0.7, 1]},
        {"match": "*", "expert": 2, "density": 0.33},
        {"match": "*", "expert": 2, "weight": 0},
        {"match": "*mlp*", "expert": 2, "weight": 0.5},
    ]
    assert cfg.compat == "mergekit" and cfg.normalize is True


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"slices": [{"sources": []}]}, "mergekit.models"),  # slices or models, not both
        ({"modules": {"text": {}}}, "mergekit.modules"),
        ({"merge_method": "passthrough"}, "mergekit.merge_method"),
        ({"merge_method": "model_breadcrumbs"}, "mergekit.merge_method"),
        ({"tokenizer_source": "org/not-in-the-file"}, "mergekit.tokenizer_source"),
        ({"tokenizer": {"source": "union", "tokens": {"<x>": {"source": "base"}}}}, "mergekit.tokenizer"),
        ({"chat_template": "chatml"}, "mergekit.chat_template"),
        ({"models": [{"model": "org/m+org/lora", "parameters": {"weight": 1}}]}, "mergekit.models[0].model"),
        (
            {"models": [{"model": "MATH", "parameters": {"weight": 1, "lambda": 2}}]},
            "mergekit.models[0].parameters.lambda",
        ),
        ({"models": [{"model": "MATH"}]}, "mergekit.models[0].parameters.weight"),
        ({"parameters": {"epsilon": 0.1}}, "mergekit.parameters.epsilon"),
        ({"parameters": {"normalize": [{"filter": "mlp", "value": True}]}}, "mergekit.parameters.normalize"),
        ({"base_model": None}, "mergekit.base_model"),
        ({"base_model": "./no/such/base"}, "mergekit.base_model"),  # a mistyped path is not a hub id to download
        ({"models": [{"model": "/no/such/dir", "parameters": {"weight": 1}}]}, "mergekit.models[0].model"),
        (
            {"models": [{"model": "MATH", "parameters": {"weight": 1, "densty": 0.5}}]},
            "mergekit.models[0].parameters.densty",
        ),
        ({"parameters": {"lamda": 0.5}}, "mergekit.parameters.lamda"),
        ({"dtype": "float31"}, "mergekit.dtype"),  # refused before the note about dtype was printed
        # a parameter ram shares across models: mergekit 0.1.5 silently ignores it under a model
        (
            {"merge_method": "ram", "models": [{"model": "MATH", "parameters": {"epsilon": 0.1}}]},
            "mergekit.models[0].parameters.epsilon",
        ),
    ],
)
def test_what_mergeval_cannot_express_is_refused_by_key(models, patch, field):
    doc = {
        "merge_method": "ties",
        "base_model": str(models["base"]),
        "models": [{"model": str(models["math"]), "parameters": {"weight": 1, "density": 0.5}}],
    }
    for key, value in patch.items():
        doc[key] = yaml.safe_load(yaml.safe_dump(value).replace("MATH", str(models["math"])))
    with pytest.raises(UserError) as err:
        from_mergekit(doc)
    assert err.value.field == field
    if field.endswith(("densty", "lamda")):  # a typo gets the name it missed (it was told to move the key)
        assert err.value.fix == f"did you mean {'density' if 'densty' in field else 'lambda'}?", err.value
    if "no/such" in str(patch):
        assert err.value.problem.startswith("no such model directory"), err.value


def test_paper_mode_merges_are_not_exported(models):
    method = get_method("ties")
    assert to_mergekit(method.config(density=0.5), "b", ["e"]) is None  # ceil counts: mergekit cannot
    assert (
        to_mergekit(
            method.config(density=0.5, compat="mergekit", rules=[{"match": "model.*", "density": 0.3}]), "b", ["e"]
        )
        is None
    )  # a glob mergekit's substring filters cannot say
    assert to_mergekit(method.config(density=0.5, compat="mergekit"), "b", ["e"])["parameters"]["density"] == 0.5


@requires_mergekit
def test_merge_command_runs_a_mergekit_file_and_writes_mergekit_yaml(models, tmp_path):
    doc = examples(models)["ties"]
    path = tmp_path / "ties.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = tmp_path / "merged"
    args = [f"mergekit={path}", f"output={out}", f"cache_dir={tmp_path / 'cache'}"]
    done = run_module("mergeval.merge", *args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    ours = {}
    for shard in sorted(out.glob("*.safetensors")):
        ours.update(load_file(str(shard)))
    close(ours, mergekit_merge(doc, tmp_path))
    close(mergekit_merge(yaml.safe_load((out / "mergekit.yaml").read_text()), tmp_path), ours)
    bad = tmp_path / "slices.yaml"  # a slice source without its layer range (tests/merge/test_slices.py: the rest)
    bad.write_text(yaml.safe_dump({**doc, "models": None, "slices": [{"sources": [{"model": "a"}]}]}))
    done = run_module("mergeval.merge", f"mergekit={bad}", f"output={tmp_path / 'no'}", cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "mergekit.slices" in done.stderr


@requires_mergekit
def test_out_dtype_is_the_dtype_the_merge_is_written_in_as_in_mergekit(models, tmp_path):
    """mergekit writes in out_dtype (else dtype): so does mergeval, config.json says so, and the exported
    mergekit.yaml carries it; the tensors are the float32 merge rounded once."""
    doc = {**examples(models)["ties"], "out_dtype": "bfloat16"}
    path = tmp_path / "ties.yaml"
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
    assert done.returncode == 0, done.stderr
    ours = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    config = json.loads((out / "config.json").read_text())
    named = [config[k] for k in ("dtype", "torch_dtype") if k in config]
    assert named and set(named) == {"bfloat16"}, config
    full, *_ = mergeval_merge(examples(models)["ties"])
    assert all(torch.equal(ours[k], full[k].to(torch.bfloat16)) for k in full)
    exported = yaml.safe_load((out / "mergekit.yaml").read_text())
    assert exported["out_dtype"] == "bfloat16"
    theirs = mergekit_merge(exported, tmp_path)
    assert {t.dtype for t in theirs.values()} == {torch.bfloat16}
    for k in full:  # mergekit rounds its float32 result once too: at most one bfloat16 step apart
        step = torch.finfo(torch.bfloat16).eps * full[k].abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
        assert ((theirs[k].float() - ours[k].float()).abs() <= step).all(), k


@pytest.mark.parametrize(
    "key,value,fix",
    [
        ("modules", {"text": {"slices": []}}, "merge whole models with models:"),
        ("chat_template", "chatml", "drop chat_template:"),
    ],
)
def test_each_unsupported_key_gets_a_fix_that_fits_it(key, value, fix):
    with pytest.raises(UserError) as err:
        from_mergekit({"merge_method": "linear", key: value, "models": [{"model": "a", "parameters": {"weight": 1}}]})
    assert err.value.field == f"mergekit.{key}" and err.value.fix.startswith(fix), err.value


def test_a_global_value_that_every_model_overrides_is_not_exported():
    method = get_method("ties")
    every = to_mergekit(
        method.config(density=0.5, compat="mergekit", per_expert=[{"density": 0.3}, {"density": 0.7}]),
        "b",
        ["e1", "e2"],
    )
    assert "density" not in every["parameters"]
    assert [m["parameters"]["density"] for m in every["models"]] == [0.3, 0.7]
    some = to_mergekit(
        method.config(density=0.5, compat="mergekit", per_expert=[{"density": 0.3}, None]), "b", ["e1", "e2"]
    )
    assert some["parameters"]["density"] == 0.5  # the second model reads it


def test_where_the_spherical_methods_take_the_base_from():
    """nuslerp and multislerp without base_model: the first model is the base, merged as a model (its weight
    first); karcher averages base_model too (put last, as mergekit adds it), else the last model is the base."""
    two = [{"model": "org/a", "parameters": {"weight": 0.3}}, {"model": "org/b", "parameters": {"weight": 0.7}}]
    cfg, modelset, notes = from_mergekit({"merge_method": "nuslerp", "models": two})
    assert cfg["include_base"] and modelset["base"] == "hf:org/a" and list(modelset["experts"]) == ["b"]
    assert [r["weight"] for r in cfg["rules"]] == [0.3, 0.7] and not notes
    cfg, modelset, _ = from_mergekit({"merge_method": "multislerp", "models": two, "base_model": "org/base"})
    assert "include_base" not in cfg and modelset["base"] == "hf:org/base" and list(modelset["experts"]) == ["a", "b"]
    cfg, modelset, notes = from_mergekit(
        {"merge_method": "karcher", "models": ["org/a", "org/b", "org/c"], "parameters": {"max_iter": 30, "tol": 1e-6}}
    )
    assert cfg["include_base"] and cfg["max_iter"] == 30 and isinstance(cfg["max_iter"], int)
    assert modelset["base"] == "hf:org/c" and list(modelset["experts"]) == ["a", "b"] and not notes
    _, modelset, notes = from_mergekit({"merge_method": "karcher", "models": ["org/a", "org/b"], "base_model": "org/a"})
    assert modelset["base"] == "hf:org/a" and list(modelset["experts"]) == ["b"]
    assert len(notes) == 1 and "float32 rounding" in notes[0]  # mergekit averages it first: other roundings
    with pytest.raises(UserError) as err:
        from_mergekit({"merge_method": "karcher", "models": ["org/a", "org/b"], "parameters": {"max_iter": 2.5}})
    assert err.value.field == "mergekit.parameters.max_iter"


def test_the_spherical_methods_export_their_base_as_mergekit_reads_it():
    nuslerp, karcher = get_method("nuslerp"), get_method("karcher")
    as_model = to_mergekit(nuslerp.config(include_base=True, weights=[0.4, 0.6]), "B", ["e"])
    assert "base_model" not in as_model
    assert as_model["models"] == [
        {"model": "B", "parameters": {"weight": 0.4}},
        {"model": "e", "parameters": {"weight": 0.6}},
    ]
    assert to_mergekit(nuslerp.config(), "B", ["e1", "e2"])["base_model"] == "B"
    averaged = to_mergekit(karcher.config(include_base=True), "B", ["e1", "e2"])
    assert averaged["base_model"] == "B" and [m["model"] for m in averaged["models"]] == ["e1", "e2"]
    assert "base_model" not in to_mergekit(karcher.config(), "B", ["e1", "e2"])
