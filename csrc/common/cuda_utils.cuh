// CUDA helpers shared by the .cu files: packed loads, launch sizes, and the
// device-side flag that turns an out-of-range token id into a host error.
#pragma once

// c10 headers only: ATen/cuda/CUDAContext.h would pull in cuBLAS and cuSPARSE
// headers, which a bare CUDA toolkit (like CI's) does not ship.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace vqlcmd::cuda {

// Four consecutive elements moved as one aligned load or store (16 bytes for
// fp32, 8 for bf16/fp16): fewer memory instructions, full sectors per warp.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

// kPack (1 or 4) elements of T to or from floats; 4 move as one Pack4, so the caller guarantees 4-element
// alignment (aligned4 on the base pointer and a row length divisible by 4).
template <int kPack, typename T>
__device__ __forceinline__ void load(const T* p, float (&v)[kPack]) {
  static_assert(kPack == 1 || kPack == 4, "kPack is 1 or 4");
  if constexpr (kPack == 4) {
    const Pack4<T> x = *reinterpret_cast<const Pack4<T>*>(p);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = static_cast<float>(x.v[j]);
  } else {
    v[0] = static_cast<float>(*p);
  }
}

template <int kPack, typename T>
__device__ __forceinline__ void store(T* p, const float (&v)[kPack]) {
  static_assert(kPack == 1 || kPack == 4, "kPack is 1 or 4");
  if constexpr (kPack == 4) {
    Pack4<T> x;
#pragma unroll
    for (int j = 0; j < 4; ++j) x.v[j] = static_cast<T>(v[j]);
    *reinterpret_cast<Pack4<T>*>(p) = x;
  } else {
    *p = static_cast<T>(v[0]);
  }
}

template <typename T>
inline bool aligned4(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0;
}

constexpr int kThreads = 256;

// Grid for a grid-stride loop over `work` items: enough blocks to fill the GPU,
// never more than the work needs.
// The device a CUDA launcher guards and launches on, taken from one of its tensors. The dispatcher picks
// the CUDA kernel when any argument is on a GPU, so that tensor may be a CPU one: refused here by name
// (CUDAGuard would fail with an internal assert), the others by check_device in the argument helpers.
inline at::Device op_device(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), name, " must be on the CUDA device of the op's other tensors, got ", x.device());
  return x.device();
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Multiprocessors of the current device (132 on an H100 SXM).
inline int multiprocessors() {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return sms;
}

inline int blocks_for(int64_t work) {
  const int64_t need = (work + kThreads - 1) / kThreads;
  const int64_t fill = static_cast<int64_t>(multiprocessors()) * 16;
  return static_cast<int>(std::max<int64_t>(1, std::min(need, fill)));
}

// Kernels that meet an id outside the table skip the read, write NaN and raise
// this flag; the launcher turns it into an error (kernels must not crash or
// read out of bounds on bad ids). Reading it costs one device sync per call, so
// the flag is off (ptr() is null, kernels only write NaN) where a sync is illegal
// or unwanted: while the stream is captured into a CUDA graph, and when the user
// sets VQLCMD_CHECK_IDS=0 (the data loader has checked the ids already). A bad id
// then shows up as a non-finite loss, which the engine stops on by name.
// Read at every call, as the Python side reads it (a getenv is nothing beside a launch): a value cached at
// the first call disagreed with Python's once the switch changed, checking twice or never.
inline bool id_checks_enabled() {
  const char* v = std::getenv("VQLCMD_CHECK_IDS");
  std::string value = v == nullptr ? "" : v;
  for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool off = value == "0" || value == "false" || value == "no" || value == "off";
  TORCH_CHECK(off || value.empty() || value == "1" || value == "true" || value == "yes" || value == "on",
              "VQLCMD_CHECK_IDS must be a yes/no value (1/true/yes/on or 0/false/no/off), got '", v, "'");
  return !off && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
}

struct BadIdFlag {
  at::Tensor flag;  // undefined when checks are off
  explicit BadIdFlag(const at::Device& device) {
    if (id_checks_enabled()) flag = at::zeros({1}, at::TensorOptions().device(device).dtype(at::kInt));
  }
  int* ptr() { return flag.defined() ? flag.data_ptr<int>() : nullptr; }
  void check(const char* op, int64_t rows) {
    if (!flag.defined()) return;
    TORCH_CHECK_INDEX(flag.item<int>() == 0, op, ": a token id is outside the table's rows [0, ", rows, ")");
  }
};

}  // namespace vqlcmd::cuda
