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
# Every variable is read here, with its default, and handed to the script as an argument;
# README.md lists them. Multi-node: run once per node with NNODES, NODE_RANK, MASTER_ADDR set.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-$(command -v python || command -v python3 || true)}"
if [ -z "$PYTHON" ]; then
  echo "error: no python on the PATH; set PYTHON to the interpreter that has atorch installed" >&2
  exit 2
fi

# DeepSpeed JIT-builds a CPU comm op on first use (minutes); `make install` prebuilds it inside the venv.
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
  PREFIX="$("$PYTHON" -c 'import sys; print(sys.prefix)' 2>/dev/null || true)"
  if [ -n "$PREFIX" ] && [ -d "$PREFIX/torch_extensions" ]; then
    export TORCH_EXTENSIONS_DIR="$PREFIX/torch_extensions"
  fi
fi

NPROC_PER_NODE="${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
# Single node without MASTER_PORT: the launcher picks a free port (standalone), so jobs never collide.
MASTER_PORT="${MASTER_PORT:-$([ "$NNODES" = 1 ] || echo 29500)}"

MODEL_NAME_OR_PATH="${MODEL_NAME_OR_PATH:-}"     # fine-tune these weights
CONFIG_NAME="${CONFIG_NAME:-}"                   # or pretrain from this config (with TOKENIZER_NAME)
TOKENIZER_NAME="${TOKENIZER_NAME:-}"             # neither: the tiny Llama and the bundled tokenizer
DATASET_PATH="${DATASET_PATH:-}"                 # empty: the bundled corpus
OUTPUT_DIR="${OUTPUT_DIR:-./outputs/ds_3d_llama2}"
MODEL_PARALLEL_SIZE="${MODEL_PARALLEL_SIZE:-1}"    # tensor-parallel degree
PIPELINE_PARALLEL_SIZE="${PIPELINE_PARALLEL_SIZE:-2}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-2}"          # samples per micro-batch per data-parallel rank
ACCU_STEPS="${ACCU_STEPS:-4}"                      # micro-batches per optimizer step (fills the pipeline)
BLOCK_SIZE="${BLOCK_SIZE:-256}"
MAX_STEPS="${MAX_STEPS:-100}"
LEARNING_RATE="${LEARNING_RATE:-}"               # empty: the script's default for the mode
PEAK_TFLOPS="${PEAK_TFLOPS:-}"                   # empty: the GPU datasheet table, or a CPU matmul probe
LOG_STEPS="${LOG_STEPS:-10}"
SAVE_STEPS="${SAVE_STEPS:-50}"
RESUME="${RESUME:-0}"                            # 1: the latest checkpoint in OUTPUT_DIR, or a checkpoint dir
if [ -n "${PER_DEVICE_TRAIN_BATCH_SIZE:-}" ]; then
  echo "warning: PER_DEVICE_TRAIN_BATCH_SIZE is not used by the 3D script; set MICRO_BATCH_SIZE and ACCU_STEPS" >&2
fi

is_true() {  # is_true VALUE NAME: 1/true/yes/on or 0/false/no/off/empty, anything else is an error
  case "${1,,}" in
    1 | true | yes | on) return 0 ;;
    0 | false | no | off | "") return 1 ;;
    *) echo "error: $2=$1; expected 1 or 0" >&2; exit 2 ;;
  esac
}

ARGS=(--output_dir "$OUTPUT_DIR" --model_parallel_size "$MODEL_PARALLEL_SIZE"
      --pipeline_parallel_size "$PIPELINE_PARALLEL_SIZE" --micro_batch_size "$MICRO_BATCH_SIZE"
      --accu_steps "$ACCU_STEPS" --block_size "$BLOCK_SIZE" --max_steps "$MAX_STEPS" --log_steps "$LOG_STEPS"
      --save_steps "$SAVE_STEPS")
[ -n "$MODEL_NAME_OR_PATH" ] && ARGS+=(--model_name_or_path "$MODEL_NAME_OR_PATH")
[ -n "$CONFIG_NAME" ] && ARGS+=(--config_name "$CONFIG_NAME")
[ -n "$TOKENIZER_NAME" ] && ARGS+=(--tokenizer_name "$TOKENIZER_NAME")
[ -n "$DATASET_PATH" ] && ARGS+=(--dataset_path "$DATASET_PATH")
[ -n "$LEARNING_RATE" ] && ARGS+=(--learning_rate "$LEARNING_RATE")
[ -n "$PEAK_TFLOPS" ] && ARGS+=(--peak_tflops "$PEAK_TFLOPS")
case "${RESUME,,}" in
  0 | false | no | off | "") ;;
  1 | true | yes | on) ARGS+=(--resume) ;;
  *) ARGS+=(--resume "$RESUME") ;;
esac
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

LAUNCH=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --nproc_per_node "$NPROC_PER_NODE")
[ -n "$MASTER_PORT" ] && LAUNCH+=(--master_port "$MASTER_PORT")

exec "$PYTHON" -m atorch.distributed.run "${LAUNCH[@]}" "$HERE/ds_3d_llama2.py" "${ARGS[@]}" "$@"
