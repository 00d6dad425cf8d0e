#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4) for a GPU lease, whose image lacks it and cannot fetch it.
#   pack (here, before the lease): fills .fa4/ (git-ignored) with flash-attn-4 and what it needs that the lent
#     image lacks, for that image (CPython 3.12, torch 2.11+cu130, manylinux x86_64): the wheels unpacked into
#     one site folder, packed as one xz archive, cut in two halves, .fa4/1 and .fa4/2. The CUTLASS DSL's CUDA 13
#     libraries alone are a 92 MB wheel (237 MB unpacked, 62 MB as xz), so the whole passes one call's 64 MiB
#     carry and each half travels in its own call to the same warm machine:
#       call 1: carry [".fa4/1"], command `ls -l .fa4/1`
#       call 2, at once (a machine idle for 30 s goes back, and .fa4/1 with it): carry [".fa4/2",
#         ".whl/tree.txt", ".whl/tree.sha256"] (`bash scripts/gpu_prepare.sh --no-wheels` writes the last two),
#         command `STEPS=flash4,bench-attention bash scripts/gpu_check.sh $OUT 420`
#     Versions: flash-attn-4 4.0.0b36 and the newest of each dependency its metadata allows on 2026-12-06;
#     einops, typing-extensions, protobuf and cuda-bindings are on the image already. About 7 minutes of one
#     core (xz -9e).
#   unpack PARTS SITE (there, gpu_check.sh's flash4 step): joins PARTS/1 and PARTS/2 into the folder SITE and
#     imports flash_attn.cute from it, as bench-attention will: SITE and SITE/nvidia_cutlass_dsl/dsl_packages on
#     PYTHONPATH (the DSL's own .pth file, which adds the second, is read only in site-packages folders).
#     Writes SITE/.imports where the import worked.
# Usage: bash scripts/flash4_wheels.sh pack | unpack PARTS SITE
set -euo pipefail
case ${1:-} in
  pack)
    cd "$(dirname "$0")/.."
    packages=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
              nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
              torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    pip download --quiet --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$tmp/wheels" "${packages[@]}"
    mkdir -p "$tmp/site"
    # a wheel is a zip of its site-packages files (none of these has a .data folder to place elsewhere)
    for w in "$tmp"/wheels/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
    tar -C "$tmp/site" -cf - . | xz -9e -T1 > "$tmp/site.tar.xz"
    rm -rf .fa4 && mkdir -p .fa4/1 .fa4/2
    (cd "$tmp" && split -n 2 -d site.tar.xz site.tar.xz.)
    mv "$tmp/site.tar.xz.00" .fa4/1/ && mv "$tmp/site.tar.xz.01" .fa4/2/
    du -sh .fa4/1 .fa4/2 ;;
  unpack)
    parts=${2:?usage: flash4_wheels.sh unpack PARTS SITE} site=${3:?usage: flash4_wheels.sh unpack PARTS SITE}
    if ! halves=$(ls "$parts"/1/* "$parts"/2/* 2>/dev/null); then
      echo "no FlashAttention-4 here: $parts/1 and $parts/2 are not both carried (bash scripts/flash4_wheels.sh" \
           "pack, then one call carrying $parts/1 and the next, to the same warm machine, $parts/2)"
      exit 1
    fi
    # shellcheck disable=SC2086  # the halves' names have no spaces: they are split's
    cat $halves | xz -dc | tar -x -C "$site"
    py=$(command -v python3 || command -v python)
    PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "
import importlib.metadata as m
import flash_attn.cute
print('flash-attn-4', m.version('flash-attn-4'), 'nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))"
    touch "$site/.imports" ;;
  *) echo "usage: bash scripts/flash4_wheels.sh pack | unpack PARTS SITE" >&2; exit 2 ;;
esac
