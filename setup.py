"""Build of the vqlcmd package.

The Triton kernels live in the top-level folder ``kernels/`` (DESIGN.md) and are
installed as the sub-package ``vqlcmd.kernels`` (a top-level package named
``kernels`` would clash with an unrelated PyPI package of that name). The link
``vqlcmd/kernels -> ../kernels`` makes that one package in every install mode:
setuptools' lenient editable finder maps only top-level packages, so a
``package_dir`` entry alone would leave ``vqlcmd.kernels`` unimportable from an
editable install.

The C++/CUDA extension ``vqlcmd._C`` is built from ``csrc/`` by one convention
that CMakeLists.txt follows too, so there is no second file list to keep in
sync: every ``csrc/**/*.cpp`` is compiled always, every ``csrc/**/*.cu`` when a
CUDA toolkit is found. Environment:

- ``CUDA_HOME``: the toolkit; defaults to /usr/local/cuda when that exists (the
  ``nvcc`` on PATH may be a wrapper from which torch guesses a wrong home).
- ``TORCH_CUDA_ARCH_LIST``: architectures; default ``9.0`` (sm_90). Each extra
  architecture compiles every .cu file again, and CI has 2 cores.
- ``VQLCMD_SKIP_CUDA=1``: CPU kernels only, even with a toolkit.
- ``VQLCMD_CPU_AVX2=0``: portable CPU vectors instead of AVX2 (built by default
  when the build machine has AVX2, FMA and F16C).
- ``MAX_JOBS``: parallel compile jobs (ninja); default: the number of cores.
- ``VQLCMD_DEBUG_INFO=1``: keep debug info. By default ``-g0`` overrides the ``-g`` that Python's own
  CFLAGS add: the torch-header-heavy C++ files then compile in 50 s instead of 88 s on 2 cores.
"""
import glob
import os
import platform
import re
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # before torch.utils.cpp_extension reads it
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", pattern),
                                                             recursive=True))


def _has_avx2() -> bool:
    if os.environ.get("VQLCMD_CPU_AVX2", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


def _nvcc_version(cuda_home: str) -> str:
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else ""


def _extension():
    """(extension, summary); extension is None when torch is missing (nothing to build against)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None, "vqlcmd._C not built: torch is not importable at build time (use --no-build-isolation)"
    cuda_home = cpp_extension.CUDA_HOME
    cuda_sources = _sources("*.cu")
    want_cuda = os.environ.get("VQLCMD_SKIP_CUDA", "0") != "1"
    nvcc_version = _nvcc_version(cuda_home) if cuda_home else ""
    with_cuda = bool(want_cuda and cuda_sources and torch.version.cuda and nvcc_version)
    arch_list = os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else ""
    # -fopenmp: at::parallel_for is an inline `#pragma omp parallel` in ATen's headers, so without it
    # every CPU kernel ran on one thread (ignored pragmas compile silently). The OpenMP runtime is
    # the libgomp.so.1 that torch already loaded, found by its soname.
    cxx = ["-O3", "-fopenmp", "-Wno-unknown-pragmas"]
    if os.environ.get("VQLCMD_DEBUG_INFO", "0") != "1":
        cxx.append("-g0")
    if _has_avx2():
        # at::vec::Vectorized<float> as AVX2 (its Sleef calls resolve in libtorch_cpu)
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    defines = [f'-DVQLCMD_CUDA_ARCH_LIST="{arch_list}"', f'-DVQLCMD_CUDA_VERSION="{nvcc_version}"']
    kwargs = dict(name="vqlcmd._C", sources=_sources("*.cpp"), include_dirs=[os.path.join(ROOT, "csrc")],
                  extra_link_args=["-fopenmp"])
    if with_cuda:
        nvcc = ["-O3", "-lineinfo", "-DVQLCMD_WITH_CUDA", *defines]
        ext = cpp_extension.CUDAExtension(sources=kwargs.pop("sources") + cuda_sources, **kwargs,
                                          extra_compile_args={"cxx": cxx + ["-DVQLCMD_WITH_CUDA", *defines],
                                                              "nvcc": nvcc})
        built = f"CPU kernels + CUDA kernels (CUDA {nvcc_version}, arch {arch_list}, CUDA_HOME={cuda_home})"
    else:
        ext = cpp_extension.CppExtension(**kwargs, extra_compile_args={"cxx": cxx + defines})
        why = ("VQLCMD_SKIP_CUDA=1" if not want_cuda else
               "torch has no CUDA build" if not torch.version.cuda else f"no nvcc under CUDA_HOME={cuda_home}")
        built = f"CPU kernels only ({why})"
    vec = "AVX2" if "-mavx2" in cxx else "portable vectors"
    return (ext, cpp_extension.BuildExtension), f"vqlcmd._C: {built}; CPU {vec}"


_ext, _summary = _extension()
setup(
    packages=find_packages(include=["vqlcmd", "vqlcmd.*"]),
    ext_modules=[_ext[0]] if _ext else [],
    cmdclass={"build_ext": _ext[1]} if _ext else {},
)
print(f"[vqlcmd] built {_summary}" if _ext else f"[vqlcmd] {_summary}", file=sys.stderr)
