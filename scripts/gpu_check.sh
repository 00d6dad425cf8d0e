#!/usr/bin/env bash
# The checks that need a GPU, as one bounded run for a machine that is lent for minutes:
#   1. builds the C++/CUDA extension in place (sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise),
#   2. runs the tests marked `gpu` (compiled and Triton kernels against the reference ops on CUDA),
#   3. runs benchmarks/run.py on the GPU (rows appended per stage, so a cut-off run keeps its stages):
#      the softmax_embedding_average variants, the compiled ops, then the other stages,
#   4. runs the quick start's training + evaluation on the GPU (configs/ds_digits.json).
# Usage: bash scripts/gpu_check.sh OUT_DIR [SECONDS]. Steps run in order, each for at most its own limit
# and what is left of SECONDS (default 540), so the later ones get nothing once the budget is spent (the
# limits add up to more than 540 s: choose with STEPS); each logs to OUT_DIR, and a failing step does
# not stop the later ones. STEPS=name,name,... runs only
# those steps (names as printed: build, gpu-tests, bench-softmax-bwd, bench-softmax-fwd, bench-compiled,
# bench, quickstart), e.g. the benchmarks in one lease and the tests in the next. Needs the project's
# Python dependencies importable (installed, or on PYTHONPATH) and nvcc for the build.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [SECONDS]}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # before the cd below: a relative OUT_DIR is the caller's
cd "$(dirname "$0")/.."
deadline=$(( $(date +%s) + ${2:-540} ))
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  # a toolkit's nvcc only: a wrapper script's folder (/usr/local/bin/nvcc gave /usr/local) has no CUDA
  # headers or libraries, and the build then failed to link; setup.py's default then applies
  home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  if [ -f "$home/include/cuda_runtime.h" ]; then CUDA_HOME=$home; export CUDA_HOME; fi
fi
py=$(command -v python3 || command -v python)
# Seen on a lent H200 image: CC/CXX named wrappers under /opt/gcc, and an extension built with them
# segfaulted in std::ostream (inside its own copy of libstdc++ code) whenever it raised an error;
# the system g++ gave a working build. Keep the user's choice only where no system g++ exists.
if [ -x /usr/bin/g++ ] && [ "${VQLCMD_KEEP_CXX:-0}" != 1 ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi

step() {  # step NAME LIMIT_SECONDS COMMAND...: runs COMMAND for at most LIMIT (or what is left), logs it
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return; fi
  local left=$(( deadline - $(date +%s) - 5 ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then echo "=== $name: skipped, no time left"; return; fi
  local t0; t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s$( ((rc == 124)) && echo ' (timed out)')"
  tail -n "${TAIL_LINES:-30}" "$out/$name.log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$py" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name(), 'CUDA_HOME=${CUDA_HOME:-}')"
} 2>&1 | tee "$out/env.txt"

MAX_JOBS=${MAX_JOBS:-$(nproc)} step build 240 "$py" setup.py build_ext --inplace
# on a fresh machine the Triton tests compile and autotune every kernel first: on an H100 the
# compiled-op and Triton tests alone did not finish in 100 s with a cold cache (and the delta and
# sliced-backward variants add compiles and cases since)
# the quick CUDA-extension tests first and the Triton ones (cold autotuning) last, each result named as it
# comes (-v: a step cut off by its limit prints no summary), the slowest listed to size the next lease
step gpu-tests 240 "$py" -m pytest -v -p no:cacheprovider -m gpu -rs --durations=15 \
  tests/ops tests/pipeline tests/benchmarks tests/kernels
# the two open goals first, in steps of their own (a step cut short by its limit keeps the rows it had
# measured: run.py appends them on timeout's SIGTERM): the Triton variants not yet timed against the default and eager
# (torch.compile and the variants measured slower are left out), then the compiled ops with the
# sliced noise backward
step bench-softmax-bwd 100 "$py" benchmarks/run.py --device cuda --out "$out/bench.jsonl" \
  --stage softmax_embedding_average --backend triton,triton-delta,triton-rows
step bench-softmax-fwd 100 "$py" benchmarks/run.py --device cuda --out "$out/bench.jsonl" \
  --stage softmax_embedding_average --backend triton,triton-first-tile,triton-two-pass
step bench-compiled 80 "$py" benchmarks/run.py --device cuda --out "$out/bench.jsonl" --stage compiled_ops
step bench 120 "$py" benchmarks/run.py --device cuda --out "$out/bench.jsonl" \
  --stage attention,zero,train_step,sampling,denoiser
launcher=("$py" scripts/train.py)
command -v deepspeed >/dev/null && launcher=(deepspeed --num_gpus 1 scripts/train.py)
run_dir=$(mktemp -d)/digits  # checkpoints and weights stay out of OUT_DIR; the report and grid are copied
step quickstart 180 "${launcher[@]}" --config ds_digits.json --evaluate --no-progress \
  --set train.output_dir="$run_dir"
cp "$run_dir/report.json" "$out/quickstart-report.json" 2>/dev/null
cp "$run_dir/samples/final.png" "$out/quickstart-samples.png" 2>/dev/null
echo "=== done, $(( deadline - $(date +%s) ))s of the budget left"
