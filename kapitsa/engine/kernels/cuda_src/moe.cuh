
#include <cuda_bf16.h>
#include <cuda_fp16.h>
