"""Peak memory of a whole run (merge + evaluation) against the number of experts.

Builds synthetic Llama checkpoints (random bf16 weights, the tiny zoo's tokenizer; a base and up to six
experts = base + 1% noise) once, then runs ``python -m mergeval`` on the tiny benchmark with 2, 4 and 6 of the
experts, each run a fresh process whose peak resident set size (VmHWM) is polled from /proc every 50 ms
(Linux only). Each run gets a fresh cache and results store, so every model is really merged and evaluated
(``--shared-store``: one store, each constituent evaluated once across the runs, every merge in its own run).
``--size 3b`` builds Llama-3.2-3B's exact layout instead (its 128K vocabulary, the tiny tokenizer's ids a
subset), ``--task`` and ``--limit`` evaluate one quickstart task's items.

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
    python benchmarks/run_memory.py --size 3b --experts 1,2,4 --task mergeval_chem_count --limit 200 \\
        --shared-store --method ties --backend shared_prefix   # issue 56's whole run at Llama-3.2-3B's
        # shapes: 200 items of one task; the store shared, so each constituent is evaluated once across the
        # three runs (each run merges and evaluates its own merge). About 6.4 GB of disk per checkpoint.

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

work, experts, size = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
layers, hidden, intermediate = map(int, sys.argv[5:8])
if size:  # a paper model's exact layout (merge_throughput.SYNTHETIC): its vocabulary, tied or not
    from merge_throughput import synthetic_models
    root = work / "models"
    dirs = [root / "base", *(root / f"expert{i}" for i in range(experts))]
    if not (dirs[-1] / "config.json").exists():  # else a --work that has them, written whole (config.json last)
        shutil.rmtree(root, ignore_errors=True)
        synthetic_models(root, size, "bfloat16", experts)
else:
    tiny = zoo_dir("tiny", cache_root(str(work / "zoo-cache")))
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    config, shapes = llama_specs(layers, hidden, intermediate, vocab, heads=hidden // 64)
    dirs = [work / role for role in ["base"] + [f"e{i}" for i in range(experts)]]
    for k, out in enumerate(dirs):
        write_checkpoint(out, config, shapes, torch.bfloat16, k or None)
        for f in tiny.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, out / f.name)
import math
from safetensors import safe_open
params = 0
for f in dirs[0].glob("*.safetensors"):
    with safe_open(f, "pt") as st:
        params += sum(math.prod(st.get_slice(n).get_shape()) for n in st.keys())
print(json.dumps({"parameters": params, "models": [str(d) for d in dirs]}))
"""


def modelset_yaml(work: Path, models: list[Path], experts: int, tasks: list[str]) -> Path:
    """A config dir with modelset ``synthetic<experts>``: the base (``models[0]``) and the first ``experts``
    experts, each scored on one of ``tasks`` in turn."""
    lines = [
        "defaults:",
        "  - modelset_schema",
        "  - _self_",
        f"name: synthetic{experts}",
        f"base: {models[0]}",
        "experts:",
    ]
    for i in range(experts):
        lines += [f"  e{i}:", f"    source: {models[1 + i]}", f"    task: {tasks[i % len(tasks)]}"]
    conf = work / "conf" / "modelset"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / f"synthetic{experts}.yaml").write_text("\n".join(lines) + "\n")
    return work / "conf"


TINY_TASKS = ["mergeval_chem_count", "mergeval_unit_convert"]  # the experts' tasks on the tiny benchmark


def run(
    work: Path,
    models: list[Path],
    experts: int,
    code: Path | None,
    device: str,
    dtype: str,
    keep: Path | None = None,
    task: str | None = None,
    limit: int = 4,
    store: Path | None = None,
    method: str = "task_arithmetic",
    backend: str | None = None,
) -> dict:
    """One run in a fresh process: its peak RSS (VmHWM polled, KiB), peak GPU memory where it ran on one, and
    wall time. ``task``: the quickstart benchmark's 200-item task, alone, every expert scored on it (else the
    tiny benchmark's three tasks); ``limit`` items of each. ``store``: a results store (and cache) shared by
    the runs, so a constituent is evaluated once across them as in a sweep (else each run has its own)."""
    fresh = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    conf = modelset_yaml(fresh, models, experts, [task] if task else TINY_TASKS)
    shared = store or fresh
    benchmark = ["benchmark=quickstart", f"benchmark.tasks=[{task}]"] if task else []
    cmd = [
        sys.executable,
        "-m",
        "mergeval",
        "+experiment=tiny",
        f"modelset=synthetic{experts}",
        f"method={method}",
        f"hydra.searchpath=[file://{conf}]",
        *benchmark,
        f"benchmark.limit={limit}",
        f"eval.dtype={dtype}",
        *([f"eval.backend={backend}"] if backend else []),
        "eval.batch_size=8",
        f"eval.device={device}",
        f"cache_dir={shared / 'cache'}",
        f"store.path={shared / 'r.sqlite'}",
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
    parser.add_argument(
        "--size",
        choices=["0.5b", "1b", "3b", "8b"],
        help="a paper model's exact layout (merge_throughput.py's synthetic-SIZE: Llama-3.2-3B's at 3b, its 128K "
        "vocabulary and tied embedding) instead of --layers/--hidden/--intermediate",
    )
    parser.add_argument("--method", default="task_arithmetic", help="the merge method (default task_arithmetic)")
    parser.add_argument("--task", help="evaluate this quickstart task alone (e.g. mergeval_chem_count, 200 items)")
    parser.add_argument("--limit", type=int, default=4, help="items per task (default 4)")
    parser.add_argument(
        "--shared-store",
        action="store_true",
        help="one results store for the runs: each constituent evaluated once across them, as in a sweep",
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models are evaluated")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="eval.dtype (default: the device's)")
    parser.add_argument("--backend", choices=["hflm", "shared_prefix"], help="eval.backend (default: the dtype's)")
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
                args.size or "",
                str(args.layers),
                str(args.hidden),
                str(args.intermediate),
            ],
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            raise SystemExit(built.stderr[-3000:])
        made = json.loads(built.stdout.splitlines()[-1])
        params, models = made["parameters"], [Path(m) for m in made["models"]]
        size = sum(f.stat().st_size for f in models[0].glob("*.safetensors"))
        dtype = args.dtype or auto_dtype(args.device)
        print(
            f"synthetic Llama: {params / 1e6:.0f}M parameters, one checkpoint {size / 2**20:.0f} MiB (bf16); "
            f"evaluated on {args.device} in {dtype} (one model in memory: "
            f"{params * (2 if dtype == 'bfloat16' else 4) / 2**20:.0f} MiB of weights)"
        )
        rows = []
        for code in [None] + ([args.code] if args.code else []):
            store = Path(tempfile.mkdtemp(dir=work, prefix="store-")) if args.shared_store else None
            for n in counts:
                rows.append(
                    run(
                        work,
                        models,
                        n,
                        code,
                        args.device,
                        dtype,
                        args.keep,
                        args.task,
                        args.limit,
                        store,
                        args.method,
                        args.backend,
                    )
                )
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
