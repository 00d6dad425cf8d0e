// The Python module vqlcmd._C: importing it loads the library, which registers
// the torch.ops.vqlcmd operators; the module itself only reports how it was built.
#include <Python.h>
#include <pybind11/pybind11.h>

#ifndef VQLCMD_CUDA_ARCH_LIST
#define VQLCMD_CUDA_ARCH_LIST ""
#endif
#ifndef VQLCMD_CUDA_VERSION
#define VQLCMD_CUDA_VERSION ""
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "VQ-LCMD compiled kernels (csrc/); the ops are torch.ops.vqlcmd.*";
  py::dict info;
#ifdef VQLCMD_WITH_CUDA
  info["with_cuda"] = true;
#else
  info["with_cuda"] = false;
#endif
  info["cuda_version"] = VQLCMD_CUDA_VERSION;
  info["cuda_arch_list"] = VQLCMD_CUDA_ARCH_LIST;
#if defined(__clang__)
  info["compiler"] = "clang " __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = "gcc " __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
  // at::parallel_for is an inline OpenMP pragma in ATen's headers: without
  // -fopenmp the CPU kernels compile fine and run on one thread
#ifdef _OPENMP
  info["openmp"] = true;
#else
  info["openmp"] = false;
#endif
#ifdef CPU_CAPABILITY_AVX2
  info["cpu_vector"] = "AVX2";
#else
  info["cpu_vector"] = "default";
#endif
  m.attr("build_info") = info;
}
