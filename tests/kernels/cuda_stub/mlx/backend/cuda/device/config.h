// What MLX's device/config.h (shipped in its CUDA wheel, not in the CPU one) defines, for nvcc here.
#pragma once
#define MAX_NDIM 10
#define WARP_SIZE 32
