#!/bin/bash
# 2 nodes x 8 processes without a launcher: run this on every node with NODE_RANK=0 on the first, 1 on the
# second. MASTER_ADDR is node 0's address, MASTER_PORT a free port, both the same on every node. WORLD_SIZE is
# not read (Lightning computes it as num_nodes x devices). A missing variable is an immediate error.
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash examples/multinode_env.sh   # node 0
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash examples/multinode_env.sh   # node 1
# The same with torchrun on every node (it starts the 8 processes itself):
#   torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr 10.0.0.1 --master-port 29500 \
#     -m lightalign.cli fit --config configs/sft.yaml --trainer.num_nodes 2 --trainer.devices 8
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}" "${MASTER_PORT:?set MASTER_PORT}"
export NODE_RANK MASTER_ADDR MASTER_PORT
lightalign fit --config configs/sft.yaml \
  --trainer.strategy configs/strategies/ddp.yaml \
  --trainer.num_nodes 2 --trainer.devices 8
