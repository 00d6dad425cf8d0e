// Lets the torch-free math headers compile unchanged with g++ (CPU kernels, ctest)
// and with nvcc (CUDA kernels): one definition of the math, two instruction sets.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define VQLCMD_HD __host__ __device__ __forceinline__
#else
#define VQLCMD_HD inline
#endif
