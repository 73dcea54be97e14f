  // Decode attention, part 2: block (b * HQ + query head, 32-wide slice of D), one warp, merges
  // the P partials of attn_partial.cu (max m_i, sum l_i, weighted values o_i; P read from
  // part_ml's shape, at most MAX_P): out = sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i with
  // M = max m_i; a partial that saw no key has m = -inf and weighs 0. The warp finds M and the
  // denominator (each lane a stride of the partials, then shuffles) and keeps each partial's
  // weight in shared memory, so a lane's pass over its value index is one multiply-add per
  // partial. Slicing D gives a batch-1 step B * HQ * D / 32 blocks instead of B * HQ. The result
  // is written as [B, Hq * D] (what the output projection reads), times sigmoid(gate) when GATE.
  constexpr int SLICES = D / 32;
  __shared__ float weight[MAX_P];
  const int P = part_ml_shape[1];
  const int bq = blockIdx.x / SLICES, slice = blockIdx.x % SLICES;
  const int b = bq / HQ, hq = bq % HQ;
  const int lane = threadIdx.x & 31;
  const float* ml = part_ml + (size_t)bq * P * 2;
  float M = __int_as_float(-8388608);
  for (int p = lane; p < P; p += 32) M = fmaxf(M, ml[p * 2]);
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  float denom = 0.f;
  for (int p = lane; p < P; p += 32) {
    const float e = expf(ml[p * 2] - M);
    weight[p] = e;
    denom = fmaf(e, ml[p * 2 + 1], denom);
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, o);
  __syncwarp();
  const int d = slice * 32 + lane;
  const float* po = part_o + (size_t)bq * P * D + d;
  float o = 0.f;
  #pragma unroll 4
  for (int p = 0; p < P; ++p) o = fmaf(weight[p], po[(size_t)p * D], o);
  o = o / denom;
  const size_t at = (size_t)b * HQ * D + (size_t)hq * D + d;
  if (GATE) o = o / (1.f + expf(-(float)gate[at]));
  out[at] = (T)o;
