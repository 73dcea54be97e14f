  // Decode attention, part 1 (flash decoding): block (b, kv head, split) runs an online softmax of
  // the NREP query heads that share kv head h over its split of the L valid keys. Each warp takes
  // every WARPS-th key of the split and keeps, per query, the running max m, the sum l and the
  // weighted sum of values (DL = D / 32 values per lane); the block then merges its warps' through
  // shared memory and writes one partial per query, so the combine reads S partials, not S * WARPS.
  // Row b's keys 0..P-1 are rows of k/v (capacity cap), keys P..L-1 rows 0..L-P-1 of tk/tv
  // (capacity tcap): the cache's buffer and the tail of rows written since it was last folded in.
  // meta = (cap, S, tcap, HKV, stride, then L and P of each row, or once for every row with
  // stride 0): runtime values, so neither a growing cache, rows at different positions nor
  // another split count recompiles.
  // The next key's row is loaded before the current one is used: a warp's loop is a chain of
  // dependent shuffles, and the load's latency hides behind it instead of adding to it. A lane's
  // slice of a row is loaded as 16-byte words where its size and the buffers' alignment allow.
  constexpr int WARPS = 4;
  constexpr int DL = D / 32;
  constexpr bool VEC = (DL * sizeof(T)) % 16 == 0;
  constexpr int WORDS = VEC ? DL * sizeof(T) / 16 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int cap = meta[0], S = meta[1], tcap = meta[2], HKV = meta[3];
  const int split = blockIdx.x % S;
  const int bh = blockIdx.x / S;  // b * HKV + h
  const int span = 5 + bh / HKV * meta[4];
  const int L = meta[span], P = meta[span + 1];
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
  const T* tkb = tk + (size_t)bh * tcap * D + lane * DL;
  const T* tvb = tv + (size_t)bh * tcap * D + lane * DL;
  const bool words = VEC && (((size_t)kb | (size_t)vb | (size_t)tkb | (size_t)tvb) % 16 == 0);
  auto key_row = [&](int j) { return j < P ? kb + (size_t)j * D : tkb + (size_t)(j - P) * D; };
  auto value_row = [&](int j) { return j < P ? vb + (size_t)j * D : tvb + (size_t)(j - P) * D; };
  auto load = [&](const T* src, float* dst) {
    if constexpr (VEC) {
      if (words) {
        uint4 raw[WORDS];
        #pragma unroll
        for (int w = 0; w < WORDS; ++w) raw[w] = reinterpret_cast<const uint4*>(src)[w];
        const T* vals = reinterpret_cast<const T*>(raw);
        #pragma unroll
        for (int i = 0; i < DL; ++i) dst[i] = (float)vals[i];
        return;
      }
    }
    #pragma unroll
    for (int i = 0; i < DL; ++i) dst[i] = (float)src[i];
  };
  float kn[DL], vn[DL];  // the next key's row
  int j = start + warp;
  if (j < stop) {
    load(key_row(j), kn);
    load(value_row(j), vn);
  }
  for (; j < stop; j += WARPS) {
    float kv[DL], vv[DL];
    #pragma unroll
    for (int i = 0; i < DL; ++i) {
      kv[i] = kn[i];
      vv[i] = vn[i];
    }
    if (j + WARPS < stop) {
      load(key_row(j + WARPS), kn);
      load(value_row(j + WARPS), vn);
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
  // The block's merge: per (query, value index) the warps' sums rescaled to the block's max. A
  // warp that saw no key has m = -inf and weighs 0; a split that saw none writes m = -inf, l = 0.
  __shared__ float warp_acc[WARPS][NREP][D];
  __shared__ float warp_m[WARPS][NREP], warp_l[WARPS][NREP];
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    #pragma unroll
    for (int i = 0; i < DL; ++i) warp_acc[warp][r][lane * DL + i] = acc[r][i];
    if (lane == 0) {
      warp_m[warp][r] = m[r];
      warp_l[warp][r] = l[r];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < NREP * D; e += WARPS * 32) {
    const int r = e / D, d = e % D;
    float M = warp_m[0][r];
    #pragma unroll
    for (int w = 1; w < WARPS; ++w) M = fmaxf(M, warp_m[w][r]);
    float o = 0.f, sum = 0.f;
    if (M != NEG_INF) {
      #pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float c = expf(warp_m[w][r] - M);
        o = fmaf(c, warp_acc[w][r][d], o);
        sum = fmaf(c, warp_l[w][r], sum);
      }
    }
    const size_t row = ((size_t)bh * NREP + r) * S + split;
    part_o[row * D + d] = o;
    if (d == 0) {
      part_ml[row * 2] = M;
      part_ml[row * 2 + 1] = sum;
    }
  }
