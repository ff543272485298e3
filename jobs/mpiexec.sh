#!/usr/bin/env bash
# commbench over a plain mpiexec (MPICH/hydra flags by default: -n, -ppn, -f HOSTFILE).
# Run from the repository root (or anywhere, with OUT_DIR set):
#   NODES=2 PPN=4 HOSTFILE=hosts.txt bash jobs/mpiexec.sh
# Everything lands in $OUT_DIR as commbench results files; nothing here parses logs.
#
# Variables (edit here or set them in the environment):
#   NODES          nodes to use (hosts from HOSTFILE)
#   PPN            ranks per node: one per GPU on GPU nodes
#   HOSTFILE       mpiexec hostfile, one host per line; empty = this machine only
#   MPIEXEC        the mpiexec to use (e.g. .venv/bin/mpiexec, or the cluster's)
#   MPIEXEC_ARGS   extra mpiexec flags (binding, env passing); Open MPI: set PPN_FLAG and HOSTFILE_FLAG too
#   PPN_FLAG       how this mpiexec says ranks per node: -ppn (MPICH, Intel MPI); Open MPI: --npernode
#   HOSTFILE_FLAG  how this mpiexec takes HOSTFILE: -f (MPICH, Intel MPI); Open MPI: --hostfile
#   COMMBENCH      how to start commbench on each rank (e.g. "python -m commbench")
#   BACKEND        torch | mpi | cupy
#   COLLECTIVES    collectives of the sweep, comma-separated, or all
#   LAYOUTS        group layouts of the sweep: world, intra, inter, "MOD k", "DIV k"
#   SIZES          size flags of the sweep (nccl-tests style)
#   RUN_ARGS       more flags for the sweep (e.g. "-d float32,bf16", "-n 50", "-q")
#   PLAN           plan flags (e.g. "--model gpt3-1.3b --tp 4 --global-batch 64"): also measure that
#                  plan's collectives (run --plan) and kernels (compute); empty = sweep only
#   OUT_DIR        where the results files go
#   REPORT         1 = write an HTML/markdown report of the results into $OUT_DIR/report
set -euo pipefail
NODES=${NODES:-1}
PPN=${PPN:-2}
HOSTFILE=${HOSTFILE:-}
MPIEXEC=${MPIEXEC:-mpiexec}
MPIEXEC_ARGS=${MPIEXEC_ARGS:-}
PPN_FLAG=${PPN_FLAG:--ppn}
HOSTFILE_FLAG=${HOSTFILE_FLAG:--f}
COMMBENCH=${COMMBENCH:-commbench}
BACKEND=${BACKEND:-torch}
COLLECTIVES=${COLLECTIVES:-all}
LAYOUTS=${LAYOUTS:-world,intra,inter}
SIZES=${SIZES:-"-b 8 -e 256M -f 2"}
RUN_ARGS=${RUN_ARGS:-}
PLAN=${PLAN:-}
OUT_DIR=${OUT_DIR:-results/mpiexec-$(date +%Y%m%d-%H%M%S)}
REPORT=${REPORT:-1}

launch=("$MPIEXEC" -n $((NODES * PPN)) "$PPN_FLAG" "$PPN")
[ -n "$HOSTFILE" ] && launch+=("$HOSTFILE_FLAG" "$HOSTFILE")
# shellcheck disable=SC2206  # word splitting of the flag strings is intended
launch+=($MPIEXEC_ARGS $COMMBENCH)
mkdir -p "$OUT_DIR"

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
    $COMMBENCH report "$OUT_DIR"/*.jsonl --out "$OUT_DIR/report" --title "commbench: $((NODES * PPN)) ranks (mpiexec)"
fi
echo "results: $OUT_DIR"
