#!/usr/bin/env bash
# Llama 2 with the strategy atorch finds: Bayesian optimization over dry runs, then training with the winner.
#
#   examples/llama2/bayes_opt_sg_llama2_entry.sh                  # tiny offline default, 2 CPU processes
#   BO_SG_MAX_IETR=20 MODEL_NAME_OR_PATH=/models/Llama-2-7b-hf DATASET_PATH=/data/corpus.jsonl \
#       BLOCK_SIZE=4096 PER_DEVICE_TRAIN_BATCH_SIZE=1 examples/llama2/bayes_opt_sg_llama2_entry.sh
#
# Every variable is read here or in entry_common.sh, with its default, and handed to the script;
# README.md lists them. Multi-node: run once per node with NNODES, NODE_RANK, MASTER_ADDR set.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTPUT_DIR="${OUTPUT_DIR:-./outputs/bayes_opt_sg_llama2}"
source "$HERE/entry_common.sh"

PER_DEVICE_TRAIN_BATCH_SIZE="${PER_DEVICE_TRAIN_BATCH_SIZE:-4}"
USE_LORA="${USE_LORA:-0}"                        # every candidate trains LoRA adapters only
USE_FP8="${USE_FP8:-0}"                          # every candidate uses float8 linears (FP8 GPUs only)
# Read by the planner in every worker (the launcher passes the environment on).
export BO_SG_MAX_IETR="${BO_SG_MAX_IETR:-10}"     # trials (dry runs) at most
export RANDOM_SAMPLE="${RANDOM_SAMPLE:-3}"       # random trials before the Bayesian model proposes

ARGS+=(--per_device_train_batch_size "$PER_DEVICE_TRAIN_BATCH_SIZE")
if is_true "$USE_LORA" USE_LORA; then ARGS+=(--use_lora); fi
if is_true "$USE_FP8" USE_FP8; then ARGS+=(--use_fp8); fi

launch bayes_opt_sg_llama2.py "$@"
