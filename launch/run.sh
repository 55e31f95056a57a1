#!/usr/bin/env bash
# Launch training with torchrun on one node or many. Arguments go to launch.train
# (see: python -m launch.train --help).
#
#   launch/run.sh --preset tiny                            # this node, NPROC processes (default 2)
#   NPROC=8 launch/run.sh --preset 1b --compute-dtype bf16 # one process per GPU
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=host0 NPROC=8 launch/run.sh --preset 1b   # on each node
#   MAX_RESTARTS=3 launch/run.sh ...                        # restart failed ranks from the last checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ "$NNODES" -gt 1 ]; then
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 for a multi-node run}"
  exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv-id "${RDZV_ID:-fsdp_int8}" -m launch.train "$@"
fi
exec torchrun --standalone --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" -m launch.train "$@"
