"""Peak memory of a whole run (merge + evaluation) against the number of experts.

Builds synthetic Llama checkpoints (random bf16 weights, the tiny zoo's tokenizer; a base and up to six
experts = base + 1% noise) once, then runs ``python -m mergeval`` on the tiny benchmark with 2, 4 and 6 of the
experts, each run a fresh process whose peak resident set size (VmHWM) is polled from /proc every 50 ms
(Linux only). Each run gets a fresh cache and results store, so every model is really merged and evaluated.

A run that holds one model at a time (the streamed merge into a live model, constituents loaded and released
one by one) has a peak that is flat in the number of experts; one that loads every checkpoint first grows by
one checkpoint per expert. ``--device cuda`` evaluates on the GPU and adds the run's peak GPU memory
(result.json's ``device_memory``: torch's allocator peak), which must be flat in the number of experts too.
``--code DIR`` runs another checkout's mergeval (e.g. an older commit, via
``git worktree add``) with the same models, for the side-by-side table.

    python benchmarks/run_memory.py                      # ~0.27B parameters, 2/4/6 experts, a few minutes
    python benchmarks/run_memory.py --code /tmp/old      # the same runs with another checkout's code too
    python benchmarks/run_memory.py --layers 2 --hidden 256 --intermediate 512   # seconds (smoke)
    python benchmarks/run_memory.py --device cuda        # on a GPU machine: peak RSS and peak GPU memory
    python benchmarks/run_memory.py --dtype bfloat16 --code /tmp/old --keep /tmp/results   # the bfloat16 path,
        # against another checkout, each run's result.json kept (the scores and fingerprints must agree)

Run it from outside the checkout when ``--code`` is given: ``python -m mergeval`` puts the working directory
first on sys.path, so from inside it every run would import this checkout's mergeval.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
from mergeval.core.precision import auto_dtype  # noqa: E402

# evaluated in mergeval's default precision for the device: bfloat16 where it runs natively, else float32 (where
# bfloat16 products are many times slower; mergeval/core/precision.py). float32 doubles the live model's bytes.

BUILD = """
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from merge_memory import llama_specs, write_checkpoint
from mergeval.core.paths import cache_root
from mergeval.models.zoo.tiny import zoo_dir

work, experts, layers, hidden, intermediate = Path(sys.argv[2]), int(sys.argv[3]), *map(int, sys.argv[4:7])
tiny = zoo_dir("tiny", cache_root(str(work / "zoo-cache")))
vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
config, shapes = llama_specs(layers, hidden, intermediate, vocab, heads=hidden // 64)
for k, role in enumerate(["base"] + [f"e{i}" for i in range(experts)]):
    out = work / role
    write_checkpoint(out, config, shapes, torch.bfloat16, None if role == "base" else k)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
print(sum(t.numel() for t in [torch.empty(s, device="meta") for s in shapes.values()]))
"""


def modelset_yaml(work: Path, experts: int) -> Path:
    """A config dir with modelset ``synthetic<experts>``: the base and the first ``experts`` experts, each
    scored on one of the tiny benchmark's tasks in turn."""
    tasks = ["mergeval_chem_count", "mergeval_unit_convert"]
    lines = [
        "defaults:",
        "  - modelset_schema",
        "  - _self_",
        f"name: synthetic{experts}",
        f"base: {work / 'base'}",
        "experts:",
    ]
    for i in range(experts):
        lines += [f"  e{i}:", f"    source: {work / f'e{i}'}", f"    task: {tasks[i % len(tasks)]}"]
    conf = work / "conf" / "modelset"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / f"synthetic{experts}.yaml").write_text("\n".join(lines) + "\n")
    return work / "conf"


def run(work: Path, experts: int, code: Path | None, device: str, dtype: str, keep: Path | None = None) -> dict:
    """One run in a fresh process: its peak RSS (VmHWM polled, KiB), peak GPU memory where it ran on one, and
    wall time."""
    fresh = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    conf = modelset_yaml(work, experts)
    cmd = [
        sys.executable,
        "-m",
        "mergeval",
        "+experiment=tiny",
        f"modelset=synthetic{experts}",
        f"hydra.searchpath=[file://{conf}]",
        "benchmark.limit=4",
        f"eval.dtype={dtype}",
        "eval.batch_size=8",
        f"eval.device={device}",
        f"cache_dir={fresh / 'cache'}",
        f"store.path={fresh / 'r.sqlite'}",
        f"hydra.run.dir={fresh / 'job'}",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])  # first
    began = time.perf_counter()
    logs = fresh / "out.txt"
    with open(logs, "w") as log:
        child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak_kib = 0
        while child.poll() is None:  # VmHWM = max(high-water mark, current RSS) at each read
            peak_kib = max(peak_kib, _vm_hwm_kib(child.pid))
            time.sleep(0.05)
    seconds = time.perf_counter() - began
    out = logs.read_text()
    if child.returncode != 0:
        raise SystemExit(f"run with {experts} experts failed:\n{out[-3000:]}")
    gpu = json.loads((fresh / "job" / "result.json").read_text()).get("device_memory")  # None: CPU, or older code
    if keep is not None:  # the run's result.json, to compare the scores of two checkouts
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(fresh / "job" / "result.json", keep / f"{Path(code or 'this').name}-{experts}.json")
    shutil.rmtree(fresh, ignore_errors=True)
    return {
        "experts": experts,
        "code": str(code or "this checkout"),
        "peak_rss_mib": round(peak_kib / 1024),
        "peak_gpu_allocated_mib": gpu and gpu["allocated_mib"],
        "peak_gpu_reserved_mib": gpu and gpu["reserved_mib"],
        "wall_s": round(seconds, 1),
        "table": "Macro-Gain" in out,
    }


def _vm_hwm_kib(pid: int) -> int:
    """The process's peak resident set so far (Linux). Polled rather than read from wait4's ru_maxrss: the
    kernel updates the high-water mark lazily, and memory handed back with madvise (glibc's free and
    malloc_trim) lowers the RSS without updating it, so ru_maxrss at exit missed peaks of 3 GB here."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return max(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith(("VmHWM:", "VmRSS:"))), default=0
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", default="2,4,6")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models are evaluated")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="eval.dtype (default: the device's)")
    parser.add_argument("--keep", type=Path, help="copy each run's result.json into this directory")
    parser.add_argument("--code", type=Path, help="also run this checkout's mergeval (PYTHONPATH) on the same models")
    parser.add_argument("--work", type=Path, help="where to build the models (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.experts.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="mergeval-run-memory-"))
    try:
        built = subprocess.run(
            [
                sys.executable,
                "-c",
                BUILD,
                str(HERE),
                str(work),
                str(max(counts)),
                str(args.layers),
                str(args.hidden),
                str(args.intermediate),
            ],
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            raise SystemExit(built.stderr[-3000:])
        params = int(built.stdout.split()[-1])
        size = sum(f.stat().st_size for f in (work / "base").glob("*.safetensors"))
        dtype = args.dtype or auto_dtype(args.device)
        print(
            f"synthetic Llama: {params / 1e6:.0f}M parameters, one checkpoint {size / 2**20:.0f} MiB (bf16); "
            f"evaluated on {args.device} in {dtype} (one model in memory: "
            f"{params * (2 if dtype == 'bfloat16' else 4) / 2**20:.0f} MiB of weights)"
        )
        rows = []
        for code in [None] + ([args.code] if args.code else []):
            for n in counts:
                rows.append(run(work, n, code, args.device, dtype, args.keep))
                row = rows[-1]
                gpu = (
                    f"  peak GPU {row['peak_gpu_allocated_mib']:>7} MiB allocated, {row['peak_gpu_reserved_mib']} "
                    "reserved"
                    if row["peak_gpu_allocated_mib"] is not None
                    else ""
                )
                print(
                    json.dumps(row)
                    if args.json
                    else f"{row['code']:>20}  experts={n}  peak RSS {row['peak_rss_mib']:>6} MiB  "
                    f"({row['peak_rss_mib'] * 2**20 / size:.2f} checkpoints){gpu}  {row['wall_s']} s",
                    flush=True,
                )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
