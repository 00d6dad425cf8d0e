#!/usr/bin/env bash
# Installs the project and everything it needs from the package index, then
# builds the package in place. Used by the quick start, the tests and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v python >/dev/null; then  # e.g. stock Debian/Ubuntu: python3 only, and it refuses pip installs
  echo "install.sh: no 'python' on PATH. Make and activate a virtual environment first:" >&2
  echo "  python3 -m venv .venv && . .venv/bin/activate" >&2
  exit 1
fi
# nvcc on PATH may be a wrapper script, from which torch guesses a wrong CUDA_HOME.
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
PIP="python -m pip install --disable-pip-version-check -q"
# torch and the requirements in one resolver run (one pip start-up less), then the project:
# its build imports torch (--no-build-isolation keeps one torch).
$PIP "torch==2.14.1" "torchvision==0.29.1" setuptools wheel ninja pybind11 -r requirements.txt
$PIP --no-build-isolation --no-deps -e .
# Say which kernels the build produced (CPU only, or CPU + CUDA for which architectures).
python -c "from vqlcmd.ops import _compiled; print(_compiled.describe())"
