#!/usr/bin/env bash
# Installs the project and runs its test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m pytest -q "$@"
