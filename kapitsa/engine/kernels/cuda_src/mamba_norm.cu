
  __shared__ float partial[32];
  __shared__ float total;
  const int grp = blockIdx.x;
  const size_t base = (size_t)blockIdx.y * INNER + (size_t)grp * GS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float ss = 0.f;
  for (int i = threadIdx.x; i < GS; i += THREADS) {
    const float v = y[base + i] * km_silu(static_cast<float>(gate[base + i]));
    ss += v * v;
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    float v = lane < THREADS / 32 ? partial[lane] : 0.f;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) total = v;
  }
  __syncthreads();
  const float scale = rsqrtf(total / GS + __int_as_float(EPS_BITS));
  for (int i = threadIdx.x; i < GS; i += THREADS) {
    const float v = y[base + i] * km_silu(static_cast<float>(gate[base + i]));
    out[base + i] = static_cast<OutT>(v * scale * static_cast<float>(norm_w[grp * GS + i]));
  }
