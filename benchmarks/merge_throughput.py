"""Merge throughput: the same merges by mergeval's streaming engine and by ``mergekit-yaml``, side by side.

    python benchmarks/merge_throughput.py                        # TIES on the quickstart base + its two experts
    python benchmarks/merge_throughput.py --models quickstart synthetic-1b --method ties dare_ties \\
        --cache /tmp/fresh5-cache --repeats 3 --synthetic-repeats 1 --json result.json
    python benchmarks/merge_throughput.py --smoke                # tiny synthetic models, a few seconds

Model sets (``--models``, each base + 2 experts): the quickstart's SmolLM2-135M models (float32, from a
mergeval cache), or a synthetic llama-layout model (``synthetic-1b``: TinyLlama-1.1B's shapes, 1.1B
parameters; ``synthetic-0.5b``; ``synthetic-3b``: Llama-3.2-3B's, MergeBench's smallest base, its embedding
tied as there; ``synthetic-8b``: Llama-3-8B's) written by this script into the work directory in
``--synthetic-dtype`` (bfloat16 by default: 2.2 GB per 1B checkpoint, 6.4 GB at 3B, 16 GB at 8B; the work
directory holds three inputs and one output at a time) and removed after its cases. Methods (``--method``):
``ties`` (density 0.5 per expert, weight 1, lambda 1, disjoint mean: mergekit's ``ties`` with its
defaults, mergeval's ``ties`` with weights_before_election=true) and ``dare_ties`` (the same with DARE's
random drop: mergeval's paper mode rescales kept entries by 1/density, mergekit's by the L1 norm, and the
random draws differ, so the outputs agree only in scale). Both tools compute and write in the base's dtype,
tokenizer copied, model card written. Each run is a fresh child process (interpreter start and imports
included, as a user pays them): mergeval calls ``mergeval.merge.merge_to_disk``, mergekit runs its CLI
``mergekit-yaml CONFIG OUT --copy-tokenizer --device cpu --no-lazy-unpickle --quiet`` (the inputs are
safetensors, so lazy unpickling would not apply anyway). The order alternates between repeats; the input
files are read once before timing so both tools start from a warm page cache, and every run starts after
``os.sync()``, so no run pays for writing the previous run's output to disk. Like ``python -m
mergeval.merge`` with a warm cache, the inputs' fingerprints for mergeval's model card are computed once,
before timing.

Reported per model set and method: median wall time per tool over the repeats, and the peak resident
memory of the process tree doing the work: the largest sum, over the child and all its descendants, of each
process's high-water mark (VmHWM, or its RSS when larger), polled every 20 ms from /proc. wait4's
``ru_maxrss`` is recorded in the JSON but not used: Linux carries the spawning process's high-water mark
into the child's at exec (a child running ``pass`` reported 814 MiB after its parent had touched 800 MiB),
so it gave this script's own peak, over 1 GB once it had compared two outputs. Then the wall-time ratio
mergekit / mergeval (the speed-up), mergeval's peak RSS as a share of mergekit's, the I/O floor (read every input once from the page cache and write one output-sized
file: no merge can be faster), whether the target (>= 5x at <= a third of the memory) is met, and the
largest absolute difference between the two merged checkpoints, tensor by tensor. A mergekit run that exits
non-zero (at 8B, killed for lack of memory) is reported with its exit code and the peak it reached, and no
speed-up is given for it; a mergeval run that fails ends the benchmark with its output. The load average at the
start and end says how busy the machine was, and on a VM the share of CPU time the hypervisor took (steal, from
/proc/stat) how much of the machine it really had.

``--startup`` also times each tool's start alone (``mergekit-yaml --help``; a Python that imports
mergeval's engine and methods and ends as its command lines do, ``mergeval.run.cli.skip_final_collection``),
the fixed cost included in every merge above, so the merge work proper can be told from interpreter start,
imports and exit.

The input cache is only read. Outputs go to a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from run_memory import _vm_hwm_kib  # benchmarks/ is on sys.path when this script runs

TOOLS = ("mergeval", "mergekit")
DENSITY, LAMBDA = 0.5, 1.0
TARGET_SPEEDUP, TARGET_MEMORY = 5.0, 1 / 3  # issue 13: >= 5x mergekit's speed at <= a third of its peak RSS
POLL_S = 0.02
MERGEKIT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


# ---------------------------------------------------------------- inputs


def quickstart_models(cache: Path) -> tuple[Path, list[Path]]:
    """The converted SmolLM2 base under models/ and the newest chem_count and unit_convert experts under experts/."""

    def newest(pattern: str, where: Path) -> Path:
        found = sorted(where.glob(pattern), key=lambda p: p.stat().st_mtime)
        if not found:
            sys.exit(
                f"merge_throughput: no {where / pattern}; run `MERGEVAL_CACHE={cache} python -m mergeval` "
                "once to build the quickstart models, or pass --base and --experts"
            )
        return found[-1]

    return newest("smollm2-135m-*", cache / "models"), [
        newest(f"{d}-*", cache / "experts") for d in ("chem_count", "unit_convert")
    ]


def smoke_models(root: Path) -> tuple[Path, list[Path]]:
    """The tiny zoo Llama (with its tokenizer) as base and two experts = base + random deltas."""
    import torch
    from safetensors.torch import load_file, save_file

    from mergeval.models.zoo.tiny import zoo_dir

    base = zoo_dir("tiny", root / "cache")
    tensors = load_file(str(base / "model.safetensors"))
    experts = []
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        out = root / f"expert{i}"
        shutil.copytree(base, out)
        save_file(
            {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in tensors.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
        experts.append(out)
    return base, experts


SYNTHETIC = {  # llama layouts: hidden, layers, intermediate, heads, kv heads, vocab, tied lm_head
    "1b": (2048, 22, 5632, 32, 4, 32000, False),  # TinyLlama-1.1B's shapes
    "0.5b": (1536, 16, 4096, 24, 4, 32000, False),
    "3b": (3072, 28, 8192, 24, 8, 128256, True),  # Llama-3.2-3B's (MergeBench's smallest base): 3.2B parameters
    "8b": (4096, 32, 14336, 32, 8, 128256, False),  # Llama-3-8B's: 16 GB per checkpoint in bfloat16
}


def synthetic_models(root: Path, size: str, dtype: str = "bfloat16", experts: int = 2) -> tuple[Path, list[Path]]:
    """A random llama-layout base (``SYNTHETIC[size]``, with the tiny zoo's tokenizer: its ids lie inside the
    vocabulary, the rest of the rows are padding as in a padded vocabulary) and ``experts`` experts = base +
    small random deltas, written one tensor at a time (``run_memory.py --size`` uses them too)."""
    import torch

    from mergeval.merge.writer import ShardWriter
    from mergeval.models.zoo.tiny import zoo_dir

    hidden, layers, inter, heads, kv, vocab, tied = SYNTHETIC[size]
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv * hd, hidden),
                p + "self_attn.v_proj.weight": (kv * hd, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    tdtype = getattr(torch, dtype)
    specs = {n: (shapes[n], tdtype) for n in sorted(shapes)}
    tokenizer = zoo_dir("tiny", root / "cache")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "torch_dtype": dtype,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
    }
    dirs = []
    for i, name in enumerate(["base", *(f"expert{k}" for k in range(experts))]):
        out = root / name
        out.mkdir(parents=True)
        writer = ShardWriter(out, specs)
        for n, (shape, _) in specs.items():
            g = torch.Generator().manual_seed(zlib.crc32(n.encode()))
            t = 0.02 * torch.randn(shape, generator=g)
            if i:
                t += 0.002 * torch.randn(
                    shape, generator=torch.Generator().manual_seed(zlib.crc32(f"{i}:{n}".encode()))
                )
            writer.write(n, t.to(tdtype))
        writer.finish()
        (out / "config.json").write_text(json.dumps(config))
        for f in tokenizer.glob("tokenizer*"):
            shutil.copy2(f, out / f.name)
        dirs.append(out)
    return dirs[0], dirs[1:]


def io_floor(base: Path, experts: list[Path], out: Path) -> float:
    """Seconds to read every input's safetensors bytes (warm page cache) and write one output-sized file."""
    start = time.perf_counter()
    for d in [base, *experts]:
        for path in d.glob("*.safetensors"):
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 24):
                    pass
    out_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    block = bytes(1 << 24)
    with open(out, "wb") as f:
        for start_byte in range(0, out_bytes, len(block)):
            f.write(block[: min(len(block), out_bytes - start_byte)])
    elapsed = time.perf_counter() - start
    out.unlink()
    return elapsed


def base_dtype(base: Path) -> str:
    """mergekit's name for the dtype of the base's first floating tensor (mergeval writes the base's dtype)."""
    with open(sorted(base.glob("*.safetensors"))[0], "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"} & set(MERGEKIT_DTYPES)
    if len(dtypes) != 1:
        sys.exit(f"merge_throughput: the base mixes floating dtypes {sorted(dtypes)}; give a single-dtype base")
    return MERGEKIT_DTYPES[dtypes.pop()]


def warm_page_cache(dirs: list[Path]) -> None:
    for d in dirs:
        for path in d.glob("*.safetensors"):
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


# ---------------------------------------------------------------- the two commands


def mergekit_command(
    base: Path, experts: list[Path], out: Path, work: Path, dtype: str, method: str, device: str = "cpu"
) -> list[str]:
    import yaml

    config = {
        "merge_method": method,
        "base_model": str(base),
        "dtype": dtype,
        "out_dtype": dtype,
        "parameters": {"normalize": True, "lambda": LAMBDA},
        "models": [{"model": str(e), "parameters": {"weight": 1.0, "density": DENSITY}} for e in experts],
    }
    path = work / f"mergekit-{method}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    exe = Path(sys.executable).with_name("mergekit-yaml")
    if not exe.exists():
        sys.exit(f"merge_throughput: {exe} not found; install mergekit (pip install '.[test]')")
    return [str(exe), str(path), str(out), "--copy-tokenizer", "--device", device, "--no-lazy-unpickle", "--quiet"]


def card_inputs(base: Path, experts: list[Path]) -> list[dict]:
    """The model card's input rows with their fingerprints, computed once (the CLI reads them from its cache)."""
    from mergeval.models.fingerprint import fingerprint

    return [
        {"role": role, "source": str(p), "path": str(p), "fingerprint": fingerprint(p)}
        for role, p in [("base", base), *((f"expert {i}", e) for i, e in enumerate(experts))]
    ]


def mergeval_command(
    base: Path, experts: list[Path], out: Path, work: Path, inputs: list[dict], method: str, device: str = "cpu"
) -> list[str]:
    spec = {
        "base": str(base),
        "experts": [str(e) for e in experts],
        "out": str(out),
        "inputs": inputs,
        "method": method,
        "device": device,
    }
    path = work / f"mergeval-{out.name}.json"
    path.write_text(json.dumps(spec))
    return [sys.executable, str(Path(__file__).resolve()), "--child-mergeval", str(path)]


def startup_commands() -> dict[str, list[str]]:
    """Each tool's start alone: its interpreter and imports, no merge."""
    return {
        "mergeval": [
            sys.executable,
            "-c",
            "import atexit; from mergeval.run.cli import skip_final_collection; "
            "atexit.register(skip_final_collection)\n"
            "import mergeval.merge.streaming, mergeval.methods",
        ],
        "mergekit": [str(Path(sys.executable).with_name("mergekit-yaml")), "--help"],
    }


def child_mergeval(spec_path: str) -> None:
    """The mergeval side, run in its own process: one streaming merge to disk, starting and ending as ``python
    -m mergeval.merge`` does (run_cli's exit: the interpreter's last collection skips what the merge made)."""
    import atexit

    from mergeval.merge import merge_to_disk
    from mergeval.methods import get_method
    from mergeval.run.cli import skip_final_collection

    atexit.register(skip_final_collection)
    spec = json.loads(Path(spec_path).read_text())
    method = get_method(spec.get("method", "ties"))
    cfg = method.config(
        density=DENSITY, lambda_=LAMBDA, weights=[1.0] * len(spec["experts"]), weights_before_election=True
    )
    merge_to_disk(
        method,
        cfg,
        Path(spec["base"]),
        [Path(e) for e in spec["experts"]],
        Path(spec["out"]),
        seed=0,
        card={"config": {"method": method.name, "density": DENSITY, "lambda_": LAMBDA}, "inputs": spec["inputs"]},
        device=spec.get("device", "cpu"),
    )


# ---------------------------------------------------------------- measuring one child


def measure(cmd: list[str], log: Path, env: dict[str, str], may_fail: bool = False) -> dict:
    """Wall time, ru_maxrss (wait4) and the polled peak of the summed high-water marks of the process tree.
    ``may_fail``: a run that exits non-zero (mergekit killed for memory at 8B) is a result, returned with its
    ``exit`` code and the time and peak until then; otherwise it ends the benchmark with the run's output."""
    import psutil

    peak = [0]
    # the previous run's output goes to disk now, not during this run: the kernel's writeback of one tool's
    # 0.5-2 GB took CPU time from the next one (a DARE-TIES merge right after writing 540 MB: 5.1-5.7 s of
    # wall time against 3.7-4.9 s after a sync, alternated twice)
    os.sync()
    start = time.perf_counter()
    with open(log, "w") as out:
        # the kernel's out-of-memory killer picks the merge, not this script (the poller's figures survive)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_oom_first)
    done = threading.Event()

    def poll() -> None:
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    total += _vm_hwm_kib(p.pid) * 1024  # 0 once it is gone
            except psutil.NoSuchProcess:
                break
            peak[0] = max(peak[0], total)
            done.wait(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, status, usage = os.wait4(proc.pid, 0)  # rusage of this child and the descendants it waited for
    wall = time.perf_counter() - start
    done.set()
    poller.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 and not may_fail:
        sys.exit(
            f"merge_throughput: `{' '.join(cmd)}` failed (exit {proc.returncode}); its output:\n"
            + log.read_text()[-4000:]
        )
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    maxrss = usage.ru_maxrss * (1 if platform.system() == "Darwin" else 1024)
    result = {"wall_s": wall, "maxrss_mib": maxrss / 2**20, "peak_rss_mib": peak[0] / 2**20}
    if proc.returncode != 0:
        result.update(exit=proc.returncode, output_tail=log.read_text()[-1000:])
    return result


def _oom_first() -> None:
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:  # not Linux
        pass


# ---------------------------------------------------------------- comparing the outputs


def max_abs_diff(a: Path, b: Path) -> dict:
    """Largest |a - b| over the tensors both checkpoints hold (one tensor at a time), and the names only one has."""
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        names = {}
        for path in sorted(d.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                names.update({n: path for n in f.keys()})
        return names

    ia, ib = index(a), index(b)
    worst, worst_name = 0.0, None
    for name in sorted(set(ia) & set(ib)):
        with safe_open(str(ia[name]), framework="pt") as fa, safe_open(str(ib[name]), framework="pt") as fb:
            diff = (fa.get_tensor(name).double() - fb.get_tensor(name).double()).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
    return {
        "max_abs_diff": worst,
        "worst_tensor": worst_name,
        "compared": len(set(ia) & set(ib)),
        "only_mergeval": sorted(set(ia) - set(ib)),
        "only_mergekit": sorted(set(ib) - set(ia)),
    }


# ---------------------------------------------------------------- main


def model_sets(args, work: Path) -> list[tuple[str, Callable[[], tuple[Path, list[Path]]], int]]:
    """(label, a function making or finding base + experts, repeats) for each model set asked for, in order."""
    sets = []
    for name in args.models:
        if name == "quickstart" and args.base:
            sets.append(("given", lambda: (Path(args.base), [Path(e) for e in args.experts]), args.repeats))
        elif name == "quickstart":
            cache = Path(args.cache or os.environ.get("MERGEVAL_CACHE") or _default_cache())
            sets.append(("quickstart", lambda cache=cache: quickstart_models(cache), args.repeats))
        elif name == "smoke":
            sets.append(("smoke", lambda: smoke_models(work / "smoke"), args.repeats))
        else:
            size = name.removeprefix("synthetic-")
            sets.append(
                (
                    name,
                    lambda name=name, size=size: synthetic_set(work, name, size, args),
                    args.synthetic_repeats or args.repeats,
                )
            )
    return sets


def synthetic_set(work: Path, name: str, size: str, args) -> tuple[Path, list[Path]]:
    """The synthetic models under ``--synthetic-dir`` (kept; reused when a previous run finished writing them:
    the last expert's config.json is written last), else written into the work directory (removed after use)."""
    root = Path(args.synthetic_dir) / f"{name}-{args.synthetic_dtype}" if args.synthetic_dir else work / name
    if (root / "expert1" / "config.json").exists():
        return root / "base", [root / "expert0", root / "expert1"]
    if root.exists():
        shutil.rmtree(root)  # an earlier run stopped while writing them
    return synthetic_models(root, size, args.synthetic_dtype)


def run_case(
    base: Path,
    experts: list[Path],
    method: str,
    repeats: int,
    work: Path,
    env: dict,
    inputs: list[dict],
    dtype: str,
    compare: bool = True,
    device: str = "cpu",
) -> dict:
    """Both tools on one model set with one method: each run timed in a fresh process, order alternating.
    ``compare=False``: each output is removed as soon as its run ends (no agreement figure), so the work
    directory holds the three inputs and one output, not two."""
    runs: list[dict] = []
    outputs: dict[str, Path] = {}
    for repeat in range(repeats):
        for tool in TOOLS if repeat % 2 == 0 else TOOLS[::-1]:
            out = work / f"{method}-{tool}-{repeat}"
            cmd = (
                mergeval_command(base, experts, out, work, inputs, method, device)
                if tool == "mergeval"
                else mergekit_command(base, experts, out, work, dtype, method, device)
            )
            result = measure(cmd, work / f"{method}-{tool}-{repeat}.log", env, may_fail=tool == "mergekit")
            runs.append({"tool": tool, "repeat": repeat, **result})
            print(
                f"  {method:9s} run {repeat + 1}/{repeats} {tool:8s} {result['wall_s']:7.2f} s  "
                f"peak RSS {result['peak_rss_mib']:7.0f} MiB"
                + (f"  did not finish (exit {result['exit']})" if "exit" in result else ""),
                flush=True,
            )
            if not compare or "exit" in result:
                shutil.rmtree(out, ignore_errors=True)
                continue
            if tool in outputs:  # keep only each tool's latest output for the comparison
                shutil.rmtree(outputs[tool])
            outputs[tool] = out
    summary = {
        tool: {
            "median_wall_s": statistics.median(r["wall_s"] for r in runs if r["tool"] == tool),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs if r["tool"] == tool),
            "failed_runs": sum("exit" in r for r in runs if r["tool"] == tool),
        }
        for tool in TOOLS
    }
    # mergekit not finishing (killed for memory) is the result the issue asks for: no speed-up is defined then,
    # and the memory ratio is against the peak it had reached when it died (an upper bound on mergeval's share)
    finished = summary["mergekit"]["failed_runs"] == 0
    speedup = summary["mergekit"]["median_wall_s"] / summary["mergeval"]["median_wall_s"] if finished else None
    memory = summary["mergeval"]["peak_rss_mib"] / summary["mergekit"]["peak_rss_mib"]
    agreement = max_abs_diff(outputs["mergeval"], outputs["mergekit"]) if compare and finished else None
    for path in outputs.values():
        shutil.rmtree(path)
    return {
        "method": method,
        "merge": {"density": DENSITY, "lambda": LAMBDA, "weights": [1.0] * len(experts)},
        "repeats": repeats,
        "runs": runs,
        "summary": summary,
        "speedup_mergekit_over_mergeval": speedup,
        "memory_mergeval_over_mergekit": memory,
        "target": {
            "speedup_at_least": TARGET_SPEEDUP,
            "memory_at_most": TARGET_MEMORY,
            "met": bool((speedup is None or speedup >= TARGET_SPEEDUP) and memory <= TARGET_MEMORY),
        },
        "agreement": agreement,
    }


def run(args) -> dict:
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="merge-throughput-", dir=args.workdir))
    env = dict(os.environ)
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    report = {
        "cases": [],
        "threads": args.threads or "default",
        "versions": {
            "mergeval": version("mergeval"),
            "mergekit": version("mergekit"),
            "torch": version("torch"),
            "python": platform.python_version(),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average_at_start": os.getloadavg()},
    }
    cpu_at_start = cpu_ticks()
    try:
        for label, make, repeats in model_sets(args, work):
            print(f"{label}: preparing the models", flush=True)
            base, experts = make()
            dtype = base_dtype(base)
            inputs = card_inputs(base, experts)
            warm_page_cache([base, *experts])
            floor = statistics.median(io_floor(base, experts, work / "io-floor.bin") for _ in range(repeats))
            models = {
                "label": label,
                "base": str(base),
                "experts": [str(e) for e in experts],
                "dtype": dtype,
                "parameters": parameter_count(base),
                "io_floor_s": floor,
            }
            for method in args.method:
                case = run_case(
                    base, experts, method, repeats, work, env, inputs, dtype, not args.no_compare, args.device
                )
                report["cases"].append({"models": models, **case})
                print_case(report["cases"][-1])  # as each case ends: a run cut short still tells what it measured
                if args.json:
                    Path(args.json).write_text(json.dumps(report, indent=2))
            if label.startswith("synthetic") and not args.synthetic_dir:  # gigabytes: gone before the next set
                shutil.rmtree(base.parent, ignore_errors=True)
        if args.startup:
            report["startup"] = {}
            for tool, cmd in startup_commands().items():
                times = [measure(cmd, work / f"{tool}-startup-{i}.log", env) for i in range(args.repeats)]
                report["startup"][tool] = {
                    "median_wall_s": statistics.median(t["wall_s"] for t in times),
                    "peak_rss_mib": max(t["peak_rss_mib"] for t in times),
                }
        report["machine"]["load_average_at_end"] = os.getloadavg()
        report["machine"]["cpu_steal_share"] = steal_share(cpu_at_start, cpu_ticks())
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cpu_ticks() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's first line: user nice system idle iowait irq softirq
    steal ...), or None off Linux."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(start: list[int] | None, end: list[int] | None) -> float | None:
    """steal / (user + nice + system + irq + softirq + steal) between two readings: on a VM, the share of the
    time its CPUs wanted to run that the hypervisor gave to others (it doubled or tripled this script's
    timings on one afternoon while the load average stayed near 2)."""
    if start is None or end is None or len(start) < 8:
        return None
    d = [b - a for a, b in zip(start, end)]
    busy = d[0] + d[1] + d[2] + d[5] + d[6] + d[7]
    return d[7] / busy if busy > 0 else 0.0


def parameter_count(model_dir: Path) -> int:
    from mergeval.merge.reader import CheckpointReader

    reader = CheckpointReader(model_dir, "base")
    return sum(math.prod(s) for s in reader.shapes.values())


def _default_cache() -> str:
    from mergeval.core.paths import cache_root

    return str(cache_root(None))


def print_case(case: dict) -> None:
    m, s = case["models"], case["summary"]
    print(
        f"  {m['label']} {case['method']}: mergeval {s['mergeval']['median_wall_s']:.2f} s "
        f"{s['mergeval']['peak_rss_mib']:.0f} MiB, mergekit {s['mergekit']['median_wall_s']:.2f} s "
        f"{s['mergekit']['peak_rss_mib']:.0f} MiB: {_speedup(case)} at "
        f"{case['memory_mergeval_over_mergekit']:.2f} of its memory; I/O floor {m['io_floor_s']:.2f} s; "
        f"load average now {os.getloadavg()[0]:.1f}",
        flush=True,
    )


def _speedup(case: dict) -> str:
    speedup = case["speedup_mergekit_over_mergeval"]
    return "mergekit did not finish" if speedup is None else f"{speedup:.2f}x"


def print_table(report: dict) -> None:
    print(
        f"\nbase + 2 experts, density {DENSITY}, median wall time (process start included) and peak RSS; "
        f"target: >= {TARGET_SPEEDUP:g}x mergekit's speed at <= {TARGET_MEMORY:.2f} of its peak RSS"
    )
    print(
        f"{'models':16s} {'dtype':9s} {'method':10s} {'runs':>4s} {'mergeval s':>10s} {'MiB':>6s} "
        f"{'mergekit s':>10s} {'MiB':>6s} {'speed-up':>8s} {'memory':>6s} {'I/O floor s':>11s}  target"
    )
    for case in report["cases"]:
        m, s = case["models"], case["summary"]
        name = f"{m['label']} {m['parameters'] / 1e9:.2f}B"
        print(
            f"{name:16s} {m['dtype']:9s} {case['method']:10s} {case['repeats']:4d} "
            f"{s['mergeval']['median_wall_s']:10.2f} {s['mergeval']['peak_rss_mib']:6.0f} "
            f"{s['mergekit']['median_wall_s']:10.2f} {s['mergekit']['peak_rss_mib']:6.0f} "
            f"{_speedup(case):>8s} {case['memory_mergeval_over_mergekit']:6.2f} "
            f"{m['io_floor_s']:11.2f}  {'met' if case['target']['met'] else 'NOT met'}"
        )
    for tool, start in report.get("startup", {}).items():
        print(
            f"{tool} start alone (imports, no merge): {start['median_wall_s']:.2f} s, {start['peak_rss_mib']:.0f} MiB"
        )
    for case in report["cases"]:
        agreement = case["agreement"]
        if agreement is None:
            continue
        note = " (random masks: different draws, compared for scale only)" if case["method"].startswith("dare") else ""
        print(
            f"{case['models']['label']} {case['method']}: max |mergeval - mergekit| over {agreement['compared']} "
            f"tensors: {agreement['max_abs_diff']:.3g}"
            + (f" ({agreement['worst_tensor']})" if agreement["worst_tensor"] else "")
            + note
        )
        for side in ("only_mergeval", "only_mergekit"):
            if agreement[side]:
                print(f"  tensors {side.replace('_', ' in ')}: {agreement[side][:5]}")
    load = report["machine"]
    print(
        f"load average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load['load_average_at_start'])}, "
        f"at end {tuple(round(x, 2) for x in load['load_average_at_end'])}"
        + (
            ""
            if load.get("cpu_steal_share") is None
            else f"; CPU time the hypervisor took (steal) while it ran: {100 * load['cpu_steal_share']:.0f}% of busy time"
        )
    )
    if any(c["models"]["label"] == "smoke" for c in report["cases"]):
        print("(smoke run on tiny models: checks the script; the figures say nothing about throughput)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["quickstart"],
        choices=["quickstart", "smoke", *(f"synthetic-{k}" for k in SYNTHETIC)],
        help="model sets, each base + 2 experts, run one after the other (default: quickstart)",
    )
    parser.add_argument(
        "--cache",
        help="mergeval cache with the quickstart models (default: $MERGEVAL_CACHE or the user cache dir); only read",
    )
    parser.add_argument("--base", help="base checkpoint directory (instead of the quickstart's)")
    parser.add_argument("--experts", nargs="+", help="expert checkpoint directories (with --base)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tool and method (default 3)")
    parser.add_argument(
        "--synthetic-repeats", type=int, help="runs per tool and method on the synthetic models (default: --repeats)"
    )
    parser.add_argument(
        "--synthetic-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the synthetic checkpoints (default bfloat16)",
    )
    parser.add_argument(
        "--synthetic-dir",
        help="keep the synthetic models here and reuse them in later runs "
        "(default: written into the work directory and removed after their cases)",
    )
    parser.add_argument("--threads", type=int, help="OMP/MKL threads for both tools (default: their defaults)")
    parser.add_argument("--workdir", help="where models and outputs are written (default: the system temp dir)")
    parser.add_argument("--json", help="also write the report as JSON to this file")
    parser.add_argument(
        "--method",
        "--methods",
        nargs="+",
        choices=("ties", "dare_ties"),
        default=["ties"],
        help="mergekit's and mergeval's methods, each run on every model set (default ties; density 0.5)",
    )
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="same as --models synthetic-SIZE")
    parser.add_argument("--smoke", action="store_true", help="same as --models smoke: checks the script in seconds")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where both tools merge: cpu, or cuda (mergeval's merge.device, mergekit-yaml's --device)",
    )
    parser.add_argument(
        "--no-compare",
        action="store_true",
        help="remove each output when its run ends (no "
        "agreement figure): a disk that holds three inputs and one output, not two",
    )
    parser.add_argument("--startup", action="store_true", help="also time each tool's start alone (imports only)")
    parser.add_argument("--child-mergeval", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_mergeval:
        child_mergeval(args.child_mergeval)
        return
    if args.smoke or args.synthetic:
        args.models = ["smoke"] if args.smoke else [f"synthetic-{args.synthetic}"]
    if bool(args.base) != bool(args.experts):
        parser.error("--base and --experts go together")
    if args.base and args.models != ["quickstart"]:
        parser.error("--base and --experts replace the quickstart models; leave --models out")
    if args.repeats < 1 or (args.synthetic_repeats is not None and args.synthetic_repeats < 1):
        parser.error("repeats must be at least 1")
    report = run(args)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
