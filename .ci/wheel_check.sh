#!/usr/bin/env bash
# Build an sdist and a wheel, install the wheel into a fresh virtual environment outside the
# repository, and run each README snippet (examples/*.py) from a temporary folder on two CPU
# processes, checking what it prints, and the planner. Called by .ci/run.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip install --quiet build
python -m build --sdist --wheel --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
ls "$work/dist"/*.tar.gz "$work/dist"/*.whl
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "torch==2.13.0"
"$work/venv/bin/python" -m pip install --quiet "$work/dist"/*.whl
mkdir "$work/run"
cp "$repo"/examples/*.py "$work/run/"
cd "$work/run"
export PATH="$work/venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONPATH=
python -c "import hf_zeroone, sys; assert '$repo' not in hf_zeroone.__file__, hf_zeroone.__file__; print('installed at', hf_zeroone.__file__)"
check() {  # check OUTPUT_FILE TEXT...
    local out="$1"; shift
    for text in "$@"; do grep -qF -- "$text" "$out" || { echo "wheel check: '$text' not in:"; tail -n 40 "$out"; exit 1; }; done
}
torchrun --standalone --nproc_per_node 2 ddp_loop.py > ddp.txt 2>&1 || { tail -n 40 ddp.txt; exit 1; }
check ddp.txt "exact" "onebit_gradient" "local" "onebit_sync"
torchrun --standalone --nproc_per_node 2 trainer.py > trainer.txt 2>&1 || { tail -n 40 trainer.txt; exit 1; }
check trainer.txt "'comm/bytes_total'" "'comm/compression_ratio'" "'comm/hook': 1"
ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
    --dynamo_backend no accelerate_loop.py > accelerate.txt 2>&1 || { tail -n 40 accelerate.txt; exit 1; }
check accelerate.txt "epoch 2: " " bytes sent" "replicas in sync: True"
python -m hf_zeroone.plan --model bert-tiny --batch-size 2 --seq-len 16 --repeats 1 --steps 1000 > plan.txt 2>&1 \
    || { tail -n 40 plan.txt; exit 1; }
check plan.txt "| 1-bit Adam + hook |" "1-bit Adam is faster than DDP fp32 below"
echo "wheel check: the wheel installs and runs the README snippets outside the repository"
