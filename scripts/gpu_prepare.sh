#!/usr/bin/env bash
# Run here, right before a GPU lease: fills .whl/ (git-ignored; the lease carries it) with what the lent image
# lacks and scripts/gpu_check.sh installs, and writes the tree manifest that names the measured tree.
#   - wheels (once; kept): DeepSpeed (requirements.txt's version) built as a pure-Python wheel (DS_BUILD_OPS=0:
#     its ops are JIT-built on use, and the engine uses none on GPU), and its dependencies for CPython 3.10-3.13
#     on manylinux x86_64 (the image's Python is not known here; pip on the machine picks the matching files).
#     About 25 MiB. Also diffusers (requirements.txt's version; the digits tokenizer's VQModel, for the
#     `quickstart` step) without its dependencies: the lent H200 image (2026-11-28) had all of them but
#     importlib_metadata and its lazy_importer, and with them (numpy, Pillow, ...) for four Pythons the carry
#     would pass its 64 MiB.
#   - .whl/tree.txt: `git describe --dirty`, and for a dirty tree the hash of the manifest beside it;
#     .whl/tree.sha256: sha256 of every tracked and untracked, not ignored, regular file. gpu_check.sh verifies the
#     copy on the machine against it, so every row's `commit` names the exact tree that ran.
# Usage: bash scripts/gpu_prepare.sh [--no-wheels]
set -euo pipefail
cd "$(dirname "$0")/.."
whl=.whl
mkdir -p "$whl"
# the versions requirements.txt pins, so the lease runs what CI tests
ds=$(sed -n 's/^deepspeed==//p' requirements.txt)
diffusers=$(grep -m1 '^diffusers==' requirements.txt)
if [ "${1:-}" != --no-wheels ] && ! ls "$whl"/deepspeed-"$ds"-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  pip download --quiet deepspeed=="$ds" --no-deps --no-binary :all: -d "$tmp"
  DS_BUILD_OPS=0 pip wheel --quiet --no-deps --no-build-isolation "$tmp"/deepspeed-"$ds".tar.gz -w "$whl"
  rm -rf "$tmp"
fi
if [ "${1:-}" != --no-wheels ] && ! ls "$whl"/pydantic_core-*cp313*.whl >/dev/null 2>&1; then
  for py in 3.10 3.11 3.12 3.13; do
    pip download --quiet --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$whl" \
      hjson py-cpuinfo msgpack ninja einops nvidia-ml-py pydantic psutil packaging tqdm safetensors
  done
fi
if [ "${1:-}" != --no-wheels ] && ! ls "$whl"/diffusers-*.whl >/dev/null 2>&1; then
  pip download --quiet --only-binary=:all: --no-deps -d "$whl" "$diffusers" importlib_metadata lazy_importer
fi
# regular files only (a symlink such as vqlcmd/kernels -> ../kernels is no file to hash)
git ls-files -co --exclude-standard -z | sort -z \
  | xargs -0 sh -c 'for f; do [ -L "$f" ] || [ ! -f "$f" ] || printf "%s\0" "$f"; done' _ \
  | xargs -0 sha256sum > "$whl/tree.sha256"
describe=$(git describe --always --dirty --abbrev=12)
case $describe in
  *-dirty) echo "$describe tree $(sha256sum < "$whl/tree.sha256" | cut -c1-12)" > "$whl/tree.txt" ;;
  *) echo "$describe" > "$whl/tree.txt" ;;
esac
echo "tree: $(cat "$whl/tree.txt"); .whl: $(du -sh "$whl" | cut -f1)"
