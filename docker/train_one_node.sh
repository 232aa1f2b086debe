#!/usr/bin/env bash
# One machine, all its GPUs (8 by default), DDP in bf16: Lightning starts one process per GPU inside
# the container. --ipc=host (or a large --shm-size) lets the data-loader workers share memory.
#   docker/train_one_node.sh recipes/image/vit_tiny_classify_mnist5k.yaml [key=value …]
set -euo pipefail
RECIPE=${1:?usage: $0 RECIPE.yaml [key=value ...]}
shift
GPUS=${GPUS:-8}
docker run --rm --gpus all --ipc=host \
  -v "${DATA_DIR:-$PWD/data}:/data" -v "${RUNS_DIR:-$PWD/runs}:/runs" \
  -e WANDB_API_KEY="${WANDB_API_KEY:-}" \
  "${IMAGE:-mmformer:0.1.0}" train "$RECIPE" \
  trainer.accelerator=gpu trainer.devices="$GPUS" trainer.strategy=ddp trainer.precision=bf16-mixed "$@"
