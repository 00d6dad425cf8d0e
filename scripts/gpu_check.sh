#!/usr/bin/env bash
# The checks that need a GPU, as one bounded run for a machine lent for minutes (issue 32: HEAD verified in one
# lease of <= 9 minutes from a bare machine). Run `bash scripts/gpu_prepare.sh` here first and carry .whl/:
#   wheels         installs the carried wheels the image lacks (DeepSpeed and its dependencies, diffusers), if it
#                  lacks them
#   build          builds the C++/CUDA extension in place (sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise)
#   train-32       `deepspeed scripts/train.py --config ds_imagenet.json` (imagenet-246m, bf16, ZeRO 2) with the
#                  fast step, the flat step compiled (train.step flat), per-GPU batch 32 (the paper's), 100 steps
#                  on a synthetic token set in ImageNet layout: images/s and MFU rows from its log steps
#                  (benchmarks/train_rows.py)
#   train-32-ds    the same through DeepSpeed's engine step, eager (the fast step before the flat step)
#   train-32g      train-32 with train.cuda_graphs (the compiled loss captured in CUDA graphs)
#   host           benchmarks/host_overhead.py at full size, batch 32: the step's host time by phase and its
#                  device reads, DeepSpeed's engine step and the flat step; rows to OUT_DIR/host.jsonl
#   sample         benchmarks/sampling_overhead.py at imagenet-246m, batch 256, guided: ms per step at 50 and 2
#                  steps, eager and compiled (images/s = 256 / (steps x ms)); rows to OUT_DIR/sample.jsonl
#   gpu-tests      every test marked `gpu` (the quick CUDA-extension tests first, the cold-autotuning Triton ones
#                  last; -v, so a step cut off by its limit still names each result)
#   gpu-defaults   the Triton launch-choice test that is not marked `gpu` but must hold on one (the kernels a
#                  GPU launches by default for bf16 and float32 inputs)
#   train-128      batch 128, the flat step compiled
#   bench-softmax  the Triton softmax_embedding_average defaults (first-tile forward, rows dlogits for bf16)
#                  against the runners-up they beat on an H200 (one-pass forward, tiles dlogits), eager and
#                  torch.compile, at the goal size only: N=32768 K=1024 D=256 bf16
#   bench-noise    the compiled ops against the reference
#   flash4         unpacks FlashAttention-4 (flash-attn-4) where scripts/flash4_wheels.sh's .fa4/ was carried
#   bench-attention  benchmarks/run.py's attention stage: SDPA (its pick, flash, cuDNN) and FA4, bf16, fwd and
#                  fwd+bwd, imagenet-246m's head dim 48 and 64
#   train-256      batch 256, the flat step compiled
# In that order, most valuable rows first: each step runs for at most its own limit and what is left of SECONDS
# (default 540), so the later ones are cut or skipped once the budget is spent; a failing step does not stop the
# later ones, and a step cut short keeps its rows (run.py appends on SIGTERM; the training rows come from the
# log steps the run wrote). STEPS=name,name,... runs only those, also two steps not in the default list:
#   quickstart     the digits quick start's training command (report and sample grid to OUT_DIR)
#   reproduce      issue 31's 64-token study on the GPU (bf16): VQ-LCMD against MaskGIT, seeds 0-2, REPRO_STEPS
#                  (default 4000) steps evaluated every 500 and stopped 3 evaluations after the FID at omega = 0
#                  last improved, six runs at once; each evaluation reaches OUT_DIR/reproduce64/results.jsonl as
#                  it is made, and the tables and plots are written from them afterwards, also when the step's
#                  limit (REPRO_LIMIT, default 480 s) cut it short. Carry .cache/digits to reuse the tokenizer.
# Rows (long format, benchmarks/run.py's fields) go to OUT_DIR/rows.jsonl, logs
# to OUT_DIR/<step>.log; every row's `commit` is .whl/tree.txt's (git describe, plus the manifest's hash for
# a dirty tree) when the tree here matches .whl/tree.sha256, and says so when it does not.
# DRY_RUN=1 runs the same steps on CPU at tiny sizes (the `tiny` preset, batches 4/8/16, 8 steps, no
# compile, the plain python launcher, `run.py --quick` without its torch.compile backend; the extension is
# built only if it is not), to find script bugs before a lease is spent on them: tests/test_gpu_check.py
# runs it in CI.
# Usage: bash scripts/gpu_check.sh OUT_DIR [SECONDS]
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [SECONDS]}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # before the cd below: a relative OUT_DIR is the caller's
cd "$(dirname "$0")/.."
start=$(date +%s)
deadline=$(( start + ${2:-540} ))
dry=${DRY_RUN:-0}
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

# the tree that runs, for every row: prepared here, verified there (the machine's copy has no .git)
if [ -f .whl/tree.txt ] && [ -f .whl/tree.sha256 ]; then
  VQLCMD_COMMIT=$(cat .whl/tree.txt)
  if ! sha256sum --quiet -c .whl/tree.sha256 >"$out/tree-check.txt" 2>&1; then
    VQLCMD_COMMIT="$VQLCMD_COMMIT, then changed (see tree-check.txt)"
  fi
else
  VQLCMD_COMMIT="$(git describe --always --dirty --abbrev=12 2>/dev/null || echo unknown) (no gpu_prepare manifest)"
fi
export VQLCMD_COMMIT

step() {  # step NAME LIMIT_SECONDS COMMAND...: runs COMMAND for at most LIMIT (or what is left), logs it
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return 1; fi
  if [ -z "${STEPS:-}" ] && { [ "$name" = quickstart ] || [ "$name" = reproduce ]; }; then return 1; fi
  local left=$(( deadline - $(date +%s) - 5 ))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then echo "=== $name: skipped, no time left"; return 1; fi
  local t0; t0=$(date +%s)
  echo "=== $name (limit ${limit}s, at $(( t0 - start ))s): $*"
  timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s$( ((rc == 124)) && echo ' (timed out)')"
  tail -n "${TAIL_LINES:-20}" "$out/$name.log"
  return 0
}

{
  if [ "$dry" = 1 ]; then echo "DRY_RUN: CPU, tiny sizes"; else
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; fi
  "$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', 'CUDA_HOME=${CUDA_HOME:-}')"
  echo "commit: $VQLCMD_COMMIT"
} 2>&1 | tee "$out/env.txt"

need=()
for mod in deepspeed safetensors tqdm diffusers; do "$py" -c "import $mod" 2>/dev/null || need+=("$mod"); done
if (( ${#need[@]} )); then
  step wheels 60 "$py" -m pip install --no-index --find-links .whl "${need[@]}"
fi

if [ "$dry" = 1 ] && "$py" -c "import vqlcmd._C" 2>/dev/null; then
  echo "=== build: the extension is built already (dry run)"
else
  MAX_JOBS=${MAX_JOBS:-$(nproc)} step build 150 "$py" setup.py build_ext --inplace
fi

if [ "$dry" = 1 ]; then
  preset=tiny overrides='{}' images=256 steps=8 log_every=4 sizes=(4 8 16) compile=false
  launcher=("$py" scripts/train.py) bench=(--quick --device cpu) softmax=triton,triton-tiles  # no CPU compiling
else
  preset=imagenet-246m overrides='{"codebook_size": 1024, "embed_dim": 256, "seq_len": 256}' images=4096
  steps=100 log_every=10 sizes=(32 128 256) compile=true
  launcher=("$py" scripts/train.py) bench=(--device cuda)
  softmax=triton,triton-one-pass,triton-tiles,compile
  command -v deepspeed >/dev/null && launcher=(deepspeed --num_gpus 1 scripts/train.py)
fi
# the runs' end-of-run checkpoints (gigabytes at imagenet-246m) stay out of OUT_DIR: in memory where there is room
if [ -w /dev/shm ] && (( $(df --output=avail -B1G /dev/shm 2>/dev/null | tail -n 1) + 0 >= 16 )); then
  runs=$(mktemp -d -p /dev/shm)
else
  runs=$(mktemp -d)
fi
"$py" benchmarks/synthetic_shards.py "$runs/shards" --preset "$preset" --images "$images" >/dev/null

train() {  # train NAME BATCH COMPILE LIMIT [STEP [GRAPHS]]: one training run (train.step STEP, default flat;
  # GRAPHS true: train.cuda_graphs), then its rows (also when cut short or failed)
  local name=$1 batch=$2 comp=$3 limit=$4 impl=${5:-flat} graphs=${6:-false}
  [ "$dry" = 1 ] && comp=false
  step "$name" "$limit" "${launcher[@]}" --config ds_imagenet.json --no-progress \
    --set model.preset="$preset" --set "model.overrides=$overrides" --set data.shards="$runs/shards" \
    --set data.tokenizer=null --set train_batch_size="$batch" --set train.steps="$steps" \
    --set train.log_every="$log_every" --set train.sample_every=0 --set train.checkpoint_every=0 \
    --set optimizer.warmup_steps="$log_every" --set train.fast=true --set train.compile="$comp" \
    --set train.step="$impl" --set train.cuda_graphs="$graphs" --set train.output_dir="$runs/$name" || return 0
  local backend="fast-$impl"; [ "$comp" = true ] && backend="$backend+compile"; [ "$graphs" = true ] && backend+=+graphs
  "$py" benchmarks/train_rows.py "$runs/$name" --backend "$backend" --log "$out/$name.log" \
    --out "$out/rows.jsonl" 2>&1 | tail -n 3
  rm -rf "$runs/$name/checkpoints" "$runs/$name/pipeline"  # gigabytes at imagenet-246m, in memory
}

train train-32 "${sizes[0]}" "$compile" 150  # the flat step, compiled: the headline
train train-32-ds "${sizes[0]}" false 90 deepspeed  # DeepSpeed's engine step, eager: the fast step before the flat one
train train-32g "${sizes[0]}" "$compile" 120 flat true  # CUDA graphs (train.cuda_graphs: default off until this wins)
if [ "$dry" = 1 ]; then host=(--size tiny --batch 2 --steps 3 --warmup 1); else
  host=(--size full --batch "${sizes[0]}" --bf16 true --steps 30 --warmup 10); fi
step host 100 bash -c '"$0" benchmarks/host_overhead.py "${@:2}" --reads --json "$1" && "$0" benchmarks/host_overhead.py \
  "${@:2}" --step flat --json "$1"' "$py" "$out/host.jsonl" "${host[@]}"
# guided sampling throughput (imagenet-246m, one GPU, batched): 50 and 2 steps, eager and compiled
if [ "$dry" = 1 ]; then sample=(--size tiny --batch 2) compiled=""; else sample=(--size full --batch 256) compiled=--compile; fi
step sample 120 bash -c 'for n in 50 2; do for c in "" $2; do "$0" benchmarks/sampling_overhead.py "${@:3}" \
  --steps $n $c --json "$1" || exit 1; done; done' "$py" "$out/sample.jsonl" "$compiled" "${sample[@]}"
step gpu-tests 180 "$py" -m pytest -v -p no:cacheprovider -m gpu -rs --durations=15 \
  tests/ops tests/pipeline tests/benchmarks tests/kernels
step gpu-defaults 40 "$py" -m pytest -v -p no:cacheprovider \
  tests/kernels/test_softmax_embedding_average.py::test_the_defaults_launch_what_a_gpu_runs_for_the_dtype
train train-128 "${sizes[1]}" "$compile" 120
VQLCMD_BENCH_SHAPES=goal step bench-softmax 70 "$py" benchmarks/run.py "${bench[@]}" --out "$out/rows.jsonl" \
  --stage softmax_embedding_average --backend "$softmax"
step bench-noise 40 "$py" benchmarks/run.py "${bench[@]}" --out "$out/rows.jsonl" --stage compiled_ops \
  --backend compiled
# FlashAttention-4 against SDPA's flash and cuDNN kernels (stage_attention's flash4 rows; `auto` takes FA4 only
# once these show it winning): scripts/flash4_wheels.sh packs it as two halves, each carried by its own call to the
# same warm machine (.fa4/1, .fa4/2: together past one call's 64 MiB). Missing or broken, the flash4 step says why
# and bench-attention measures SDPA alone.
fa4site=$(mktemp -d)
step flash4 60 bash scripts/flash4_wheels.sh unpack "${FA4_PARTS:-.fa4}" "$fa4site"
[ -f "$fa4site/.imports" ] && export PYTHONPATH="$fa4site:$fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
step bench-attention 240 "$py" benchmarks/run.py "${bench[@]}" --out "$out/rows.jsonl" --stage attention \
  --backend sdpa,sdpa-flash,sdpa-cudnn,flash4
train train-256 "${sizes[2]}" "$compile" 120

qs_dir="$runs/digits"
if step quickstart 300 "${launcher[@]}" --config ds_digits.json --evaluate --no-progress \
    --set train.output_dir="$qs_dir"; then
  cp "$qs_dir/report.json" "$out/quickstart-report.json" 2>/dev/null
  cp "$qs_dir/samples/final.png" "$out/quickstart-samples.png" 2>/dev/null
fi
if [ "$dry" = 1 ]; then
  repro=(--quick --digits-size 32 --tokenizer-steps 20 --seeds 0 --jobs 2 --eval-every 1 --no-few-steps)
else
  repro=(--digits-size 32 --tokenizer-steps 400 --seeds 0 1 2 --steps "${REPRO_STEPS:-4000}" --batch 64 --ns-shift 0
         --per-class 20 --eval-every 500 --patience 3 --jobs 6)
fi
if step reproduce "${REPRO_LIMIT:-480}" "$py" -m studies.reproduce --out "$out/reproduce64" --rows vqlcmd maskgit \
    "${repro[@]}"; then
  timeout 60 "$py" -m studies.reproduce --out "$out/reproduce64" --rows vqlcmd maskgit "${repro[@]}" --report-only \
    >"$out/reproduce-report.log" 2>&1
  echo "=== reproduce report: exit $?"; tail -n "${TAIL_LINES:-20}" "$out/reproduce-report.log"
  rm -rf "$out/reproduce64/runs"  # checkpoints: the records, tables and plots are what comes back
fi
rm -rf "$runs" "$fa4site"
echo "=== done after $(( $(date +%s) - start ))s, $(( deadline - $(date +%s) ))s of the budget left; rows: $out/rows.jsonl"
