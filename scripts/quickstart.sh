#!/usr/bin/env bash
# The quick start: installs and builds the project, prepares the embedded digits data set
# (trains the small tokenizer once, then reuses it from .cache/), trains VQ-LCMD on
# configs/ds_digits.json under the deepspeed launcher, samples a guided class-conditional
# grid (runs/digits/samples/final.png) and prints the accuracy an independent digit
# classifier gives the samples. Extra arguments go to scripts/train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  # No GPU: the CUDA kernels could not run here, so don't spend minutes compiling them.
  export VQLCMD_SKIP_CUDA=1
fi
bash scripts/install.sh
deepspeed --num_gpus 1 scripts/train.py --config ds_digits.json --evaluate "$@"
echo "quick start: $(( $(date +%s) - start )) s in all"
