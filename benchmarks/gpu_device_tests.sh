#!/bin/bash
# tests/gpu on a lent device machine (the `device` tool), whose image has torch but not this project's
# versions of transformers, peft and DeepSpeed: they travel in .devcarry/ (ignored by git) as tarballs
# of this checkout's .venv site-packages, plus pydantic_core as a cp312 wheel (see RESULTS.md,
# "First GPU run"). Run from the repository root: bash benchmarks/gpu_device_tests.sh
set -o pipefail
R=$PWD
mkdir -p /tmp/site
for t in .devcarry/*.tgz; do tar xzf $t -C /tmp/site; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/*.whl 2>&1 | tail -2
export PYTHONPATH=$R:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cuda
nvidia-smi -L
python3 -c "import torch, transformers, peft, deepspeed, pydantic; print('versions', torch.__version__, transformers.__version__, peft.__version__, deepspeed.__version__, torch.cuda.get_device_name())" 2>&1 | tail -3
timeout 430 python3 -m pytest tests/gpu -q -p no:cacheprovider -rA -s --durations=15 2>&1 | tee ${OUT:-/tmp}/gpu.log | grep -v "^PASSED\|Warning\|warnings.warn" | tail -120
echo "pytest rc=$?"
