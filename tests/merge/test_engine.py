"""The merge engine: streaming vs in-memory, sharding, atomicity, determinism, bad input, vocab policies,
per-tensor rules, layer-at-a-time methods, the merge CLI and the memory bound."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from mergeval.core.errors import UserError
from mergeval.merge import execute, merge_into_model, merge_tensors, merge_to_disk
from mergeval.merge.plan import build_plan, count_layers, depth, interpolate, layer_of, resolve
from mergeval.merge.reader import CheckpointReader, MemorySource
from mergeval.merge.vocab import vocab_rows
from mergeval.merge.writer import ShardWriter
from mergeval.methods import METHODS, MergeMethod, fused, get_method
from mergeval.models.checkpoint import load_model, load_tensors
from tests.child import run_module

SETTINGS = settings(max_examples=60, deadline=None)
ROOT = Path(__file__).resolve().parents[2]


def make_expert(tiny_dir: Path, dst: Path, seed: int, scale: float = 0.01, change=None) -> Path:
    """A copy of the tiny model with seeded noise on every float tensor (and an optional edit)."""
    shutil.copytree(tiny_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.is_floating_point():
            tensors[name] = t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
    if change:
        change(tensors, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def experts(tiny_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("experts")
    return [make_expert(tiny_dir, root / f"e{i}", seed=i + 1) for i in range(2)]


def read_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(model_dir, "out")
    return {n: reader.get(n) for n in reader.names()}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def method_and_cfg(name: str, **params):
    method = get_method(name)
    return method, method.config(**params)


# ---------------------------------------------------------------- streaming == in memory


@pytest.mark.parametrize(
    "name,params",
    [("ties", {"density": 0.4}), ("dare_ties", {"density": 0.5}), ("task_arithmetic", {"lambda_": 0.7}), ("della", {})],
)
def test_streaming_output_equals_the_in_memory_merge_bit_for_bit(name, params, tiny_dir, experts, tmp_path):
    method, cfg = method_and_cfg(name, **params)
    out = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "out", seed=5)
    in_memory = merge_tensors(method, cfg, load_tensors(tiny_dir), [load_tensors(p) for p in experts], seed=5)
    assert_same_tensors(read_dir(out), in_memory)


def test_the_engine_and_the_methods_load_without_omegaconf(tmp_path):
    """A merge called from Python (merge_throughput.py's child too) does not pay omegaconf's 0.1 s import: only
    a pipeline stage's method is typed through it (methods/pipeline.py)."""
    program = "import sys, mergeval.merge, mergeval.methods; print(sorted(m for m in sys.modules if 'omegaconf' in m))"
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


LOADED_WHERE = """
import sys, threading
from pathlib import Path
from mergeval.merge import execute, merge_to_disk
from mergeval.methods import fused, get_method

execute.BLOCK_MIN, execute.BLOCK_ENTRIES, fused.MIN_ENTRIES = 2, 300, 2  # the tiny model's tensors in row blocks
where = []
load = fused._load_registries
fused._load_registries = lambda: (where.append(threading.current_thread().name), load())[1]
method = get_method(sys.argv[1])
merge_to_disk(method, method.config(), Path(sys.argv[2]), [Path(e) for e in sys.argv[3:5]], Path(sys.argv[5]), seed=0)
print(where)
"""


@pytest.mark.skipif(not fused.available(), reason="numba is not installed")
@pytest.mark.parametrize("name,where", [("dare_ties", "['MainThread']"), ("task_arithmetic", "[]")])
def test_a_merge_loads_the_kernels_before_its_workers_start_and_only_where_they_apply(
    name, where, tiny_dir, experts, tmp_path
):
    """Loaded by the first worker, they kept the other waiting on numba's locks (execute._load_kernels_first)."""
    out = subprocess.run(
        [sys.executable, "-c", LOADED_WHERE, name, str(tiny_dir), *map(str, experts), str(tmp_path / "out")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.stdout.strip() == where, out.stdout + out.stderr[-2000:]


def test_row_blocks_are_written_in_place_by_the_threads_that_merge_them(tiny_dir, experts, tmp_path, monkeypatch):
    """The workers write each merged row block at its offset in its shard (writer.ShardWriter._write_in_place):
    the same bytes as the tensors merged whole and written by the consumer, one shard or several."""
    method, cfg = method_and_cfg("dare_ties", density=0.5)
    whole = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "whole", seed=3)
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)  # every tensor of the tiny model in row blocks
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    writers, pwrite = [], os.pwrite
    monkeypatch.setattr(
        os, "pwrite", lambda fd, data, at: (writers.append(threading.current_thread().name), pwrite(fd, data, at))[1]
    )
    blocks = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "blocks", seed=3)
    assert len(writers) > 20 and all(name.startswith(execute.THREAD_NAME) for name in writers)
    assert (blocks / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    sharded = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "sharded", seed=3, shard_size=40_000)
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert_same_tensors(read_dir(sharded), read_dir(whole))


@pytest.mark.skipif(not fused.available(), reason="numba is not installed")
@pytest.mark.parametrize("name", ["dare_ties", "dare_linear"])
def test_the_kernel_takes_the_experts_rows_read_into_one_stack(name, tiny_dir, experts, tmp_path, monkeypatch):
    """Blocks merged by the compiled kernel read the experts' float32 rows straight into one stack, which
    fused.merge_rows takes as it is (no copy per expert per block): the same bytes as the whole-tensor merge."""
    method, cfg = method_and_cfg(name, density=0.5)
    whole = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "whole", seed=4)
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    monkeypatch.setattr(fused, "MIN_ENTRIES", 2)  # the tiny model's tensors take the kernel
    given, merge_rows = [], fused.merge_rows
    monkeypatch.setattr(
        fused, "merge_rows", lambda base, rows, **kw: (given.append(type(rows)), merge_rows(base, rows, **kw))[1]
    )
    blocks = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "blocks", seed=4)
    assert len(given) > 20 and set(given) == {fused.StackedRows}
    assert (blocks / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()


def test_rows_are_read_into_a_given_tensor_of_their_shape_and_dtype_only(tiny_dir):
    reader = CheckpointReader(tiny_dir, "modelset.base")
    name = next(n for n in reader.names() if len(reader.shapes[n]) == 2)
    rows = (2, *reader.shapes[name][1:])
    into = torch.empty(rows, dtype=reader.dtypes[name])
    assert reader.get_rows(name, 1, 3, out=into) is into
    assert torch.equal(into, reader.get(name)[1:3])
    for wrong in (
        torch.empty(rows, dtype=torch.float64),
        torch.empty((3, *rows[1:]), dtype=into.dtype),
        torch.empty(rows[::-1], dtype=into.dtype).t(),
    ):
        with pytest.raises(ValueError, match="out is"):
            reader.get_rows(name, 1, 3, out=wrong)


def test_without_positioned_reads_and_writes_a_merge_seeks_instead_with_the_same_bytes(
    tiny_dir, experts, tmp_path, monkeypatch
):
    """Where the platform has no os.preadv / os.pwrite (Windows), the reader and the in-place writer seek on
    their own descriptor and give the same bytes."""
    method, cfg = method_and_cfg("ties", density=0.5)
    monkeypatch.setattr(execute, "BLOCK_MIN", 2)
    monkeypatch.setattr(execute, "BLOCK_ENTRIES", 300)
    positioned = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "positioned", seed=2)
    monkeypatch.delattr(os, "preadv")
    monkeypatch.delattr(os, "pwrite")
    seeking = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "seeking", seed=2)
    assert (seeking / "model.safetensors").read_bytes() == (positioned / "model.safetensors").read_bytes()


def test_a_block_written_after_its_merge_stopped_lands_in_no_file(tmp_path):
    """A worker may still finish a block after the merge stopped (an interruption, an error: run_plan does not
    wait for it). Its write opens the shard by its path, so it fails once the merge's directory is removed
    instead of writing into whatever file took over a closed descriptor's number."""
    out = tmp_path / "out"
    out.mkdir()
    writer = ShardWriter(out, {"w": ((4, 3), torch.float32)})
    handed = []

    class Interrupted:
        def written(self, write):
            handed.append(write)  # a worker holds this while the merge stops
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        writer.write("w", Interrupted())
    writer.close()
    shutil.rmtree(out)
    with pytest.raises(FileNotFoundError):
        handed[0](2, torch.ones(2, 3))
    assert not out.exists()


def test_sharded_output_loads_with_transformers(tiny_dir, experts, tmp_path):
    method, cfg = method_and_cfg("ties")
    out = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "out", shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert not (out / "model.safetensors").exists()
    merged = merge_tensors(method, cfg, load_tensors(tiny_dir), [load_tensors(p) for p in experts], seed=0)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    model = load_model(out)  # transformers' own loader, over the index and shards
    state = model.state_dict()
    for name, tensor in merged.items():
        assert torch.equal(state[name], tensor), name
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert (out / extra).exists(), extra
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(tiny_dir).get_vocab()


def test_the_model_card_records_config_inputs_and_fingerprints(tiny_dir, experts, tmp_path):
    from mergeval.models.fingerprint import fingerprint

    method, cfg = method_and_cfg("ties", density=0.3)
    out = merge_to_disk(method, cfg, tiny_dir, {"chem": experts[0], "units": experts[1]}, tmp_path / "out", seed=4)
    card = (out / "README.md").read_text()
    for path in (tiny_dir, *experts):
        assert fingerprint(path) in card and str(path) in card
    assert "density: 0.3" in card and "seed: 4" in card and "| chem |" in card and "`ties`" in card
    assert f"`ties` method, implementation version {method.version}." in card  # which code made the bits


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_merge_leaves_no_output(error, tiny_dir, experts, tmp_path):
    calls = []

    def failing(base, experts_, cfg, gen):
        calls.append(1)
        if len(calls) == 7:
            raise error("interrupted")
        return base

    method = dataclasses.replace(get_method("task_arithmetic"), merge=failing)
    with pytest.raises(error):
        merge_to_disk(method, method.config(), tiny_dir, experts, tmp_path / "out", shard_size=20_000)
    # the units already handed to the workers (at most WINDOW ahead of the failed one) may run, no others
    assert 7 <= len(calls) <= 7 + execute.WINDOW and list(tmp_path.iterdir()) == []  # nor a temporary sibling


def test_a_merge_stopped_by_its_consumer_does_not_wait_for_the_units_still_running(
    tiny_dir, experts, tmp_path, monkeypatch
):
    """The writer fails (here: an interruption) while a worker is still merging a later unit: merge_to_disk
    raises at once, leaving that unit to end by itself, instead of waiting for it (which made Ctrl-C wait for
    the slowest running unit)."""
    import threading

    from mergeval.merge import streaming

    running, release, ended = threading.Event(), threading.Event(), threading.Event()
    method = get_method("task_arithmetic")
    reader = CheckpointReader(tiny_dir, "base")
    first = reader.get(build_plan(method, method.config(), reader.dtypes)[0].names[0])  # what is written first

    def merge(base, experts_, cfg, gen):
        if not torch.equal(base, first):  # a later unit (the workers take them in any order): runs until released
            running.set()
            release.wait(60)
            ended.set()
        return base

    def failing_write(tensor, dtype):
        running.wait(60)  # the second unit is running now
        raise KeyboardInterrupt

    method = dataclasses.replace(method, merge=merge)
    monkeypatch.setattr(streaming, "cast_to", failing_write)
    try:
        with pytest.raises(KeyboardInterrupt):
            merge_to_disk(method, method.config(), tiny_dir, experts, tmp_path / "out")
        assert running.is_set() and not ended.is_set()  # raised while the unit still ran
        assert list(tmp_path.iterdir()) == []
    finally:
        release.set()
    assert ended.wait(60)


def test_dare_is_deterministic_across_runs_and_the_seed_matters(tiny_dir, experts, tmp_path):
    method, cfg = method_and_cfg("dare_ties", density=0.3)
    runs = [merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / f"run{i}", seed=11) for i in range(2)]
    files = sorted(p.name for p in runs[0].iterdir())
    assert files == sorted(p.name for p in runs[1].iterdir())
    for name in files:  # the whole directory, card included, byte for byte
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name
    other = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "other", seed=12)
    assert (other / "model.safetensors").read_bytes() != (runs[0] / "model.safetensors").read_bytes()


def test_merge_into_a_live_model_equals_the_in_memory_merge(tiny_dir, experts):
    method, cfg = method_and_cfg("dare_linear", density=0.6)
    live = merge_into_model(load_model(tiny_dir), method, cfg, tiny_dir, experts, seed=2)
    expected = load_model(
        tiny_dir, merge_tensors(method, cfg, load_tensors(tiny_dir), [load_tensors(p) for p in experts], seed=2)
    )
    reference = expected.state_dict()
    for name, tensor in live.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


def _in_bfloat16(model_dir: Path, out: Path) -> Path:
    """A copy of a checkpoint with every floating tensor rounded to bfloat16 (config and tokenizer as they are)."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(
        {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in load_tensors(model_dir).items()},
        str(out / "model.safetensors"),
    )
    return out


def test_a_live_merge_evaluated_in_its_checkpoints_dtype_is_built_in_it_with_the_same_bits(tiny_dir, experts, tmp_path):
    """bfloat16 checkpoints evaluated in bfloat16: the live model is built in bfloat16, not float32 (half the
    memory), and holds the same merged values, hence the same fingerprint; float32 checkpoints evaluated in
    bfloat16 still merge into a float32 model, which alone holds their merged values exactly."""
    from mergeval.merge.memory import merge_live
    from mergeval.models.fingerprint import fingerprint_state_dict

    base = _in_bfloat16(tiny_dir, tmp_path / "base")
    named = {f"e{i}": _in_bfloat16(p, tmp_path / f"e{i}") for i, p in enumerate(experts)}
    method, cfg = method_and_cfg("ties", density=0.4)
    model16, view16 = merge_live(method, cfg, base, named, seed=5, dtype=torch.bfloat16)
    model32, view32 = merge_live(method, cfg, base, named, seed=5, dtype=torch.float32)
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model32.parameters()} == {torch.float32}
    assert fingerprint_state_dict(view16) == fingerprint_state_dict(view32)
    for name, tensor in model32.to(torch.bfloat16).state_dict().items():
        assert torch.equal(tensor, model16.state_dict()[name]), name
    model, _ = merge_live(method, cfg, tiny_dir, dict(enumerate(experts)), seed=5, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # float32 checkpoints


def test_a_model_loaded_in_bfloat16_is_the_float32_load_cast(tiny_dir):
    direct, cast = load_model(tiny_dir, dtype=torch.bfloat16), load_model(tiny_dir).to(torch.bfloat16)
    reference = cast.state_dict()
    assert all(torch.equal(t, reference[n]) and t.dtype == reference[n].dtype for n, t in direct.state_dict().items())
    assert {b.dtype for b in direct.buffers()} == {b.dtype for b in cast.buffers()}


def test_the_consumer_runs_on_one_torch_thread_and_the_callers_count_comes_back(tiny_dir, experts, monkeypatch):
    # the consumer's copies into a live model run on one thread (with more, torch's OpenMP helper spun on a
    # core the merging workers need); the caller's thread count is restored, also when the merge fails
    method, cfg = method_and_cfg("task_arithmetic")
    base = MemorySource(load_tensors(tiny_dir), "base")
    inputs = [MemorySource(load_tensors(p), f"e{i}") for i, p in enumerate(experts)]
    plan = build_plan(method, cfg, base.dtypes)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert {torch.get_num_threads() for _ in execute.run_plan(plan, method, base, inputs, 0, {})} == {1}
        assert torch.get_num_threads() == 2

        def fail(*args):
            raise RuntimeError("a merge that fails")

        monkeypatch.setattr(execute, "_merge_unit", fail)
        with pytest.raises(RuntimeError, match="a merge that fails"):
            list(execute.run_plan(plan, method, base, inputs, 0, {}))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_items_start_past_the_window_while_a_larger_oldest_one_runs_and_come_back_in_order():
    # A large unit at the head (DELLA's ranks over an embedding) no longer leaves the other workers idle: while
    # it runs, later items start beyond the window until those behind it total more than its own size.
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    release, started = threading.Event(), []

    def work(item):
        started.append(item)
        if item == "big":
            assert release.wait(60)
        return item.upper()

    def started_once(count: int) -> list:
        """The items started, once ``count`` have (then a moment more: a bug that starts more shows)."""
        for _ in range(6000):
            if len(started) >= count:
                break
            time.sleep(0.01)
        time.sleep(0.2)
        return sorted(started)

    sizes = {"big": 10, **{f"s{i}": 3 for i in range(8)}}
    items = list(sizes)
    for size, expected in ((sizes.get, ["big", "s0", "s1", "s2", "s3"]), (None, ["big", "s0", "s1"])):
        release.clear()
        started.clear()
        with ThreadPoolExecutor(2) as pool:
            results = execute.ordered(pool, work, items, window=2, size=size)
            out: list = []
            first = threading.Thread(target=lambda out=out, results=results: out.append(next(results)))
            first.start()
            # sizes: s0..s3 total 12 > 10, so the fourth is submitted and then the generator waits for "big";
            # without: the window of two holds, the third item waits
            assert started_once(len(expected)) == expected and not out
            release.set()
            first.join(60)
            out.extend(results)
        assert out == [(item, item.upper()) for item in items]


def test_an_error_of_a_later_call_is_raised_while_an_earlier_one_still_runs():
    """``ordered`` yields in order, but a failure is not held back behind an older call still running (which
    may take minutes): its error reaches the consumer at once. A failure of the oldest call itself, or one
    after results already handed out, keeps the order."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()

    def work(item):
        if item == "slow":
            assert release.wait(60)
        if item == "bad":
            raise ValueError("bad item")
        return item

    with ThreadPoolExecutor(2) as pool:
        try:
            results = execute.ordered(pool, work, ["first", "slow", "bad", "never"], window=2)
            assert next(results) == ("first", "first")
            with pytest.raises(ValueError, match="bad item"):
                next(results)  # "slow" is still held
            assert not release.is_set()
        finally:
            release.set()  # before the pool's exit waits for "slow"
    with ThreadPoolExecutor(2) as pool:  # nothing held: the same results as before, in order
        assert list(execute.ordered(pool, str.upper, ["a", "b", "c"], window=1)) == [(x, x.upper()) for x in "abc"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_an_expert_is_a_one_line_error_naming_model_and_tensor(bad, tiny_dir, experts, tmp_path):
    def poison(tensors, _dst):
        tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = bad

    broken = make_expert(tiny_dir, tmp_path / "broken", seed=9, change=poison)
    method, cfg = method_and_cfg("ties")
    with pytest.raises(UserError) as err:
        merge_to_disk(method, cfg, tiny_dir, {"good": experts[0], "broken": broken}, tmp_path / "out")
    assert err.value.field == "modelset.experts.broken"
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value) and "NaN or Inf" in str(err.value)
    assert "\n" not in err.value.line() and not (tmp_path / "out").exists()


def test_an_existing_output_directory_is_refused_before_merging(tiny_dir, experts, tmp_path):
    (tmp_path / "out").mkdir()
    method, cfg = method_and_cfg("ties")
    with pytest.raises(UserError) as err:
        merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "out")
    assert err.value.field == "output"


def test_a_truncated_checkpoint_is_a_clear_error(tiny_dir, tmp_path):
    broken = tmp_path / "short"
    shutil.copytree(tiny_dir, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(UserError, match="truncated"):
        CheckpointReader(broken, "modelset.base")


# ---------------------------------------------------------------- vocabulary policies


def with_vocab(tiny_dir: Path, dst: Path, rows: int, seed: int) -> Path:
    """A tiny expert whose embedding has ``rows`` rows (cut, or extended with random rows) and matching config."""

    def resize(tensors, where):
        emb = tensors["model.embed_tokens.weight"]
        extra = torch.randn(max(0, rows - emb.shape[0]), emb.shape[1], generator=torch.Generator().manual_seed(seed))
        tensors["model.embed_tokens.weight"] = torch.cat([emb, extra])[:rows].contiguous()
        config = json.loads((where / "config.json").read_text())
        config["vocab_size"] = rows
        (where / "config.json").write_text(json.dumps(config))

    return make_expert(tiny_dir, dst, seed=seed, change=resize)


def test_vocab_mismatch_is_an_error_by_default_naming_tensors_shapes_and_the_policies(tiny_dir, experts, tmp_path):
    small = with_vocab(tiny_dir, tmp_path / "small", 370, seed=3)
    method, cfg = method_and_cfg("ties")
    with pytest.raises(UserError) as err:
        merge_to_disk(method, cfg, tiny_dir, {"a": experts[0], "small": small}, tmp_path / "out")
    msg = str(err.value)
    assert err.value.field == "modelset.experts.small" and "\n" not in msg
    assert "model.embed_tokens.weight [370, 32] vs the base's [384, 32]" in msg
    assert "vocab_policy=base" in msg and "truncate (" in msg and "union (" in msg
    with pytest.raises(UserError, match="vocab_policy=base"):  # the in-memory path says the same
        merge_tensors(method, cfg, load_tensors(tiny_dir), [load_tensors(small)], seed=0)


def test_truncate_merges_the_shared_rows_and_writes_the_smaller_vocabulary(tiny_dir, experts, tmp_path):
    small = with_vocab(tiny_dir, tmp_path / "small", 370, seed=3)
    method, cfg = method_and_cfg("task_arithmetic", lambda_=0.5)
    out = merge_to_disk(
        method, cfg, tiny_dir, {"a": experts[0], "small": small}, tmp_path / "out", vocab_policy="truncate"
    )
    emb = "model.embed_tokens.weight"
    inputs = [load_tensors(p) for p in (tiny_dir, experts[0], small)]
    for t in inputs:
        t[emb] = t[emb][:370]
    expected = merge_tensors(method, cfg, inputs[0], inputs[1:], seed=0)
    assert_same_tensors(read_dir(out), expected)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 370
    assert "the tokenizer from the expert small" in (out / "README.md").read_text()
    assert (out / "tokenizer.json").read_bytes() == (small / "tokenizer.json").read_bytes()


def test_union_keeps_the_base_vocabulary_with_zero_deltas_for_missing_rows(tiny_dir, experts, tmp_path):
    small = with_vocab(tiny_dir, tmp_path / "small", 370, seed=3)
    method, cfg = method_and_cfg("task_arithmetic")
    out = merge_to_disk(method, cfg, tiny_dir, [small], tmp_path / "out", vocab_policy="union")
    merged, base = read_dir(out), load_tensors(tiny_dir)
    emb = "model.embed_tokens.weight"
    assert merged[emb].shape == base[emb].shape
    assert torch.equal(merged[emb][370:], base[emb][370:])  # rows the expert lacks: the base's
    assert torch.allclose(merged[emb][:370], load_tensors(small)[emb])
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 384


def test_union_refuses_an_expert_with_more_rows_than_the_base(tiny_dir, experts, tmp_path):
    big = with_vocab(tiny_dir, tmp_path / "big", 400, seed=3)
    method, cfg = method_and_cfg("ties")
    with pytest.raises(UserError) as err:
        merge_to_disk(method, cfg, tiny_dir, {"big": big}, tmp_path / "out", vocab_policy="union")
    assert err.value.field == "modelset.experts.big" and "400 > 384" in str(err.value)
    with pytest.raises(UserError, match="vocab_policy: unknown policy 'merge'"):
        merge_to_disk(method, cfg, tiny_dir, {"big": big}, tmp_path / "out2", vocab_policy="merge")


@SETTINGS
@given(st.integers(1, 50), st.lists(st.integers(1, 50), min_size=1, max_size=4), st.integers(1, 6))
def test_vocab_rows_policies(base_rows, expert_rows, width):
    base = {"emb": (base_rows, width), "norm": (width,)}
    experts = [{"emb": (r, width), "norm": (width,)} for r in expert_rows]
    labels = [f"e{i}" for i in range(len(experts))]
    differ = any(r != base_rows for r in expert_rows)
    truncated = vocab_rows(base, experts, labels, "truncate")
    assert truncated == ({"emb": min(base_rows, *expert_rows)} if differ else {})
    if max(expert_rows) > base_rows:
        with pytest.raises(UserError, match="union"):
            vocab_rows(base, experts, labels, "union")
    else:
        assert vocab_rows(base, experts, labels, "union") == ({"emb": base_rows} if differ else {})
    if differ:
        with pytest.raises(UserError, match="vocabulary differs"):
            vocab_rows(base, experts, labels, "error")
    with pytest.raises(UserError, match="norm has shape"):  # a 1-D difference is never a vocabulary
        vocab_rows(base, [dict(experts[0], norm=(width + 1,))], labels[:1], "truncate")


# ---------------------------------------------------------------- rules and gradients


knot_lists = st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=6)


@SETTINGS
@given(knot_lists, st.floats(0, 1))
def test_a_gradient_starts_and_ends_at_its_ends_and_stays_between_its_knots(knots, t):
    assert interpolate(knots, 0.0) == knots[0] and interpolate(knots, 1.0) == knots[-1]
    value = interpolate(knots, t)
    assert min(knots) - 1e-9 <= value <= max(knots) + 1e-9
    assert interpolate(knots[:1] * 3, t) == knots[0]  # a constant list is a constant
    for j, knot in enumerate(knots):  # it passes through every knot, evenly spaced
        assert math.isclose(interpolate(knots, j / max(1, len(knots) - 1)), knot, abs_tol=1e-9)


@SETTINGS
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=6), st.floats(0, 1), st.floats(0, 1))
def test_a_monotone_gradient_is_monotone_in_depth(knots, t1, t2):
    knots = sorted(knots)
    lo, hi = sorted([t1, t2])
    assert interpolate(knots, lo) <= interpolate(knots, hi) + 1e-9


@SETTINGS
@given(st.integers(1, 40))
def test_depth_runs_from_the_embeddings_through_the_layers_to_the_head(n_layers):
    ts = [depth(f"model.layers.{i}.mlp.up_proj.weight", n_layers) for i in range(n_layers)]
    assert ts == sorted(ts) and all(0 <= t <= 1 for t in ts)
    assert ts[-1] == 1.0 and (n_layers == 1 or ts[0] == 0.0)
    assert depth("model.embed_tokens.weight", n_layers) == 0.0
    assert depth("model.norm.weight", n_layers) == depth("lm_head.weight", n_layers) == 1.0
    assert depth(f"model.layers.{n_layers - 1}", n_layers) == ts[-1]  # a layer unit's prefix
    assert count_layers([f"model.layers.{i}.x" for i in range(n_layers)] + ["lm_head.weight"]) == n_layers


names = st.sampled_from(
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
)
rule_value = st.one_of(st.floats(0.05, 1), st.lists(st.floats(0.05, 1), min_size=1, max_size=4))
globs = st.sampled_from(["*", "*mlp*", "*self_attn*", "model.layers.*", "lm_head*", "nothing*"])


@SETTINGS
@given(names, st.floats(0, 1), st.lists(st.tuples(globs, rule_value), max_size=4), globs, rule_value)
def test_the_last_matching_rule_wins_and_others_keep_the_top_level(name, t, rules, glob, last):
    from fnmatch import fnmatchcase

    method = get_method("ties")
    cfg = method.config(density=0.5, rules=[{"match": g, "density": v} for g, v in rules])
    resolved, source = resolve(cfg, name, t)
    matching = [i for i, (g, _) in enumerate(rules) if fnmatchcase(name, g)]
    if matching:
        assert source == {"density": matching[-1]}
        assert resolved.density == pytest.approx(interpolate(rules[matching[-1]][1], t))
    else:
        assert source == {} and resolved.density == 0.5
    assert resolved.lambda_ == 1.0 and resolved.rules == []
    appended = dataclasses.replace(cfg, rules=[*cfg.rules, {"match": glob, "density": last}])
    if fnmatchcase(name, glob):
        assert resolve(appended, name, t)[0].density == pytest.approx(interpolate(last, t))
    else:
        assert resolve(appended, name, t)[0].density == resolved.density


def test_a_config_without_rules_resolves_to_itself():
    cfg = get_method("ties").config(density=0.3)
    assert resolve(cfg, "model.norm.weight", 0.5) == (cfg, {})
    from mergeval.methods.task_vector import TiesConfig

    plain = TiesConfig(density=0.3)  # a config built without the registry's rules field
    assert resolve(plain, "x", 0.0) == (plain, {})


def test_rules_apply_per_tensor_name_and_depth_in_a_merge(tiny_dir, experts):
    method = get_method("task_arithmetic")
    base, exs = load_tensors(tiny_dir), [load_tensors(p) for p in experts]
    full = merge_tensors(method, method.config(), base, exs, seed=0)
    cfg = method.config(rules=[{"match": "*", "lambda_": [0.0, 1.0]}, {"match": "*mlp*", "lambda_": 0.0}])
    merged = merge_tensors(method, cfg, base, exs, seed=0)
    for name in base:
        if "mlp" in name or name.startswith("model.layers.0.") or "embed" in name:
            assert torch.equal(merged[name], base[name]), name  # lambda 0: the base
        else:  # last layer, final norm (t = 1): lambda 1
            assert torch.equal(merged[name], full[name]), name


def test_rule_values_are_validated_with_the_rule_named():
    method = get_method("ties")
    with pytest.raises(UserError) as err:
        method.validate(method.config(rules=[{"match": "*mlp*", "density": [0.2, 1.5]}]), 2)
    assert err.value.field == "method.rules[0].density" and "1.5" in str(err.value)
    assert "method.rules[0].density=" in err.value.fix
    with pytest.raises(UserError) as err:
        method.validate(method.config(rules=[{"match": "*", "lambda_": 1.0}, {"match": "*", "sign_rule": 1}]), 2)
    assert err.value.field == "method.rules[1].sign_rule"
    with pytest.raises(UserError, match="sets no parameter"):
        method.validate(method.config(rules=[{"match": "*"}]), 2)
    with pytest.raises(UserError, match="empty list"):
        method.validate(method.config(rules=[{"density": []}]), 2)
    with pytest.raises(UserError, match="finite number"):
        method.validate(method.config(rules=[{"density": "high"}]), 2)


def test_every_resolved_value_is_validated_before_any_tensor_is_read(tiny_dir):
    """della needs density + epsilon <= 1: each rule passes alone, their combination on layer 1 does not."""
    from mergeval.merge.plan import check_plan

    method = get_method("della")
    cfg = method.config(
        density=0.5, epsilon=0.0, rules=[{"match": "*", "density": 0.95}, {"match": "model.layers.1.*", "epsilon": 0.1}]
    )
    method.validate(cfg, 2)  # every knot is valid with the top-level values
    reader = CheckpointReader(tiny_dir, "modelset.base")
    reader.get = lambda name: pytest.fail("a tensor was read before validation")
    with pytest.raises(UserError) as err:
        check_plan(method, build_plan(method, cfg, reader.dtypes), 2)
    assert err.value.field == "method.rules[1].epsilon" and "at model.layers.1." in str(err.value)


def test_every_method_config_has_rules_and_the_yamls_still_compose():
    from hydra import compose, initialize_config_module

    from mergeval.run.config import register_configs

    for method in METHODS.values():
        assert {f.name for f in dataclasses.fields(method.config)} >= {"rules"}, method.name
        assert method.config().rules == []
    register_configs()
    with initialize_config_module("mergeval.run.conf", version_base="1.3"):
        for name in METHODS:
            if (ROOT / "conf" / "method" / f"{name}.yaml").exists():
                compose("config", overrides=["+experiment=tiny", f"method={name}"])
        cfg = compose(
            "config",
            overrides=[
                "+experiment=tiny",
                "method=ties",
                "method.rules=[{match: '*mlp*', density: [0.2, 0.8]}, {lambda_: 0.5}]",
            ],
        )
        from omegaconf import OmegaConf

        typed = OmegaConf.to_object(cfg.method)
        assert [(r.match, r.density, r.lambda_) for r in typed.rules] == [("*mlp*", [0.2, 0.8], None), ("*", None, 0.5)]


# ---------------------------------------------------------------- layer-at-a-time methods


@dataclasses.dataclass
class MeanConfig:
    name: str = "layer_mean"
    scale: float = 1.0


def layer_method(calls: list, with_tensor_merge: bool) -> MergeMethod:
    """A layer method built here (not registered): task vectors averaged over a whole layer, times ``scale``."""
    from mergeval.methods.registry import with_rules

    def merge_layer(base, experts, cfg, gen):
        """merged = b + scale * mean_i(e_i - b), for every tensor of the layer."""
        calls.append(sorted(base))
        return {n: b + cfg.scale * sum(e[n] - b for e in experts) / len(experts) for n, b in base.items()}

    def merge_tensor(base, experts, cfg, gen):
        calls.append(["tensor"])
        return base.clone()

    return MergeMethod(
        "layer_mean",
        with_rules(MeanConfig),
        merge_tensor if with_tensor_merge else None,
        lambda cfg, n: None,
        merge_layer.__doc__,
        merge_layer=merge_layer,
    )


@pytest.mark.parametrize("with_tensor_merge", [False, True])
def test_layer_methods_get_whole_layers_and_stream_like_the_rest(with_tensor_merge, tiny_dir, experts, tmp_path):
    calls: list = []
    method = layer_method(calls, with_tensor_merge)
    cfg = method.config(scale=0.5, rules=[{"match": "model.layers.1", "scale": 1.0}])
    out = merge_to_disk(method, cfg, tiny_dir, experts, tmp_path / "out")
    base = load_tensors(tiny_dir)
    # the engine's worker threads merge units concurrently, so the calls come in any order (the output does not)
    layer_calls = sorted(
        (c for c in calls if c != ["tensor"] and layer_of(c[0]) and len(c) > 1), key=lambda c: layer_of(c[0])[1]
    )
    assert [layer_of(c[0])[1] for c in layer_calls] == [0, 1]
    assert all(c == sorted(n for n in base if n.startswith(f"model.layers.{i}.")) for i, c in enumerate(layer_calls))
    outside = [n for n in base if not layer_of(n)]
    expected_rest = [["tensor"]] * len(outside) if with_tensor_merge else [[n] for n in sorted(outside)]
    assert sorted(c for c in calls if c not in layer_calls) == sorted(expected_rest)
    merged, exs = read_dir(out), [load_tensors(p) for p in experts]
    for n in base:
        if n.startswith("model.layers.1."):  # the rule: scale 1 on layer 1
            assert torch.allclose(merged[n], base[n] + (exs[0][n] - base[n] + exs[1][n] - base[n]) / 2)
    calls.clear()
    again = merge_tensors(method, cfg, base, exs, seed=0)
    assert_same_tensors(merged, again)


def test_build_plan_units():
    dtypes = {
        "model.embed_tokens.weight": torch.float32,
        "model.layers.0.a": torch.float32,
        "model.layers.0.b": torch.float32,
        "model.layers.1.a": torch.float32,
        "model.layers.1.ids": torch.int64,
        "model.norm.weight": torch.float32,
    }
    per_tensor = build_plan(get_method("ties"), get_method("ties").config(), dtypes)
    assert [(u.names, u.kind) for u in per_tensor] == [
        ((n,), "copy" if n.endswith("ids") else "tensor") for n in sorted(dtypes)
    ]
    layered = build_plan(layer_method([], False), MeanConfig(), dtypes)
    assert [(u.key, u.kind) for u in layered] == [
        ("model.embed_tokens.weight", "layer"),
        ("model.layers.0", "layer"),
        ("model.layers.1", "layer"),
        ("model.layers.1.ids", "copy"),
        ("model.norm.weight", "layer"),
    ]
    assert layered[1].names == ("model.layers.0.a", "model.layers.0.b")


# ---------------------------------------------------------------- the merge CLI


def merge_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return run_module("mergeval.merge", *args, cwd=cwd, env=env, timeout=900)


def test_merge_cli_end_to_end_on_the_tiny_zoo(tmp_path, cache):
    out = merge_cli(
        "+experiment=tiny",
        "method=dare_ties",
        "seed=3",
        f"output={tmp_path / 'merged'}",
        "method.rules=[{match: '*mlp*', density: [0.3, 0.9]}]",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"merged model: {tmp_path / 'merged'}" in out.stdout
    model = load_model(tmp_path / "merged")
    assert sum(p.numel() for p in model.parameters()) > 0
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "dare_ties" in card and "finetune:chem_count" in card and "'*mlp*'" in card
    assert [p.name for p in (tmp_path / "merged").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["method=ties", "method.density=1.5"], "method.density"),
        (["method=ties", "method.rules=[{match: '*mlp*', density: [0.5, 2.0]}]"], "method.rules[0].density"),
        (["method=ties", "method.rules=[{match: '*', densty: 0.5}]"], "method.rules[...].densty: no such field"),
        (["vocab_policy=merge"], "vocab_policy"),
    ],
)
def test_merge_cli_bad_input_exits_2_with_one_line_and_leaves_nothing(overrides, field, tmp_path, cache):
    out = merge_cli("+experiment=tiny", *overrides, f"output={tmp_path / 'merged'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mergeval: error: {field}") and "Traceback" not in out.stderr
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no output, no job directory (.hydra)
    assert not (tmp_path / "merged").exists()


def test_merge_cli_nan_expert_exits_2_with_one_line(tiny_dir, tmp_path, cache):
    def poison(tensors, _dst):
        tensors["model.norm.weight"][0] = float("nan")

    broken = make_expert(tiny_dir, tmp_path / "inputs" / "broken", seed=9, change=poison)
    good = make_expert(tiny_dir, tmp_path / "inputs" / "good", seed=8)
    work = tmp_path / "work"
    work.mkdir()
    out = merge_cli(
        "+experiment=tiny",
        "modelset.experts.chem.domain=null",
        f"modelset.experts.chem.source={broken}",
        "modelset.experts.units.domain=null",
        f"modelset.experts.units.source={good}",
        f"output={work / 'merged'}",
        cwd=work,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mergeval: error: modelset.experts.chem:")
    assert "model.norm.weight" in lines[0] and "NaN or Inf" in lines[0]
    assert [p for p in work.rglob("*") if p.is_file()] == [] and not (work / "merged").exists()


# ---------------------------------------------------------------- the memory bound


def test_peak_memory_does_not_grow_with_model_size():
    """Two depths 4x apart, same largest tensor: the merge's peak RSS differs by far less than the inputs do.

    If a merge held the inputs (or just one of them) in memory, the difference would be at least
    one checkpoint's growth (84 MiB here); the threshold is a fifth of all three inputs' growth. Measured
    differences between the two depths were within +-20 MiB, run-to-run noise of the allocator."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "merge_memory.py"),
            "--json",
            "--layers",
            "4,16",
            "--hidden",
            "256",
            "--intermediate",
            "2048",
            "--vocab",
            "4096",
            "--heads",
            "4",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    small, large = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert small["largest_tensor_bytes"] == large["largest_tensor_bytes"]
    assert large["params"] > 3.5 * small["params"]
    grown_inputs = 3 * (large["checkpoint_bytes"] - small["checkpoint_bytes"])
    assert abs(large["peak_rss"] - small["peak_rss"]) < 0.2 * grown_inputs
    assert large["peak_rss"] - large["baseline_rss"] < 0.5 * 3 * large["checkpoint_bytes"]  # inputs never all held
