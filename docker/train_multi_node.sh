#!/usr/bin/env bash
# Several machines: run this on every node (NODE_RANK 0 … NNODES-1, MASTER_ADDR = node 0's address).
# torchrun starts GPUS processes per node; Lightning reads torchrun's environment, every process agrees
# on one run folder (derived from the rendezvous id), and only global rank 0 writes it. Host networking
# lets NCCL use the nodes' interfaces (set NCCL_SOCKET_IFNAME if it picks the wrong one).
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 docker/train_multi_node.sh recipes/… [key=value …]
set -euo pipefail
RECIPE=${1:?usage: $0 RECIPE.yaml [key=value ...]}
shift
NNODES=${NNODES:?set NNODES} NODE_RANK=${NODE_RANK:?set NODE_RANK} MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR}
GPUS=${GPUS:-8}
docker run --rm --gpus all --ipc=host --network=host \
  -v "${DATA_DIR:-$PWD/data}:/data" -v "${RUNS_DIR:-$PWD/runs}:/runs" \
  -e WANDB_API_KEY="${WANDB_API_KEY:-}" -e NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-}" \
  --entrypoint torchrun "${IMAGE:-mmformer:0.1.0}" \
  --nnodes="$NNODES" --nproc-per-node="$GPUS" --node-rank="$NODE_RANK" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id="${JOB_ID:-mmformer}" \
  -m mmformer.cli train "$RECIPE" \
  trainer.accelerator=gpu trainer.devices="$GPUS" trainer.num_nodes="$NNODES" trainer.strategy=ddp \
  trainer.precision=bf16-mixed "$@"
