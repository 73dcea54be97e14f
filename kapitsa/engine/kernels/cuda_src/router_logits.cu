  // logits[t, e] = x[t] . weight[e] in float32, one warp per (token, weight row): the blocks of a
  // token cover its EW rows WARPS at a time, so the router weight streams over many SMs.
  constexpr int WARPS = BLOCK / 32;
  constexpr int BLOCKS_PER_TOKEN = (EW + WARPS - 1) / WARPS;
  const int token = blockIdx.x / BLOCKS_PER_TOKEN;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e = (blockIdx.x % BLOCKS_PER_TOKEN) * WARPS + warp;
  if (e >= EW) return;
  const T* xr = x + (size_t)token * K;
  const WT* wr = weight + (size_t)e * K;
  float acc = 0.f;
  #pragma unroll
  for (int c = lane * 8; c < K; c += 256) {
    float xv[8], wv[8];
    kq2_load8(xr + c, xv);
    kq2_load8(wr + c, wv);
    #pragma unroll
    for (int t = 0; t < 8; ++t) acc = fmaf(xv[t], wv[t], acc);
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) logits[(size_t)token * EW + e] = acc;
