  // Decode attention, part 2: block (b, query head) merges the P partials of attn_partial.cu (max
  // m_i, sum l_i, weighted values o_i; P read from part_ml's shape, at most MAX_P): out =
  // sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i with M = max m_i; a partial that saw no key has
  // m = -inf and weighs 0. The block finds M and the denominator together (each thread a stride of
  // the partials, then across warps) and keeps each partial's weight in shared memory, so a
  // thread's pass over the values is one multiply-add per partial. The result is written as
  // [B, Hq * D] (what the output projection reads), times sigmoid(gate) when GATE.
  constexpr int NW = THREADS / 32;
  __shared__ float weight[MAX_P];
  __shared__ float across[NW];
  const int P = part_ml_shape[1];
  const int bq = blockIdx.x;  // b * HQ + query head
  const int b = bq / HQ, hq = bq % HQ;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* ml = part_ml + (size_t)bq * P * 2;
  float M = __int_as_float(-8388608);
  for (int p = threadIdx.x; p < P; p += THREADS) M = fmaxf(M, ml[p * 2]);
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if (lane == 0) across[warp] = M;
  __syncthreads();
  M = across[0];
  for (int w = 1; w < NW; ++w) M = fmaxf(M, across[w]);
  __syncthreads();
  float denom = 0.f;
  for (int p = threadIdx.x; p < P; p += THREADS) {
    const float e = expf(ml[p * 2] - M);
    weight[p] = e;
    denom = fmaf(e, ml[p * 2 + 1], denom);
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, o);
  if (lane == 0) across[warp] = denom;
  __syncthreads();
  denom = 0.f;
  for (int w = 0; w < NW; ++w) denom += across[w];
  const float* po = part_o + (size_t)bq * P * D;
  for (int d = threadIdx.x; d < D; d += THREADS) {
    float o = 0.f;
    for (int p = 0; p < P; ++p) o = fmaf(weight[p], po[(size_t)p * D + d], o);
    o = o / denom;
    const size_t at = (size_t)b * HQ * D + (size_t)hq * D + d;
    if (GATE) o = o / (1.f + expf(-(float)gate[at]));
    out[at] = (T)o;
  }
