#!/usr/bin/env bash
# End-to-end check of the GPU / NCCL path on one machine with 2+ GPUs (docs/gpu.md).
#   bash tests/scripts/gpu_smoke.sh            # 2 GPUs
#   NPROC=4 bash tests/scripts/gpu_smoke.sh    # 4 GPUs: also data-parallel sub-groups (2 x 2)
#   bash tests/scripts/gpu_smoke.sh            # 1 GPU: the single-GPU checks only (tests, kernels, step time)
# 1. the GPU tests (tests/gpu: kernels vs CPU bit for bit, streams, optimizers, NCCL on 2+ GPUs);
# 2. training on NCCL and on gloo CPU ranks (replicas bit-identical, bytes as accounted), compared
#    (loss as on CPU); 3. the kernel benchmark with the BERT-base overhead. Exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC="${NPROC:-2}"
STEPS="${STEPS:-40}"
OUT="${OUT:-gpu_smoke_out}"
mkdir -p "$OUT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
python - <<'PY'
import torch, sys
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(n)))
sys.exit(0 if n >= 1 else "gpu_smoke.sh needs a CUDA GPU (2 or more for the NCCL training runs)")
PY
python -m pytest -q -rs tests/gpu tests/test_device_path.py 2>&1 | tee "$OUT/pytest.txt"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
    echo "gpu_smoke: one GPU, so the NCCL training runs (2 ranks) are left out; the single-GPU checks follow"
    python recipes/bench_kernels.py --device cuda --bert --json "$OUT/bench.json" | tee "$OUT/bench.txt"
    python recipes/bench_step.py --device cuda --fused | tee "$OUT/bench_step.txt"
    echo "gpu_smoke: the single-GPU checks passed; outputs in $OUT/ (NCCL not run: it needs 2 GPUs)"
    exit 0
fi
torchrun --standalone --nproc_per_node "$NPROC" tests/scripts/gpu_smoke.py --device cuda --steps "$STEPS" --out "$OUT/cuda.json" \
    2>&1 | tee "$OUT/cuda.txt"
torchrun --standalone --nproc_per_node "$NPROC" tests/scripts/gpu_smoke.py --device cpu --steps "$STEPS" --out "$OUT/cpu.json" \
    2>&1 | tee "$OUT/cpu.txt"
python tests/scripts/gpu_smoke.py --compare "$OUT/cuda.json" "$OUT/cpu.json" | tee "$OUT/compare.txt"
python recipes/bench_kernels.py --device cuda --bert --json "$OUT/bench.json" | tee "$OUT/bench.txt"
echo "gpu_smoke: all checks passed; outputs in $OUT/"
