#!/usr/bin/env bash
# Multi-node launch of the actor trainer with torchrun's static rendezvous. Run it once per node:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 launch/multinode.sh --rollouts steps.jsonl ...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 launch/multinode.sh --rollouts steps.jsonl ...
#
# Every argument is passed to launch/train_actor.py. PYTHON picks the interpreter (default: python,
# i.e. the active environment's). Backend: NCCL where CUDA is available, gloo
# otherwise (chosen by the trainer). Global rank = NODE_RANK * NPROC_PER_NODE + local rank.
set -euo pipefail
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (address of node 0)}"
MASTER_PORT="${MASTER_PORT:-29500}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
echo "[multinode] node ${NODE_RANK}/${NNODES}: ${NPROC_PER_NODE} processes, rendezvous ${MASTER_ADDR}:${MASTER_PORT}" >&2
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "${NNODES}" --node_rank "${NODE_RANK}" --nproc_per_node "${NPROC_PER_NODE}" \
    --master_addr "${MASTER_ADDR}" --master_port "${MASTER_PORT}" \
    "${here}/train_actor.py" "$@"
