// Stand-in for MLX's JIT header, enough to type-check kernel bodies with nvcc (no GPU needed).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cuda/std/array>
#include <cuda/std/limits>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 8>;
using Strides = cuda::std::array<int64_t, 8>;
}
