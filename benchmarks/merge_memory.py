"""Peak memory of the streaming merge vs model size.

Builds synthetic Llama checkpoints (random weights, written tensor by tensor as
safetensors in a temporary directory) at several depths with the same width
and vocabulary, so the largest single tensor (the embedding) is the same at
every size while the parameter count grows. Each size is a base and two
experts (base + small noise); a TIES merge of the three runs through
``mergeval.merge.merge_to_disk`` (what ``python -m mergeval.merge`` runs) in a
fresh subprocess, which reports its own peak resident set size (VmHWM; see CHILD).

Per size it prints: parameters, one checkpoint's bytes, the largest tensor's
bytes, the child's resident memory after importing torch and mergeval
(baseline), its peak RSS (imports included), and
(peak - baseline) / (largest tensor x inputs). If memory were
bounded by model size, peak - baseline would grow with the checkpoint bytes;
bounded by the largest tensor, it stays flat.

    python benchmarks/merge_memory.py            # 4 sizes, 66M..301M parameters (bf16), a few minutes on 2 cores
    python benchmarks/merge_memory.py --smoke    # tiny sizes, seconds
    python benchmarks/merge_memory.py --json     # one JSON object per line instead of the table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

INPUTS = 3  # base + 2 experts

# The child's peak is VmHWM (the high-water mark of its own address space, reset by exec), not
# ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child's ru_maxrss starts at its
# parent's resident size (here several hundred MB of transformers) and would hide the merge.
CHILD = """
import json, resource, sys, time
from pathlib import Path


def status_kib(key):
    path = Path("/proc/self/status")
    if not path.exists():  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS) is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(next(l for l in path.read_text().splitlines() if l.startswith(key + ":")).split()[1])


from mergeval.merge import merge_to_disk
from mergeval.methods import get_method

base, e1, e2, out = map(Path, sys.argv[1:5])
baseline = status_kib("VmRSS")  # resident after importing torch and mergeval
method = get_method("ties")
start = time.perf_counter()
merge_to_disk(method, method.config(density=0.5), base, {"a": e1, "b": e2}, out, seed=0)
seconds = time.perf_counter() - start
print(json.dumps({"baseline_kib": baseline, "peak_kib": status_kib("VmHWM"), "merge_s": round(seconds, 2)}))
"""


def llama_specs(layers: int, hidden: int, intermediate: int, vocab: int, heads: int):
    """(config, {tensor name: shape}) of a Llama with tied embeddings, from a meta-device model (no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items() if n != "lm_head.weight"}
    return config, dict(sorted(shapes.items()))


def tensor_seed(seed: int, name: str) -> int:
    """63-bit generator seed = the first 8 bytes (little-endian) of sha256("<seed>:<name>")."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def write_checkpoint(out: Path, config, shapes: dict, dtype: torch.dtype, expert: int | None) -> None:
    """Random base weights (seeded per tensor name); an expert adds 1% noise from its own seed.

    Written one tensor at a time with mergeval's streaming writer, in 256 MB shards
    (so the reader's index path is exercised for the larger sizes)."""
    from mergeval.merge.writer import ShardWriter

    out.mkdir(parents=True)
    config.save_pretrained(out)
    writer = ShardWriter(out, {n: (s, dtype) for n, s in shapes.items()}, shard_size=256 * 2**20)
    for name, shape in shapes.items():
        t = 0.02 * torch.randn(shape, generator=torch.Generator().manual_seed(tensor_seed(0, name)))
        if expert is not None:
            t += 0.0002 * torch.randn(shape, generator=torch.Generator().manual_seed(tensor_seed(expert, name)))
        writer.write(name, t.to(dtype))
    writer.finish()


def measure(
    layers: int, hidden: int, intermediate: int, vocab: int, heads: int, dtype: torch.dtype, work: Path
) -> dict:
    config, shapes = llama_specs(layers, hidden, intermediate, vocab, heads)
    dirs = [work / f"L{layers}-{role}" for role in ("base", "a", "b")]
    for d, expert in zip(dirs, (None, 1, 2)):
        write_checkpoint(d, config, shapes, dtype, expert)
    out = work / f"L{layers}-merged"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, dirs), str(out)], capture_output=True, text=True, check=False
    )
    if child.returncode != 0:
        raise SystemExit(f"merge of {layers} layers failed:\n{child.stderr[-3000:]}")
    got = json.loads(child.stdout.strip().splitlines()[-1])
    params = sum(_numel(s) for s in shapes.values())
    largest = max(_numel(s) for s in shapes.values()) * dtype.itemsize
    for d in [*dirs, out]:  # keep the temporary disk use to one size at a time
        _rmtree(d)
    peak, baseline = got["peak_kib"] * 1024, got["baseline_kib"] * 1024
    return {
        "layers": layers,
        "params": params,
        "checkpoint_bytes": params * dtype.itemsize,
        "largest_tensor_bytes": largest,
        "baseline_rss": baseline,
        "peak_rss": peak,
        "peak_over_largest_x_inputs": peak / (largest * INPUTS),
        "merge_rss_over_largest_x_inputs": (peak - baseline) / (largest * INPUTS),
        "merge_s": got["merge_s"],
    }


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--layers", help="comma-separated depths (default 2,4,8,16)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    args = parser.parse_args(argv)
    small = dict(hidden=64, intermediate=256, vocab=1024, heads=4)
    full = dict(hidden=1024, intermediate=4096, vocab=32000, heads=16)
    shape = {k: getattr(args, k) or v for k, v in (small if args.smoke else full).items()}
    layers = [int(x) for x in (args.layers or "2,4,8,16").split(",")]
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mergeval-memory-") as tmp:
        for n in layers:
            rows.append(measure(n, dtype=dtype, work=Path(tmp), **shape))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        mib = 2**20
        print(
            f"TIES merge of base + 2 experts, {args.dtype}, hidden {shape['hidden']}, "
            f"vocab {shape['vocab']} ({time.perf_counter() - start:.0f} s)"
        )
        print(
            f"{'layers':>6} {'params':>12} {'ckpt MiB':>9} {'largest MiB':>11} {'base RSS':>9} {'peak RSS':>9} "
            f"{'peak-base':>9} {'(peak-base)/(largest x 3)':>26} {'merge s':>8}"
        )
        for r in rows:
            print(
                f"{r['layers']:>6} {r['params']:>12,} {r['checkpoint_bytes'] / mib:>9.1f} "
                f"{r['largest_tensor_bytes'] / mib:>11.1f} {r['baseline_rss'] / mib:>9.1f} "
                f"{r['peak_rss'] / mib:>9.1f} {(r['peak_rss'] - r['baseline_rss']) / mib:>9.1f} "
                f"{r['merge_rss_over_largest_x_inputs']:>26.2f} {r['merge_s']:>8.1f}"
            )
        print(
            f"params grow {rows[-1]['params'] / rows[0]['params']:.1f}x; "
            f"peak RSS grows {rows[-1]['peak_rss'] / rows[0]['peak_rss']:.2f}x (RSS in MiB)"
        )


if __name__ == "__main__":
    main()
