"""The run config past the command line: ``run.config.typed`` gives the schema's dataclasses, with the same content
as the composed config, so everything keyed by a config (result.json's config, the resume hash, a search's study
name) is the same whichever form computed it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from mergeval.core.plain import plain_dict
from mergeval.methods import METHODS
from mergeval.run.config import RunConfig, register_configs, typed

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def composed(*overrides: str, config: str = "config"):
    from mergeval.search.schema import register_search_configs

    register_configs()
    register_search_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        return compose(config, overrides=list(overrides))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_the_typed_config_holds_what_was_composed(experiment):
    cfg = composed(f"+experiment={experiment}", "eval.device=cpu")
    run = typed(cfg)
    assert isinstance(run, RunConfig) and typed(run) is run
    assert isinstance(run.method, METHODS[cfg.method.name].config)  # the method as its own config class
    assert dataclasses.is_dataclass(run.modelset) and dataclasses.is_dataclass(run.eval)
    assert plain_dict(run) == plain_dict(cfg, resolve=True)


def test_the_paper_presets_type_as_their_methods():
    for preset, name in [
        ("medical_hier/dare_ties", "dare_ties"),
        ("cmm_chem/reverse", "cmm"),
        ("mergebench/soup", "task_arithmetic"),
    ]:
        run = typed(composed("+experiment=tiny", f"method={preset}"))
        assert run.method.name == name and isinstance(run.method, METHODS[name].config)


def test_the_resume_hash_is_the_same_for_both_forms():
    from mergeval.run.resume import config_hash

    cfg = composed("+experiment=tiny", "method=ties", "method.density=0.3")
    assert config_hash(typed(cfg)) == config_hash(cfg)
    assert config_hash(typed(composed("+experiment=tiny", "method=ties", "method.density=0.4"))) != config_hash(cfg)


def test_a_search_names_its_study_the_same_from_either_form():
    from mergeval.search import study

    cfg = composed("+experiment=tiny", config="search_run")
    assert study.study_name(typed(cfg), "space", {"a": 1}) == study.study_name(cfg, "space", {"a": 1})


def test_the_typed_config_is_checked_by_attribute_not_by_key():
    """A field the schema does not have fails on the typed config as it would on the composed one."""
    run = typed(composed("+experiment=tiny"))
    with pytest.raises(AttributeError):
        run.tokenizer_sourec  # noqa: B018
    assert OmegaConf.is_config(composed("+experiment=tiny")) and not OmegaConf.is_config(run)
