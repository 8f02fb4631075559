#!/usr/bin/env bash
# Llama 2 with the strategy atorch finds: Bayesian optimization over dry runs, then training with the winner.
#
#   examples/llama2/bayes_opt_sg_llama2_entry.sh                  # tiny offline default, 2 CPU processes
#   BO_SG_MAX_IETR=20 MODEL_NAME_OR_PATH=/models/Llama-2-7b-hf DATASET_PATH=/data/corpus.jsonl \
#       BLOCK_SIZE=4096 PER_DEVICE_TRAIN_BATCH_SIZE=1 examples/llama2/bayes_opt_sg_llama2_entry.sh
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
OUTPUT_DIR="${OUTPUT_DIR:-./outputs/bayes_opt_sg_llama2}"
PER_DEVICE_TRAIN_BATCH_SIZE="${PER_DEVICE_TRAIN_BATCH_SIZE:-4}"
BLOCK_SIZE="${BLOCK_SIZE:-256}"
MAX_STEPS="${MAX_STEPS:-100}"
LEARNING_RATE="${LEARNING_RATE:-}"               # empty: the script's default for the mode
PEAK_TFLOPS="${PEAK_TFLOPS:-}"                   # empty: the GPU datasheet table, or a CPU matmul probe
LOG_STEPS="${LOG_STEPS:-10}"
SAVE_STEPS="${SAVE_STEPS:-50}"
RESUME="${RESUME:-0}"                            # 1: the latest checkpoint in OUTPUT_DIR, or a checkpoint dir
USE_LORA="${USE_LORA:-0}"                        # every candidate trains LoRA adapters only
USE_FP8="${USE_FP8:-0}"                          # every candidate uses float8 linears (FP8 GPUs only)
# Read by the planner in every worker (the launcher passes the environment on).
export BO_SG_MAX_IETR="${BO_SG_MAX_IETR:-10}"     # trials (dry runs) at most
export RANDOM_SAMPLE="${RANDOM_SAMPLE:-3}"       # random trials before the Bayesian model proposes

is_true() {  # is_true VALUE NAME: 1/true/yes/on or 0/false/no/off/empty, anything else is an error
  case "${1,,}" in
    1 | true | yes | on) return 0 ;;
    0 | false | no | off | "") return 1 ;;
    *) echo "error: $2=$1; expected 1 or 0" >&2; exit 2 ;;
  esac
if is_true "$USE_LORA" USE_LORA; then ARGS+=(--use_lora); fi
if is_true "$USE_FP8" USE_FP8; then ARGS+=(--use_fp8); fi
}

ARGS=(--output_dir "$OUTPUT_DIR" --per_device_train_batch_size "$PER_DEVICE_TRAIN_BATCH_SIZE"
      --block_size "$BLOCK_SIZE" --max_steps "$MAX_STEPS" --log_steps "$LOG_STEPS" --save_steps "$SAVE_STEPS")
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
if is_true "$USE_LORA" USE_LORA; then ARGS+=(--use_lora); fi
if is_true "$USE_FP8" USE_FP8; then ARGS+=(--use_fp8); fi

LAUNCH=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --nproc_per_node "$NPROC_PER_NODE")
[ -n "$MASTER_PORT" ] && LAUNCH+=(--master_port "$MASTER_PORT")

exec "$PYTHON" -m atorch.distributed.run "${LAUNCH[@]}" "$HERE/bayes_opt_sg_llama2.py" "${ARGS[@]}" "$@"
