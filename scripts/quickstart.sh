#!/usr/bin/env bash
# The quick start: installs and builds the project, prepares the embedded digits data set
# (trains the small tokenizer once, then reuses it from .cache/), trains VQ-LCMD on
# configs/ds_digits.json under the deepspeed launcher, samples a guided class-conditional
# grid (runs/digits/samples/final.png) and prints the accuracy an independent digit
# classifier gives the samples. Extra arguments go to scripts/train.py.
# CPU threads: scripts/train.py takes the free cores, fewer when other work keeps some busy, and sets
# OMP_WAIT_POLICY=PASSIVE; set them with `bash scripts/quickstart.sh --threads N` or VQLCMD_THREADS=N
# (VQLCMD_THREADS=torch: torch's own defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  # No GPU: the CUDA kernels could not run here, so don't spend minutes compiling them.
  export VQLCMD_SKIP_CUDA=1
fi
bash scripts/install.sh
# (the ranks set it too; exported here for every process the launcher starts)
if [ "${VQLCMD_THREADS:-}" != "torch" ]; then export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"; fi
deepspeed --num_gpus 1 scripts/train.py --config ds_digits.json --evaluate "$@"
echo "quick start: $(( $(date +%s) - start )) s in all"
