#!/usr/bin/env bash
# The GPU checks of one session, in one go (for a lent GPU machine, or any GPU
# node): the GPU tests, the custom kernels' bandwidth, an NCCL sweep on the
# visible GPUs, the compute of gpt3-6.7b at tp 1, and a real training step
# validated against its prediction. Each part runs under its own time limit
# and a failing part does not stop the next; a summary of the parts' exit
# codes and times ends the output. Results go to $OUT.
#   bash jobs/device_check.sh          (OUT=dir, PY=python, SECTIONS="tests kernels ...")
# The node brings its own CUDA torch and cupy; nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device-check-$(date +%Y%m%d-%H%M%S)}
PY=${PY:-python3}
SECTIONS=${SECTIONS:-"tests kernels nccl compute validate validate-fsdp"}
mkdir -p "$OUT"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check: no CUDA device visible to torch" >&2
    exit 2
fi
# commbench from this checkout where the python has none installed (the tests start
# `python -m commbench` in other folders)
(cd / && $PY -c "import commbench" 2>/dev/null) || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
$PY -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1

summary=()
part() {   # part NAME SECONDS COMMAND...: run COMMAND under a time limit, record its exit code
    local name=$1 limit=$2; shift 2
    case " $SECTIONS " in *" $name "*) ;; *) return ;; esac
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    summary+=("$name rc=$rc $((SECONDS - t0))s")
}

part tests 180 $PY -m pytest -q -m gpu -p no:cacheprovider -rs --tb=short tests
part kernels 40 $PY -m commbench run --backend kernels -b 64M -e 1G -f 4 --out "$OUT/kernels.jsonl"
part nccl 40 $PY -m commbench run --device cuda --collective all -d bf16 -b 8 -e 1G -f 64 --time-budget 0.2 \
    --out "$OUT/nccl.jsonl"
part compute 70 $PY -m commbench compute --model gpt3-6.7b --tp 1 --micro-batch 1 --seq 2048 --dtype bf16 \
    --device cuda --time-budget 0.2 --out "$OUT/compute-gpt3-6.7b.jsonl"
part validate 90 $PY -m commbench validate --model gpt3-1.3b --global-batch 8 --micro-batch 2 --dtype bf16 \
    --device cuda --nprocs 1 --steps 20 --time-budget 0.2 --out-dir "$OUT/validate-gpt3-1.3b"
part validate 60 $PY -m commbench validate --model gpt3-350m --global-batch 8 --micro-batch 2 --dtype bf16 \
    --device cuda --nprocs 1 --steps 20 --time-budget 0.2 --out-dir "$OUT/validate-gpt3-350m"
part validate-fsdp 40 $PY -m commbench validate --model small-gpt --global-batch 8 --micro-batch 2 --zero 3 \
    --dtype bf16 --device cuda --nprocs 1 --steps 10 --time-budget 0.2 --out-dir "$OUT/validate-small-zero3"

echo "== summary"
printf '%s\n' "${summary[@]}"
echo "results: $OUT"
