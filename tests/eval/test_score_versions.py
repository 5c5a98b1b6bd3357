"""Stored scores and calibration statistics must never outlive the code that made them, as merges
(tests/methods/test_method_versions.py): the shared-prefix scorer's log-likelihoods and the Fisher, Gram and
Localize-and-Stitch statistics of a fixed model on fixed items are recorded with their implementation
versions (``eval.settings.SHARED_PREFIX_VERSION``, part of every stored score's key;
``calibration.STATS_VERSION``, part of every statistics directory's), and a changed output without a new
version fails here.

The model is the tiny test model's architecture with weights every CPU draws alike; it runs in float32, whose
matrix products differ between CPU kernels in the last bits, hence the tolerances (measured below), far below
what a changed token boundary, masking or reduction moves.

After a deliberate change: raise the version, then record (``python -m tests.eval.test_score_versions``) and commit
``tests/eval/score_outputs.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mergeval.eval.settings import SHARED_PREFIX_VERSION
from mergeval.merge.expert_statistics import STATS_VERSION
from tests.methods.test_method_versions import _model

RECORD = Path(__file__).with_name("score_outputs.json")
# Against the AVX-512 record, torch's AVX2 and scalar kernels and MKL's SSE4.2 and compatible paths moved the
# scorer's sums by at most 1.5e-7 and the statistics' by 5.5e-6 (relative); log-softmax in bfloat16 instead of
# float32 moves the scorer's by about 1e-3, and a token more or less in a choice by about 1e-2.
RTOL, ATOL = 1e-4, 1e-3
PAIRS = [  # varied context lengths, multi-token and one-token choices, an empty context
    ("Question: How many O atoms are in one molecule of Ca10Cl4O5?\nAnswer:", [" 10 atoms", " 7 atoms", " 5"]),
    ("Question: Convert 3 kg to g.\nAnswer: ", ["3000 g", "30 g"]),
    ("Q:", [" A", " B", " C", " D"]),
    ("", [" Question", " Answer"]),
]


def models(tiny: Path, root: Path) -> tuple[Path, Path]:
    base = _model(tiny, root / "base", None, 0.0, big=False)
    return base, _model(base, root / "expert", seed=5, scale=0.05, big=False)


def scorer_sums(base: Path) -> list[float]:
    """[sum of log-likelihoods, sum of greedy flags] of the shared-prefix scorer over PAIRS' choices."""
    import torch
    from lm_eval.api.instance import Instance
    from transformers import AutoTokenizer

    from mergeval.eval.scorer import SharedPrefixLM
    from mergeval.models.checkpoint import load_model

    lm = SharedPrefixLM(
        pretrained=load_model(base, None, torch.float32), tokenizer=AutoTokenizer.from_pretrained(base), batch_size=2
    )
    reqs = [
        Instance("loglikelihood", {}, (ctx, cont), j, ("t", d, 1))
        for d, (ctx, conts) in enumerate(PAIRS)
        for j, cont in enumerate(conts)
    ]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    return [float(sum(ll for ll, _ in got)), float(sum(greedy for _, greedy in got))]


def statistics_sums(kind: str, base: Path, expert: Path) -> list[float]:
    """[sum, sum of |.|] over every tensor of one statistic of the expert on 4 generated calibration items."""
    from mergeval.merge.expert_statistics import calibration_items, compute

    items = calibration_items(SimpleNamespace(task="chem_count", split="train", n=4), "x", 200)
    point = {"base_dir": str(base), "cut": 0.05, "sigmoid_bias": 3.0} if kind == "localize" else None
    stats = compute(kind, expert, items, point)[0]
    return [
        float(sum(t.double().sum() for t in stats.values())),
        float(sum(t.double().abs().sum() for t in stats.values())),
    ]


def outputs(base: Path, expert: Path) -> dict:
    out = {"shared_prefix": {"version": SHARED_PREFIX_VERSION, "sums": scorer_sums(base)}}
    for kind in sorted(STATS_VERSION):
        out[f"statistics {kind}"] = {"version": STATS_VERSION[kind], "sums": statistics_sums(kind, base, expert)}
    return out


@pytest.fixture(scope="module")
def recorded_and_now(tiny_dir, tmp_path_factory):
    return json.loads(RECORD.read_text()), outputs(*models(tiny_dir, tmp_path_factory.mktemp("score-versions")))


@pytest.mark.parametrize("key", ["shared_prefix", *(f"statistics {k}" for k in sorted(STATS_VERSION))])
def test_a_changed_score_or_statistic_comes_with_a_new_version(key, recorded_and_now):
    recorded, now = recorded_and_now
    assert key in recorded, f"{key} is not recorded: python -m tests.eval.test_score_versions"
    old, new = recorded[key], now[key]
    where = "SHARED_PREFIX_VERSION (eval/settings.py)" if key == "shared_prefix" else "STATS_VERSION (calibration.py)"
    assert old["version"] == new["version"], (
        f"{key} is at version {new['version']}, recorded at {old['version']}: "
        "record again (python -m tests.eval.test_score_versions)"
    )
    assert new["sums"] == pytest.approx(old["sums"], rel=RTOL, abs=ATOL), (
        f"{key}: the output changed ({new['sums']} against {old['sums']}) while its version stayed "
        f"{new['version']}: raise {where}, so what was stored by the old code is not reused, then record "
        "(python -m tests.eval.test_score_versions)"
    )


if __name__ == "__main__":
    import tempfile

    from mergeval.core.paths import cache_root
    from mergeval.models.zoo.tiny import zoo_dir

    with tempfile.TemporaryDirectory() as tmp:
        given = [a for a in sys.argv[1:] if not a.startswith("--")]
        result = outputs(*models(zoo_dir("tiny", cache_root(given[0] if given else None)), Path(tmp)))
    if "--print" in sys.argv:
        print(json.dumps(result))
    else:
        RECORD.write_text(json.dumps(result, indent=1) + "\n")
        print(f"recorded {len(result)} outputs in {RECORD}")
