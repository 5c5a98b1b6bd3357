"""The default evaluation gives the ``lm_eval`` command line's answers, item by item, in the precision a run
uses: in bfloat16 the default backend is lm-eval's own HFLM (the shared-prefix scorer rounds differently
there), in float32 the shared-prefix scorer (the same answers: tests/eval/test_registry_tasks.py)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from mergeval.core.precision import register_resolver
from mergeval.eval.harness import Harness
from mergeval.eval.suite import build_suite
from mergeval.models.checkpoint import load_model
from mergeval.run.config import EvalConfig
from tests.eval.test_registry_tasks import MAX_GEN, bench, lm_eval_cli

MC = ["hellaswag", "mmlu_high_school_chemistry", "medqa_4options"]


def default_backend(dtype: str) -> str:
    register_resolver()
    return OmegaConf.structured(EvalConfig(dtype=dtype)).backend


def test_the_default_backend_follows_the_precision():
    assert default_backend("float32") == "shared_prefix"
    assert default_backend("bfloat16") == "hflm"
    assert default_backend("float16") == "hflm"


def test_the_default_bfloat16_evaluation_gives_the_command_lines_answers(tiny_dir, cache, tmp_path):
    cli = lm_eval_cli(tiny_dir, cache, tmp_path, dtype="bfloat16", tasks=MC)
    cfg = OmegaConf.merge(OmegaConf.structured(EvalConfig(dtype="bfloat16", gen_kwargs={"max_gen_toks": MAX_GEN})))
    suite = build_suite(bench(MC), cfg, cache)
    harness = Harness(suite, suite.entries, batch_size=1, limit=None, backend=default_backend("bfloat16"))
    model = load_model(tiny_dir, None, torch.bfloat16)
    scores = harness.score(model, AutoTokenizer.from_pretrained(tiny_dir))
    for task in MC:
        theirs = cli["samples"][task]
        for key in scores[task].metrics:  # acc, and acc_norm where the task has it
            items = scores[task].items[key]
            assert items["ids"] == sorted(theirs)
            assert items["values"] == [theirs[i][key.split(",")[0]] for i in items["ids"]], (task, key)
            assert scores[task].metrics[key][0] == pytest.approx(cli["results"][task][key], abs=1e-12)
