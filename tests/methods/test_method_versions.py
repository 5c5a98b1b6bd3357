"""A stored merge must never outlive the code that made it: each method's output on fixed inputs is recorded
with its implementation version (``MergeMethod.version``, part of ``store.merge_key``), and a change of the
output without a new version fails here.

The inputs: the tiny test model plus one 1024 x 512 tensor (large enough for the engine's row blocks and the
compiled kernels, ``methods/fused.py``), and seeded experts. The record holds float64 sums of each merge's
task vector (merged - base), which the same code reproduces on every CPU family to far better than the
tolerance, while a changed selection, weighting or order of any noticeable share of the entries moves them
beyond it (a change to a few tiny entries can pass unseen: this guards, it does not prove).

After a deliberate change of a method's output: raise its ``version`` where it is registered, then record
(``python -m tests.methods.test_method_versions``) and commit ``tests/methods/method_outputs.json``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mergeval.methods import METHODS
from mergeval.methods.pipeline import StageConfig

RECORD = Path(__file__).with_name("method_outputs.json")
# The same code gave bit-identical sums with torch's AVX-512, AVX2 and scalar kernels (ATEN_CPU_CAPABILITY),
# numba compiled for a generic CPU and MKL's SSE4.2 / AVX2 / compatible paths; the tolerances leave room for
# platforms not tried (another BLAS's solve in regmean) and still see a changed entry of about 1e-4.
RTOL, ATOL = 1e-6, 1e-4
BIG = "guard.block.weight"  # the extra tensor's name: the row-block path merges it

# Methods whose defaults cannot merge three experts with nothing else: (experts, config fields).
CASES = {
    "cmm": (3, {"validation_scores": [0.3, 0.1, 0.2]}),
    "hierarchical": (2, {}),
    "slerp": (1, {}),
    "nearswap": (1, {"t": 0.01}),
    "nuslerp": (2, {"weights": [1.0, 0.6]}),
    "multislerp": (3, {"weights": [1.0, 0.5, 2.0]}),
    "ram": (3, {"epsilon": 0.015}),  # the experts change every entry by more than the default 1e-5: a mean
    "ramplus_tl": (3, {"epsilon": 0.015, "r": 0.5, "alpha": 4.0}),
    "arcee_fusion": (1, {}),
    "passthrough": (0, {"scale": 0.5}),
    "localize_stitch": (3, {"scope": "tensor"}),
    "pipeline": (
        3,
        {
            "stages": [
                StageConfig("pair", {"name": "ties", "density": 0.5}, inputs=["e0", "e1"]),
                StageConfig("all", {"name": "task_arithmetic", "lambda_": 0.8}, inputs=["pair", "e2"]),
            ],
            "expert_names": ["e0", "e1", "e2"],
        },
    ),
    "localize_stitch_trained": (3, {"thresholds": [0.01, 0.01, 0.01]}),
}
STATISTICS = {"fisher": "fisher", "regmean": "gram", "localize_stitch_trained": "localize"}  # synthetic, below


def _normal(seed: int, shape) -> torch.Tensor:
    """Seeded normal values that every CPU and library version draws alike (NumPy's frozen RandomState;
    torch.randn's values depend on the CPU's vector kernels, and so do the tiny model's own weights)."""
    return torch.from_numpy(np.random.RandomState(seed).standard_normal(shape).astype(np.float32))


def _model(src: Path, dst: Path, seed: int | None, scale: float, big: bool = True) -> Path:
    """``src``'s files with every tensor drawn anew and the large tensor added (seed None: the base), for an
    expert the base plus seeded noise. ``big=False``: no extra tensor (a model transformers loads)."""
    shutil.copytree(src, dst)
    shapes = {n: tuple(t.shape) for n, t in load_file(str(dst / "model.safetensors")).items()}
    shapes |= {BIG: (1024, 512)} if big else {}
    tensors = {n: _normal(1000 + i, shape) for i, (n, shape) in enumerate(sorted(shapes.items()))}
    if seed is not None:
        tensors = {n: t + scale * _normal(seed * 100 + i, t.shape) for i, (n, t) in enumerate(sorted(tensors.items()))}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _statistics(kind: str, expert: Path, dst: Path, seed: int) -> str:
    """A statistics directory as mergeval.merge.expert_statistics writes it, with seeded values of the right shapes."""
    stats = {}
    for i, (name, t) in enumerate(sorted(load_file(str(expert / "model.safetensors")).items())):
        if kind == "gram":
            if t.dim() == 2 and "proj" in name:
                x = _normal(seed * 100 + i, (2 * t.shape[1], t.shape[1])).double()
                stats[name] = (x.T @ x / len(x)).float()
        elif kind == "fisher":
            stats[name] = _normal(seed * 100 + i, t.shape).abs() + 0.01
        else:
            stats[name] = _normal(seed * 100 + i, t.shape) * 1e-3
    dst.mkdir(parents=True)
    save_file(stats, str(dst / "stats.safetensors"), metadata={"format": "pt"})
    (dst / "meta.json").write_text(json.dumps({"kind": kind}))
    return str(dst)


def inputs(tiny: Path, root: Path) -> tuple[Path, list[Path]]:
    base = _model(tiny, root / "base", None, 0.0)
    return base, [_model(base, root / f"e{i}", seed=i + 1, scale=0.01 * (i + 1)) for i in range(3)]


def guarded() -> dict[str, tuple[str, dict]]:
    """Record key -> (method, config fields beyond CASES'): every method, and where it has them its mergekit
    semantics (``compat=mergekit``: other code, methods/compat.py)."""
    out = {}
    for name, method in sorted(METHODS.items()):
        out[name] = (name, {})
        if "compat" in {f.name for f in dataclasses.fields(method.config)}:
            out[f"{name} compat=mergekit"] = (name, {"compat": "mergekit"})
    return out


def output_sums(name: str, extra: dict, base: Path, experts: list[Path], root: Path) -> list[float]:
    """[sum, sum of |.|, sum against fixed signs] of the method's task vector over every tensor, in float64."""
    from mergeval.merge import merge_to_disk

    method = METHODS[name]
    n, params = CASES.get(name, (3, {}))
    params = {**params, **extra}
    chosen = experts[:n]
    if name in STATISTICS:
        params = {
            **params,
            "statistics": [
                _statistics(STATISTICS[name], e, root / f"stats-{name}-{i}", seed=50 + i) for i, e in enumerate(chosen)
            ],
        }
    if name == "hierarchical":  # head counts: filled from the base's config.json by a run
        config = json.loads((base / "config.json").read_text())
        params = {
            **params,
            "num_attention_heads": config["num_attention_heads"],
            "num_key_value_heads": config["num_key_value_heads"],
        }
    cfg = method.config(**params)
    method.validate(cfg, n)
    out = merge_to_disk(method, cfg, base, chosen, root / f"out-{name}-{len(extra)}", seed=7)
    merged, before = load_file(str(out / "model.safetensors")), load_file(str(base / "model.safetensors"))
    sums = [0.0, 0.0, 0.0]
    for tensor_name in sorted(merged):
        d = merged[tensor_name].double() - before[tensor_name].double()
        signs = torch.randint(0, 2, d.shape, generator=torch.Generator().manual_seed(3)).double() * 2 - 1
        sums = [sums[0] + float(d.sum()), sums[1] + float(d.abs().sum()), sums[2] + float((d * signs).sum())]
    return sums


@pytest.fixture(scope="module")
def guard_inputs(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("method-versions")
    return (*inputs(tiny_dir, root), root)


def test_every_method_is_recorded():
    recorded = json.loads(RECORD.read_text())
    assert sorted(recorded) == sorted(guarded()), "record the new method: python -m tests.methods.test_method_versions"


@pytest.mark.parametrize("key", sorted(guarded()))
def test_a_changed_output_comes_with_a_new_implementation_version(key, guard_inputs):
    base, experts, root = guard_inputs
    recorded = json.loads(RECORD.read_text()).get(key)
    if recorded is None:
        pytest.fail(f"{key} is not recorded: python -m tests.methods.test_method_versions")
    name, extra = guarded()[key]
    version = METHODS[name].version
    assert recorded["version"] == version, (
        f"{name} is at implementation version {version}, recorded at {recorded['version']}: record its output "
        "again (python -m tests.methods.test_method_versions) and commit tests/methods/method_outputs.json"
    )
    got = output_sums(name, extra, base, experts, root)
    assert got == pytest.approx(recorded["sums"], rel=RTOL, abs=ATOL), (
        f"{key}: the output changed (task-vector sums {got} against {recorded['sums']}) while its implementation "
        f"version stayed {version}: raise it where the method is registered, so merges stored by the old code "
        "are not reused for the new, then record (python -m tests.methods.test_method_versions)"
    )


def record(cache: Path) -> None:
    """Write tests/methods/method_outputs.json from this checkout's methods."""
    import tempfile

    from mergeval.models.zoo.tiny import zoo_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, experts = inputs(zoo_dir("tiny", cache), root)
        out = {
            key: {"version": METHODS[name].version, "sums": output_sums(name, extra, base, experts, root)}
            for key, (name, extra) in guarded().items()
        }
    RECORD.write_text(json.dumps(out, indent=1) + "\n")
    print(f"recorded {len(out)} methods in {RECORD}")


if __name__ == "__main__":
    from mergeval.core.paths import cache_root

    record(cache_root(sys.argv[1] if len(sys.argv) > 1 else None))
