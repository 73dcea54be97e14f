  // Decode attention, part 1 (flash decoding): block (b, kv head, split) runs an online softmax of
  // the NREP query heads that share kv head h over its split of the L valid keys. Each warp takes
  // every WARPS-th key of the split and keeps, per query, the running max m, the sum l and the
  // weighted sum of values (DL = D / 32 values per lane); it writes them as one partial.
  // meta = (L, capacity, S): runtime values, so neither a growing cache nor another split count
  // recompiles.
  // The next key's row is loaded before the current one is used: a warp's loop is a chain of
  // dependent shuffles, and the load's latency hides behind it instead of adding to it.
  constexpr int WARPS = 4;
  constexpr int DL = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int L = meta[0], cap = meta[1], S = meta[2];
  const int split = blockIdx.x % S;
  const int bh = blockIdx.x / S;  // b * HKV + h
  const int chunk = (L + S - 1) / S;
  const int start = split * chunk, stop = min(L, start + chunk);
  const float NEG_INF = __int_as_float(-8388608);
  const float SCALE = __int_as_float(SCALE_BITS);
  float qv[NREP][DL], acc[NREP][DL], m[NREP], l[NREP];
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    const T* qr = q + ((size_t)bh * NREP + r) * D + lane * DL;
    #pragma unroll
    for (int i = 0; i < DL; ++i) {
      qv[r][i] = (float)qr[i] * SCALE;
      acc[r][i] = 0.f;
    }
    m[r] = NEG_INF;
    l[r] = 0.f;
  }
  const T* kb = k + (size_t)bh * cap * D + lane * DL;
  const T* vb = v + (size_t)bh * cap * D + lane * DL;
  float kn[DL], vn[DL];  // the next key's row
  int j = start + warp;
  if (j < stop) {
    #pragma unroll
    for (int i = 0; i < DL; ++i) {
      kn[i] = (float)kb[(size_t)j * D + i];
      vn[i] = (float)vb[(size_t)j * D + i];
    }
  }
  for (; j < stop; j += WARPS) {
    float kv[DL], vv[DL];
    #pragma unroll
    for (int i = 0; i < DL; ++i) {
      kv[i] = kn[i];
      vv[i] = vn[i];
    }
    if (j + WARPS < stop) {
      #pragma unroll
      for (int i = 0; i < DL; ++i) {
        kn[i] = (float)kb[(size_t)(j + WARPS) * D + i];
        vn[i] = (float)vb[(size_t)(j + WARPS) * D + i];
      }
    }
    #pragma unroll
    for (int r = 0; r < NREP; ++r) {
      float s = 0.f;
      #pragma unroll
      for (int i = 0; i < DL; ++i) s = fmaf(qv[r][i], kv[i], s);
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const float mn = fmaxf(m[r], s);
      const float corr = expf(m[r] - mn), p = expf(s - mn);
      l[r] = l[r] * corr + p;
      #pragma unroll
      for (int i = 0; i < DL; ++i) acc[r][i] = fmaf(acc[r][i], corr, p * vv[i]);
      m[r] = mn;
    }
  }
  const int parts = S * WARPS;  // partials per query
  const int part = split * WARPS + warp;
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    const size_t row = ((size_t)bh * NREP + r) * parts + part;
    #pragma unroll
    for (int i = 0; i < DL; ++i) part_o[row * D + lane * DL + i] = acc[r][i];
    if (lane == 0) {
      part_ml[row * 2] = m[r];
      part_ml[row * 2 + 1] = l[r];
    }
  }
