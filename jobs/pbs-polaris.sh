#!/usr/bin/env bash
#PBS -N commbench
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=0:30:00
#PBS -l filesystems=home:eagle
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# commbench under PBS Pro with mpiexec (Cray PALS), Polaris-style nodes: 4 GPUs
# and 32 cores per node, one rank per GPU with 8 cores each, bound by depth.
# Edit the #PBS lines (select=NODES, queue, project -A, filesystems) and the
# variables below, then:
#   qsub jobs/pbs-polaris.sh
# commbench reads rank, local rank and node from PALS (PALS_RANKID, PALS_LOCAL_RANKID,
# PALS_NODEID); each rank takes GPU local_rank % 4.
# Everything lands in $OUT_DIR as commbench results files; nothing here parses logs.
#
# Variables (edit here or set them in the environment, e.g. qsub -v PLAN=...):
#   RANKS_PER_NODE  ranks per node: one per GPU (Polaris: 4)
#   DEPTH           cores per rank for --depth / --cpu-bind depth (Polaris: 32 cores / 4 ranks = 8)
#   MPIEXEC_ARGS    extra mpiexec flags (e.g. "--env NCCL_DEBUG=WARN")
#   ENV_SETUP       shell command that makes commbench available (e.g. "module use /soft/modulefiles;
#                   module load conda; conda activate"); empty = as is
#   COMMBENCH       how to start commbench on each rank (e.g. "python -m commbench")
#   BACKEND         torch | mpi | cupy
#   COLLECTIVES     collectives of the sweep, comma-separated, or all
#   LAYOUTS         group layouts of the sweep: world, intra, inter, "MOD k", "DIV k"
#   SIZES           size flags of the sweep (nccl-tests style)
#   RUN_ARGS        more flags for the sweep (e.g. "-d float32,bf16", "-n 50", "-q")
#   PLAN            plan flags (e.g. "--model gpt3-1.3b --tp 4 --global-batch 64"): also measure that
#                   plan's collectives (run --plan) and kernels (compute); empty = sweep only
#   OUT_DIR         where the results files go
#   REPORT          1 = write an HTML/markdown report of the results into $OUT_DIR/report
set -euo pipefail
RANKS_PER_NODE=${RANKS_PER_NODE:-4}
DEPTH=${DEPTH:-8}
MPIEXEC_ARGS=${MPIEXEC_ARGS:-}
ENV_SETUP=${ENV_SETUP:-}
COMMBENCH=${COMMBENCH:-commbench}
BACKEND=${BACKEND:-torch}
COLLECTIVES=${COLLECTIVES:-all}
LAYOUTS=${LAYOUTS:-world,intra,inter}
SIZES=${SIZES:-"-b 8 -e 1G -f 2"}
RUN_ARGS=${RUN_ARGS:-}
PLAN=${PLAN:-}
OUT_DIR=${OUT_DIR:-results/pbs-${PBS_JOBID:-$(date +%Y%m%d-%H%M%S)}}
REPORT=${REPORT:-1}

cd "${PBS_O_WORKDIR:-.}"
[ -n "$ENV_SETUP" ] && eval "$ENV_SETUP"
NNODES=$(sort -u "${PBS_NODEFILE:?run this with qsub (PBS_NODEFILE is not set)}" | wc -l)
mkdir -p "$OUT_DIR"
# shellcheck disable=SC2206  # word splitting of the flag strings is intended
launch=(mpiexec -n $((NNODES * RANKS_PER_NODE)) --ppn "$RANKS_PER_NODE" --depth "$DEPTH" --cpu-bind depth
        --env OMP_NUM_THREADS="$DEPTH" $MPIEXEC_ARGS $COMMBENCH)

# shellcheck disable=SC2086
"${launch[@]}" run --backend "$BACKEND" --collective "$COLLECTIVES" --groups "$LAYOUTS" $SIZES $RUN_ARGS \
    --out "$OUT_DIR/sweep.jsonl"
if [ -n "$PLAN" ]; then
    # shellcheck disable=SC2086
    "${launch[@]}" run $PLAN -q --out "$OUT_DIR/plan-comm.jsonl"
    # shellcheck disable=SC2086
    "${launch[@]}" compute $PLAN -q --out "$OUT_DIR/compute.jsonl"
fi
if [ "$REPORT" = 1 ]; then
    # shellcheck disable=SC2086
    $COMMBENCH report "$OUT_DIR"/*.jsonl --out "$OUT_DIR/report" \
        --title "commbench: $NNODES nodes x $RANKS_PER_NODE ranks (PBS job ${PBS_JOBID:-})"
fi
echo "results: $OUT_DIR"
