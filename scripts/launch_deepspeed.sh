#!/usr/bin/env bash
# Train with the DeepSpeed launcher: one process per GPU, on this node or on every node of a hostfile.
#
#   scripts/launch_deepspeed.sh medusa1 +model=vicuna7b deepspeed=zero2 training.bf16=true          # all GPUs here
#   NUM_GPUS=4 scripts/launch_deepspeed.sh medusa1 +model=vicuna7b deepspeed=zero2 training.bf16=true
#   HOSTFILE=scripts/hostfile.example scripts/launch_deepspeed.sh medusa1 +model=vicuna33b deepspeed=zero3 training.bf16=true
#
# Multi-node: the launcher reaches the other hosts over passwordless ssh (pdsh when installed) and starts the same
# command in the same directory there, so the repository and model.path must exist at the same path on every node.
# Variables listed as KEY=VALUE in a `.deepspeed_env` file (current directory or $HOME) are exported on every node,
# e.g. HF_HOME, HF_HUB_OFFLINE, NCCL_SOCKET_IFNAME. The first host runs rank 0, which writes the checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--master_port "${MASTER_PORT:-29500}")
if [[ -n "${HOSTFILE:-}" ]]; then
  args+=(--hostfile "$HOSTFILE")
  [[ -n "${MASTER_ADDR:-}" ]] && args+=(--master_addr "$MASTER_ADDR")
elif [[ -n "${NUM_GPUS:-}" ]]; then
  args+=(--num_gpus "$NUM_GPUS")
fi
exec deepspeed "${args[@]}" --module train "$@"
