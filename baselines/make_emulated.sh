#!/usr/bin/env bash
# The emulated-cluster baselines: the same sweep on an emulated 2-node cluster
# (commbench emulate: one network namespace per node, tc-shaped links) at a low
# and at a high inter-node bandwidth, one results file each. Needs root and
# network namespaces (as commbench emulate does). Run from the repository root:
#   bash baselines/make_emulated.sh
# Measured on whatever machine runs it: the files record that machine in their
# headers, and README.md here says where the shipped ones were made.
#
# Variables (edit here or set them in the environment):
#   COMMBENCH       the commbench to run (e.g. .venv/bin/commbench)
#   NODES           emulated nodes
#   RANKS_PER_NODE  ranks in each node
#   LOW_BW          the low inter-node link rate (tc units: bit, kbit, mbit, gbit)
#   HIGH_BW         the high inter-node link rate
#   LATENCY         one-way node-to-node latency added to both (e.g. 100us; needs the kernel's netem);
#                   empty = none
#   COLLECTIVES     collectives of the sweep, comma-separated
#   LAYOUTS         group layouts: world, intra, inter, "MOD k", "DIV k"
#   SIZES           size flags (nccl-tests style)
#   RUN_ARGS        timing flags of the sweep
#   OUT_DIR         where the two results files go
#   FORCE           1 = replace existing files (commbench never overwrites otherwise)
set -euo pipefail
COMMBENCH=${COMMBENCH:-commbench}
NODES=${NODES:-2}
RANKS_PER_NODE=${RANKS_PER_NODE:-2}
LOW_BW=${LOW_BW:-100mbit}
HIGH_BW=${HIGH_BW:-1gbit}
LATENCY=${LATENCY:-}
COLLECTIVES=${COLLECTIVES:-all_reduce,all_gather,reduce_scatter,broadcast}
LAYOUTS=${LAYOUTS:-world,intra,inter}
SIZES=${SIZES:-"-b 1K -e 4M -f 4"}
RUN_ARGS=${RUN_ARGS:-"-n 10 -w 2 --target-ci 0.02 --time-budget 1 -q"}
OUT_DIR=${OUT_DIR:-baselines/emulated}
FORCE=${FORCE:-0}

force=()
[ "$FORCE" = 1 ] && force=(--force)
latency=()
[ -n "$LATENCY" ] && latency=(--inter-latency "$LATENCY")
mkdir -p "$OUT_DIR"
for bw in "$LOW_BW" "$HIGH_BW"; do
    out="$OUT_DIR/emulated-${NODES}x${RANKS_PER_NODE}-${bw}${LATENCY:+-$LATENCY}.jsonl"
    # shellcheck disable=SC2086  # word splitting of the flag strings is intended
    $COMMBENCH emulate --nodes "$NODES" --ranks-per-node "$RANKS_PER_NODE" --inter-bw "$bw" "${latency[@]}" -- \
        $COMMBENCH run --collective "$COLLECTIVES" --groups "$LAYOUTS" $SIZES $RUN_ARGS --out "$out" "${force[@]}"
    echo "$out"
done
