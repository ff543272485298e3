#!/usr/bin/env bash
# Plain mpiexec launch of a commbench sweep. Edit the variables, then run:
#   NODES=2 PPN=4 HOSTFILE=hosts.txt bash jobs/mpiexec.sh
# Results go to $OUT (one JSON Lines file); nothing here parses logs.
set -euo pipefail
NODES=${NODES:-1}                 # nodes to use
PPN=${PPN:-2}                     # ranks per node (one per GPU on GPU nodes)
HOSTFILE=${HOSTFILE:-}            # mpiexec hostfile; empty = this machine only
BACKEND=${BACKEND:-torch}         # torch | mpi | cupy
GROUPS=${GROUPS:-world,intra,inter}
SIZES=${SIZES:-"-b 8 -e 256M -f 2"}
OUT=${OUT:-results/mpiexec-$(date +%Y%m%d-%H%M%S).jsonl}

hostfile_args=()
[ -n "$HOSTFILE" ] && hostfile_args=(-f "$HOSTFILE")
mpiexec -n $((NODES * PPN)) -ppn "$PPN" "${hostfile_args[@]}" \
    commbench run --backend "$BACKEND" --collective all --groups "$GROUPS" $SIZES --out "$OUT"
