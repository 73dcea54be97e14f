
  constexpr int P = M * K;                        // pairs the shared arrays hold (M: the compiled capacity)
  const int MT = indices_shape[0], PT = MT * K;   // tokens and pairs at run time
  constexpr int VPC = 128 / BITS;
  constexpr int PER_WORD = 32 / BITS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  constexpr int CPT = TILE / VPC;
  constexpr int ROW_CHUNKS = D / VPC;
  constexpr int GROUPS = D / GS;
  constexpr int RPW = 32 / LPR;
  __shared__ int pidx[P];
  __shared__ int leader[P];                       // 1 if pair q is the first routed to its expert
  __shared__ int group_expert[P];
  __shared__ int group_pair[P][M];                // h row of token m for this expert, or -1
  __shared__ float group_score[P][M];             // token m's summed score for this expert
  __shared__ int n_groups;
  extern __shared__ float hs[];                   // [pair][CPT][VPC + 1]
  for (int q = threadIdx.x; q < PT; q += blockDim.x) pidx[q] = (int)indices[q];
  __syncthreads();
  for (int q = threadIdx.x; q < PT; q += blockDim.x) {
    const int e = pidx[q];
    int lead = e >= 0 && e < E;                   // unknown experts contribute zero
    for (int r = 0; r < q; ++r) lead &= pidx[r] != e;
    leader[q] = lead;
  }
  __syncthreads();
  for (int q = threadIdx.x; q < PT; q += blockDim.x) {
    if (!leader[q]) continue;
    int g = 0;
    for (int r = 0; r < q; ++r) g += leader[r];
    const int e = pidx[q];
    group_expert[g] = e;
    for (int m = 0; m < M; ++m) {
      int first = -1;                             // (stays -1 for the capacity's padding tokens)
      float score = 0.f;
      for (int j = 0; j < K && m < MT; ++j) {
        if (pidx[m * K + j] != e) continue;
        if (first < 0) first = m * K + j;         // kernel 1 wrote h for the first such slot
        score += (float)scores[m * K + j];
      }
      group_pair[g][m] = first;
      group_score[g][m] = score;
    }
  }
  if (threadIdx.x == 0) {
    int c = 0;
    for (int q = 0; q < PT; ++q) c += leader[q];
    n_groups = c;
  }
  __syncthreads();
  const int groups = n_groups;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % LPR;
  const int row = (blockIdx.x * WARPS + warp) * RPW + lane / LPR;
  const bool active = row < N;
  const int safe_row = active ? row : 0;
  float acc[M];
  #pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int t0 = 0; t0 < D; t0 += TILE) {
    const int tile_len = min(TILE, D - t0);
    const int tile_chunks = tile_len / VPC;
    const int per_lane = (tile_chunks + LPR - 1) / LPR;   // chunk slots per lane and expert
    __syncthreads();
    for (int i = threadIdx.x; i < PT * tile_len; i += blockDim.x) {
      const int q = i / tile_len, v = i - q * tile_len;
      hs[(q * CPT + v / VPC) * (VPC + 1) + v % VPC] = h[(size_t)q * D + t0 + v];
    }
    __syncthreads();
    if (!active) continue;
    const int items = groups * per_lane;           // (expert, chunk) work items of this lane
    for (int i0 = 0; i0 < items; i0 += U) {
      uint4 wv[U];
      float sc[U], bi[U];
      int gi[U], cli[U];
      #pragma unroll
      for (int u = 0; u < U; ++u) {                // issue every load before using any
        const int it = i0 + u;
        const int g = it / per_lane;
        const int cl = sub + (it - g * per_lane) * LPR;
        gi[u] = g;
        cli[u] = it < items && cl < tile_chunks ? cl : -1;
        if (cli[u] >= 0) {
          const size_t r = (size_t)group_expert[g] * N + safe_row;
          const int c = t0 / VPC + cl;
          wv[u] = reinterpret_cast<const uint4*>(w)[r * ROW_CHUNKS + c];
          sc[u] = (float)scales[r * GROUPS + c * VPC / GS];
          bi[u] = (float)biases[r * GROUPS + c * VPC / GS];
        }
      }
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        if (cli[u] < 0) continue;
        const uint4 w4 = wv[u];
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          const int q = group_pair[gi[u]][m];
          if (q < 0) continue;                     // token m not routed to this expert
          const float* hc = hs + (q * CPT + cli[u]) * (VPC + 1);
          float dot = 0.f, hsum = 0.f;
          #pragma unroll
          for (int j = 0; j < VPC; ++j) {
            const float hv = hc[j];
            const uint32_t word = j / PER_WORD == 0 ? w4.x : j / PER_WORD == 1 ? w4.y
                                : j / PER_WORD == 2 ? w4.z : w4.w;
            dot += (float)((word >> ((j % PER_WORD) * BITS)) & MASK) * hv;
            hsum += hv;
          }
          acc[m] += group_score[gi[u]][m] * (sc[u] * dot + bi[u] * hsum);
        }
      }
    }
  }
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[m];
    #pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (active && sub == 0 && m < MT) y[(size_t)m * N + row] = (T)v;
  }
