#!/usr/bin/env bash
# The GPU checks of one session, in one go (for the lent GPU machine, or any
# GPU node): the GPU tests, the custom kernels' bandwidth, the compute of
# gpt3-6.7b at tp 1, and NCCL sweeps. Prints everything; results under $OUT.
#   bash jobs/device_check.sh            (OUT=dir to choose where results go)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device-check-$(date +%Y%m%d-%H%M%S)}
PY=${PY:-python3}
mkdir -p "$OUT"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check: no CUDA device visible to torch" >&2
    exit 2
fi
$PY -m pip install -q -e '.[gpu]' 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
echo "== GPU tests"
$PY -m pytest -q -m gpu tests 2>&1 | tail -15
echo "== kernels: HBM copy/triad bandwidth"
$PY -m commbench run --backend kernels -b 64M -e 1G -f 4 --out "$OUT/kernels.jsonl"
echo "== compute: gpt3-6.7b tp 1, bf16 (GEMM TFLOPS against the peak)"
$PY -m commbench compute --model gpt3-6.7b --tp 1 --micro-batch 1 --seq 2048 --dtype bf16 --device cuda \
    --out "$OUT/compute-gpt3-6.7b.jsonl"
echo "== NCCL sweep on the visible GPUs"
$PY -m commbench run --device cuda --collective all -b 8 -e 256M -f 4 --out "$OUT/nccl.jsonl"
echo "results: $OUT"
