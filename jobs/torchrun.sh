#!/usr/bin/env bash
# commbench with multi-node torchrun (c10d rendezvous). Start this script once on
# every node, with the same variables (e.g. by pdsh, or your scheduler's per-node launch):
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29500 RDZV_ID=cb1 bash jobs/torchrun.sh
# torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, which
# commbench reads. Global rank 0 writes the results files into $OUT_DIR (a folder
# on a filesystem shared by the nodes, or on the node that gets rank 0); nothing
# here parses logs.
#
# Variables (edit here or set them in the environment):
#   NNODES          nodes taking part (torchrun --nnodes)
#   NPROC_PER_NODE  ranks per node: one per GPU (torchrun --nproc-per-node)
#   RDZV_ENDPOINT   host:port of the rendezvous, reachable from every node (e.g. the first node, port 29500)
#   RDZV_ID         a job id, the same on every node and unique per job
#   TORCHRUN        the torchrun to use (e.g. .venv/bin/torchrun); its python must have commbench installed
#   TORCHRUN_ARGS   extra torchrun flags (e.g. "--rdzv-conf join_timeout=1800")
#   COMMBENCH       how to start commbench without torchrun (the report)
#   COLLECTIVES     collectives of the sweep, comma-separated, or all
#   LAYOUTS         group layouts of the sweep: world, intra, inter, "MOD k", "DIV k"
#   SIZES           size flags of the sweep (nccl-tests style)
#   RUN_ARGS        more flags for the sweep (e.g. "-d float32,bf16", "-n 50", "-q")
#   PLAN            plan flags (e.g. "--model gpt3-1.3b --tp 8 --global-batch 64"): also measure that
#                   plan's collectives (run --plan) and kernels (compute); empty = sweep only
#   OUT_DIR         where the results files go (the same path on every node)
#   REPORT          1 = write an HTML/markdown report into $OUT_DIR/report (set it on one node only)
set -euo pipefail
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-2}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-127.0.0.1:29500}
RDZV_ID=${RDZV_ID:-commbench}
TORCHRUN=${TORCHRUN:-torchrun}
TORCHRUN_ARGS=${TORCHRUN_ARGS:-}
COMMBENCH=${COMMBENCH:-commbench}
COLLECTIVES=${COLLECTIVES:-all}
LAYOUTS=${LAYOUTS:-world,intra,inter}
SIZES=${SIZES:-"-b 8 -e 256M -f 2"}
RUN_ARGS=${RUN_ARGS:-}
PLAN=${PLAN:-}
OUT_DIR=${OUT_DIR:-results/torchrun-$RDZV_ID}
REPORT=${REPORT:-0}

mkdir -p "$OUT_DIR"
step() {   # one torchrun per step, each with its own rendezvous id
    local id=$1; shift
    # shellcheck disable=SC2086  # word splitting of the flag strings is intended
    "$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d \
        --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID-$id" $TORCHRUN_ARGS -m commbench "$@"
}

# shellcheck disable=SC2086
step sweep run --collective "$COLLECTIVES" --groups "$LAYOUTS" $SIZES $RUN_ARGS --out "$OUT_DIR/sweep.jsonl"
if [ -n "$PLAN" ]; then
    # shellcheck disable=SC2086
    step plan run $PLAN -q --out "$OUT_DIR/plan-comm.jsonl"
    # shellcheck disable=SC2086
    step compute compute $PLAN -q --out "$OUT_DIR/compute.jsonl"
fi
if [ "$REPORT" = 1 ]; then
    # shellcheck disable=SC2086
    $COMMBENCH report "$OUT_DIR"/*.jsonl --out "$OUT_DIR/report" \
        --title "commbench: $NNODES nodes x $NPROC_PER_NODE ranks (torchrun)"
fi
echo "results: $OUT_DIR"
