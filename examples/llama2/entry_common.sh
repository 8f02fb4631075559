# Shared by the three *_entry.sh scripts (sourced, not run): the interpreter, the launcher
# variables, the variables every training script takes, and `launch SCRIPT`, which execs the
# atorch launcher. The caller sets HERE and its OUTPUT_DIR default before sourcing this file;
# README.md lists every variable.

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
BLOCK_SIZE="${BLOCK_SIZE:-256}"
MAX_STEPS="${MAX_STEPS:-100}"
LEARNING_RATE="${LEARNING_RATE:-}"               # empty: the script's default for the mode
PEAK_TFLOPS="${PEAK_TFLOPS:-}"                   # empty: the GPU datasheet table, or a CPU matmul probe
LOG_STEPS="${LOG_STEPS:-10}"
LOG_WITH="${LOG_WITH:-}"                         # empty: the script's default (jsonl); tensorboard, jsonl, none
SAVE_STEPS="${SAVE_STEPS:-50}"
RESUME="${RESUME:-0}"                            # 1: the latest checkpoint in OUTPUT_DIR, or a checkpoint dir

is_true() {  # is_true VALUE NAME: 1/true/yes/on or 0/false/no/off/empty, anything else is an error
  case "${1,,}" in
    1 | true | yes | on) return 0 ;;
    0 | false | no | off | "") return 1 ;;
    *) echo "error: $2=$1; expected 1 or 0" >&2; exit 2 ;;
  esac
}

ARGS=(--output_dir "$OUTPUT_DIR" --block_size "$BLOCK_SIZE" --max_steps "$MAX_STEPS" --log_steps "$LOG_STEPS"
      --save_steps "$SAVE_STEPS")
[ -n "$MODEL_NAME_OR_PATH" ] && ARGS+=(--model_name_or_path "$MODEL_NAME_OR_PATH")
[ -n "$CONFIG_NAME" ] && ARGS+=(--config_name "$CONFIG_NAME")
[ -n "$TOKENIZER_NAME" ] && ARGS+=(--tokenizer_name "$TOKENIZER_NAME")
[ -n "$DATASET_PATH" ] && ARGS+=(--dataset_path "$DATASET_PATH")
[ -n "$LEARNING_RATE" ] && ARGS+=(--learning_rate "$LEARNING_RATE")
[ -n "$PEAK_TFLOPS" ] && ARGS+=(--peak_tflops "$PEAK_TFLOPS")
[ -n "$LOG_WITH" ] && ARGS+=(--log_with "$LOG_WITH")
case "${RESUME,,}" in
  0 | false | no | off | "") ;;
  1 | true | yes | on) ARGS+=(--resume) ;;
  *) ARGS+=(--resume "$RESUME") ;;
esac

launch() {  # launch SCRIPT.py [extra args]: exec the atorch launcher on this node
  local script="$1"
  shift
  local launch_args=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
                     --nproc_per_node "$NPROC_PER_NODE")
  [ -n "$MASTER_PORT" ] && launch_args+=(--master_port "$MASTER_PORT")
  exec "$PYTHON" -m atorch.distributed.run "${launch_args[@]}" "$HERE/$script" "${ARGS[@]}" "$@"
}
