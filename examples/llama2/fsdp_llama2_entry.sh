#!/usr/bin/env bash
# Llama 2 with FSDP + bf16 autocast + activation checkpointing (atorch's fsdp, amp_native, checkpoint).
#
#   examples/llama2/fsdp_llama2_entry.sh                          # tiny offline default, 2 CPU processes
#   MODEL_NAME_OR_PATH=/models/Llama-2-7b-hf DATASET_PATH=/data/corpus.jsonl BLOCK_SIZE=4096 \
#       PER_DEVICE_TRAIN_BATCH_SIZE=1 examples/llama2/fsdp_llama2_entry.sh      # fine-tune on the GPUs
#
# Every variable is read here or in entry_common.sh, with its default, and handed to the script;
# README.md lists them. Multi-node: run once per node with NNODES, NODE_RANK, MASTER_ADDR set.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTPUT_DIR="${OUTPUT_DIR:-./outputs/fsdp_llama2}"
source "$HERE/entry_common.sh"

PER_DEVICE_TRAIN_BATCH_SIZE="${PER_DEVICE_TRAIN_BATCH_SIZE:-4}"
USE_LORA="${USE_LORA:-0}"
USE_FP8="${USE_FP8:-0}"

ARGS+=(--per_device_train_batch_size "$PER_DEVICE_TRAIN_BATCH_SIZE")
if is_true "$USE_LORA" USE_LORA; then ARGS+=(--use_lora); fi
if is_true "$USE_FP8" USE_FP8; then ARGS+=(--use_fp8); fi

launch fsdp_llama2.py "$@"
