#!/usr/bin/env bash
# Llama 2 with DeepSpeed 3D parallelism: tensor x pipeline x data (atorch's deepspeed_3d_parallel).
#
#   examples/llama2/ds_3d_llama2_entry.sh                         # tiny offline default: 2 CPU processes, 2 stages
#   NPROC_PER_NODE=4 PIPELINE_PARALLEL_SIZE=2 examples/llama2/ds_3d_llama2_entry.sh          # (tp 1, pp 2, dp 2)
#   MODEL_NAME_OR_PATH=/models/Llama-2-7b-hf MODEL_PARALLEL_SIZE=2 PIPELINE_PARALLEL_SIZE=2 \
#       DATASET_PATH=/data/corpus.jsonl BLOCK_SIZE=4096 examples/llama2/ds_3d_llama2_entry.sh  # 8 GPUs: dp 2
#
# Global batch = MICRO_BATCH_SIZE x ACCU_STEPS x data-parallel size (world / (tensor x pipeline));
# PER_DEVICE_TRAIN_BATCH_SIZE does not apply here.
#
# Every variable is read here or in entry_common.sh, with its default, and handed to the script;
# README.md lists them. Multi-node: run once per node with NNODES, NODE_RANK, MASTER_ADDR set.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTPUT_DIR="${OUTPUT_DIR:-./outputs/ds_3d_llama2}"
source "$HERE/entry_common.sh"

MODEL_PARALLEL_SIZE="${MODEL_PARALLEL_SIZE:-1}"    # tensor-parallel degree
PIPELINE_PARALLEL_SIZE="${PIPELINE_PARALLEL_SIZE:-2}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-2}"          # samples per micro-batch per data-parallel rank
ACCU_STEPS="${ACCU_STEPS:-4}"                      # micro-batches per optimizer step (fills the pipeline)
if [ -n "${PER_DEVICE_TRAIN_BATCH_SIZE:-}" ]; then
  echo "warning: PER_DEVICE_TRAIN_BATCH_SIZE is not used by the 3D script; set MICRO_BATCH_SIZE and ACCU_STEPS" >&2
fi
# Read so that setting them is an error here rather than silently ignored.
if is_true "${USE_FP8:-0}" USE_FP8; then
  echo "error: USE_FP8=1 is not supported by the 3D example: deepspeed_3d_parallel sets precision in its DeepSpeed" \
       "config and conflicts with fp8; use fsdp_llama2_entry.sh" >&2
  exit 2
fi
if is_true "${USE_LORA:-0}" USE_LORA; then
  echo "error: USE_LORA=1 is not supported by the 3D example (no LoRA on DeepSpeed pipeline stages);" \
       "use fsdp_llama2_entry.sh" >&2
  exit 2
fi

ARGS+=(--model_parallel_size "$MODEL_PARALLEL_SIZE" --pipeline_parallel_size "$PIPELINE_PARALLEL_SIZE"
       --micro_batch_size "$MICRO_BATCH_SIZE" --accu_steps "$ACCU_STEPS")

launch ds_3d_llama2.py "$@"
