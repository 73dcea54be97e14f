
  constexpr int CH = 128 / BITS;               // values per 16-byte chunk
  constexpr int NCH = K / CH;
  constexpr int NSTEPS = (NCH + 3) / 4;        // a warp step: lanes t = 0..3 take chunks 4s + t
  constexpr int GROUPS = K / GS;
  constexpr int XV = CH / 8;                   // 16-byte x loads per chunk (8 values each)
  __shared__ float kq3_red[W][TM][4][32];      // per-warp partial sums (K is split over warps)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * 16 * TM;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  const uint4* xv = reinterpret_cast<const uint4*>(x + (size_t)(g < M ? g : 0) * K);
  int rows[TM][2];
  #pragma unroll
  for (int tm = 0; tm < TM; ++tm) {
    rows[tm][0] = min(tile0 + 16 * tm + g, N - 1);  // past N: recompute row N-1, never stored
    rows[tm][1] = min(tile0 + 16 * tm + g + 8, N - 1);
  }
  float c[TM][4];
  #pragma unroll
  for (int tm = 0; tm < TM; ++tm) { c[tm][0] = c[tm][1] = c[tm][2] = c[tm][3] = 0.f; }

  uint4 wq[TM][2], xq[XV];
  float sc[TM][2], bi[TM][2];
  // One step's loads: this lane's chunk of each of its 2 * TM rows, their scale and bias, and
  // (lanes g < M) the chunk's x values; a chunk past the row or a padding column reads x = 0.
  auto load = [&](int s, uint4 (&wq_)[TM][2], uint4 (&xq_)[XV], float (&sc_)[TM][2], float (&bi_)[TM][2]) {
    const int chunk = 4 * s + t;
    const int cc = chunk < NCH ? chunk : 0;
    #pragma unroll
    for (int tm = 0; tm < TM; ++tm) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        wq_[tm][h] = wv[(size_t)rows[tm][h] * NCH + cc];
        sc_[tm][h] = (float)scales[rows[tm][h] * GROUPS + cc * CH / GS];
        bi_[tm][h] = (float)biases[rows[tm][h] * GROUPS + cc * CH / GS];
      }
    }
    const bool live = g < M && chunk < NCH;
    #pragma unroll
    for (int v = 0; v < XV; ++v) xq_[v] = live ? xv[cc * XV + v] : make_uint4(0u, 0u, 0u, 0u);
  };
  if (warp < NSTEPS) load(warp, wq, xq, sc, bi);
  for (int s = warp; s < NSTEPS; s += W) {
    uint4 wn[TM][2], xn[XV];
    float sn[TM][2], bn[TM][2];
    if (s + W < NSTEPS) load(s + W, wn, xn, sn, bn);
    uint32_t s2[TM][2], b2[TM][2];               // (scale, scale), (bias, bias) in T, for 4-bit
    #pragma unroll
    for (int tm = 0; tm < TM; ++tm) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        s2[tm][h] = BITS == 4 ? kq3_pair(sc[tm][h], x) : 0u;
        b2[tm][h] = BITS == 4 ? kq3_pair(bi[tm][h], x) : 0u;
      }
    }
    #pragma unroll
    for (int word = 0; word < 4; ++word) {
      if constexpr (BITS == 4) {
        // x values 8 * word .. + 7 of the chunk, paired (i, i + 4) like the weights
        const uint4 u = xq[word];
        const uint32_t b[4] = {__byte_perm(u.x, u.z, 0x5410u), __byte_perm(u.x, u.z, 0x7632u),
                               __byte_perm(u.y, u.w, 0x5410u), __byte_perm(u.y, u.w, 0x7632u)};
        #pragma unroll
        for (int tm = 0; tm < TM; ++tm) {
          uint32_t p[2][4];
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 q = wq[tm][h];
            const uint32_t wd = word == 0 ? q.x : word == 1 ? q.y : word == 2 ? q.z : q.w;
            #pragma unroll
            for (int i = 0; i < 4; ++i) p[h][i] = kq3_deq4(wd, i, s2[tm][h], b2[tm][h], x);
          }
          const uint32_t a0[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
          const uint32_t a1[4] = {p[0][2], p[1][2], p[0][3], p[1][3]};
          kq3_mma(c[tm], a0, b[0], b[1], x);
          kq3_mma(c[tm], a1, b[2], b[3], x);
        }
      } else {
        // x values 4 * word .. + 3 of the chunk, in order
        const uint4 u = xq[word >> 1];
        const uint32_t b0 = (word & 1) ? u.z : u.x, b1 = (word & 1) ? u.w : u.y;
        #pragma unroll
        for (int tm = 0; tm < TM; ++tm) {
          uint32_t a[4];
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 q = wq[tm][h];
            const uint32_t wd = word == 0 ? q.x : word == 1 ? q.y : word == 2 ? q.z : q.w;
            a[h] = kq3_deq8(wd, 0, sc[tm][h], bi[tm][h], x);
            a[2 + h] = kq3_deq8(wd, 1, sc[tm][h], bi[tm][h], x);
          }
          kq3_mma(c[tm], a, b0, b1, x);
        }
      }
    }
    #pragma unroll
    for (int tm = 0; tm < TM; ++tm) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) { wq[tm][h] = wn[tm][h]; sc[tm][h] = sn[tm][h]; bi[tm][h] = bn[tm][h]; }
    }
    #pragma unroll
    for (int v = 0; v < XV; ++v) xq[v] = xn[v];
  }

  #pragma unroll
  for (int tm = 0; tm < TM; ++tm) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) kq3_red[warp][tm][e][lane] = c[tm][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < TM * 4 * 32; i += W * 32) {
    const int tm = i / 128, e = (i / 32) & 3, l = i & 31;
    float v = 0.f;
    #pragma unroll
    for (int ww = 0; ww < W; ++ww) v += kq3_red[ww][tm][e][l];
    const int row = tile0 + 16 * tm + (l >> 2) + (e >= 2 ? 8 : 0);
    const int m = 2 * (l & 3) + (e & 1);
    if (m < M && row < N) y[(size_t)m * N + row] = (T)v;
  }
