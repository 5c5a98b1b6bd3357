#!/usr/bin/env bash
# The GPU checks of issue 56, as one script for a machine with one CUDA GPU and the test extra installed
# (pip install '.[test]'): run from the checkout's root; writes its figures under ${OUT:-gpu-check}/.
#   1. the tests that need CUDA (tests/test_gpu.py: merges on the GPU against the CPU's bits, merge-only's
#      peak GPU memory against the largest tensor, a run evaluated and merged on the GPU);
#   2. the synthetic Llama-3.2-3B merge (base + 2 experts, bfloat16) on the GPU, mergeval's merge.device=cuda
#      against mergekit-yaml --device cuda, TIES and DARE-TIES, one run each;
#   3. a one-job-per-GPU sweep where the machine has several GPUs (hydra/launcher=parallel).
# Meant to end within 8 minutes on one H100 (not yet run on a GPU: no session has had one since it was written);
# the 3B models take about 19 GB of disk while it runs.
set -euo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'; print(torch.__version__)"
python -m pytest -q -n 0 -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/test_gpu.txt"
python benchmarks/merge_throughput.py --models synthetic-3b --method ties dare_ties --repeats 1 --device cuda \
    --no-compare --json "$out/merge_3b_cuda.json" 2>&1 | tee "$out/merge_3b_cuda.txt"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 1 ]; then
    python -m mergeval -m +experiment=tiny hydra/launcher=parallel method.lambda_=0.5,0.8,1.0,1.2 \
        hydra.sweep.dir="$out/sweep" 2>&1 | tee "$out/sweep.txt"
    grep -h '"device"' "$out"/sweep/*/result.json | sort | uniq -c | tee "$out/sweep_devices.txt"
fi
echo "gpu_check: done; figures in $out/"
