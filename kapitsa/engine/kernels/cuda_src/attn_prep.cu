  // Attention's inputs for a short step, from the fused q/k/v projection's output qkv
  // [ROWS, TOK, N] (N = HQ * QW + 2 * HKV * D; each query head's QW = D values, or 2 * D when
  // GATED: D query values, then D gate values, as Qwen3.5's q_proj lays them out): one warp per
  // (row, token, head slot), slots [0, HQ) the query heads, [HQ, HQ + HKV) the key heads, then
  // the value heads. Query and key heads are RMS-normalised with their weight when NORM (rounded
  // to T, as the norm's output is), then their first R values rotated (NeoX halves) at position
  // offsets[row] + token; values are copied. Written as q [ROWS, HQ, TOK, D], k and v
  // [ROWS, HKV, TOK, D] (the layout the KV cache and the attention take) and, when GATED, the gate
  // [ROWS, TOK, HQ * D]. A lane holds the values lane, lane + 32, ...; the rotation's partner
  // value comes through the warp's row of shared memory.
  constexpr int SLOTS = HQ + 2 * HKV;
  constexpr int PER = D / 32;
  constexpr int QW = GATED ? 2 * D : D;
  constexpr int N = HQ * QW + 2 * HKV * D;
  constexpr int HALF = R / 2;
  __shared__ float rowbuf[WARPS][D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ROWS = qkv_shape[0], TOK = qkv_shape[1];  // at run time: one compile for every batch
  const int task = blockIdx.x * WARPS + warp;
  if (task >= ROWS * TOK * SLOTS) return;
  const int slot = task % SLOTS, rt = task / SLOTS;
  const int row = rt / TOK, tok = rt % TOK;
  const T* src = qkv + (size_t)rt * N;
  if (slot >= HQ + HKV) {
    const int h = slot - HQ - HKV;
    const T* from = src + HQ * QW + HKV * D + h * D;
    T* to = v + (((size_t)row * HKV + h) * TOK + tok) * D;
    for (int e = lane; e < D; e += 32) to[e] = from[e];
    return;
  }
  const bool is_q = slot < HQ;
  const int h = is_q ? slot : slot - HQ;
  const T* from = is_q ? src + h * QW : src + HQ * QW + h * D;
  if (GATED && is_q) {
    T* to = gate + (size_t)rt * HQ * D + h * D;
    for (int e = lane; e < D; e += 32) to[e] = from[D + e];
  }
  float x[PER];
  float ss = 0.f;
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    x[j] = (float)from[lane + 32 * j];
    ss = fmaf(x[j], x[j], ss);
  }
  if (NORM) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss / D + __int_as_float(EPS_BITS));
    const T* w = is_q ? q_w : k_w;
    #pragma unroll
    for (int j = 0; j < PER; ++j) x[j] = (float)(T)(x[j] * inv * (float)w[lane + 32 * j]);
  }
  if (R > 0) {
    #pragma unroll
    for (int j = 0; j < PER; ++j) rowbuf[warp][lane + 32 * j] = x[j];
    __syncwarp();
    const float pos = (float)(offsets[row] + tok);
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int e = lane + 32 * j;
      if (e < R) {
        const int i = e < HALF ? e : e - HALF;
        const float angle = pos * (float)inv_freq[i];
        const float c = cosf(angle), s = sinf(angle);
        x[j] = e < HALF ? x[j] * c - rowbuf[warp][e + HALF] * s : x[j] * c + rowbuf[warp][e - HALF] * s;
      }
    }
  }
  T* to = (is_q ? q + (((size_t)row * HQ + h) * TOK + tok) * D : k + (((size_t)row * HKV + h) * TOK + tok) * D);
  #pragma unroll
  for (int j = 0; j < PER; ++j) to[lane + 32 * j] = (T)x[j];
