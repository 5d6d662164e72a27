#!/usr/bin/env bash
# Train with torchrun: one process per GPU. Single node by default; for several nodes run the same command on every
# node with the same MASTER_ADDR (a host every node can reach, usually node 0) and NNODES; the c10d rendezvous assigns
# node ranks, so no NODE_RANK is needed.
#
#   scripts/launch_torchrun.sh medusa1 +model=vicuna7b deepspeed=zero2 training.bf16=true              # this node
#   NNODES=2 MASTER_ADDR=10.0.0.1 scripts/launch_torchrun.sh medusa1 +model=vicuna33b deepspeed=zero3 training.bf16=true
#
# NPROC_PER_NODE defaults to "gpu" (every visible GPU). deepspeed=none gives plain DDP (every process holds the whole
# target); deepspeed=zero2/zero3/zero3_offload shard optimizer state, gradients and (zero3) the parameters.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}
if [[ "$NNODES" == 1 && -z "${MASTER_ADDR:-}" ]]; then
  exec torchrun --standalone --nproc_per_node "$NPROC_PER_NODE" -m train "$@"
fi
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (the same on every node)}"
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-draftsmith}" \
  -m train "$@"
