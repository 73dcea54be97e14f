
  constexpr int CHUNKS_PER_TILE = TILE / 32;
  constexpr int GROUPS = K / GS;
  constexpr int SUB = GS < 32 ? GS : 32;
  extern __shared__ float xs_tile[];              // [M][CHUNKS_PER_TILE][33]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row = blockIdx.x * WARPS + warp;
  const bool active = row < N;
  const uint32_t* wrow = w + (size_t)(active ? row : 0) * (K / 32 * BITS);
  float acc[M];
  #pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int t0 = 0; t0 < K; t0 += TILE) {
    const int tile_len = min(TILE, K - t0);
    __syncthreads();
    for (int i = threadIdx.x; i < M * tile_len; i += blockDim.x) {
      const int m = i / tile_len, v = i - m * tile_len;
      xs_tile[(m * CHUNKS_PER_TILE + (v >> 5)) * 33 + (v & 31)] = (float)x[m * K + t0 + v];
    }
    __syncthreads();
    if (!active) continue;
    for (int cl = lane; cl < (tile_len >> 5); cl += 32) {
      const int c = (t0 >> 5) + cl;
      uint32_t words[BITS];
      if constexpr (BITS % 4 == 0) {
        const uint4* src = reinterpret_cast<const uint4*>(wrow + c * BITS);
        #pragma unroll
        for (int i = 0; i < BITS / 4; ++i) {
          uint4 u = src[i];
          words[4 * i] = u.x; words[4 * i + 1] = u.y; words[4 * i + 2] = u.z; words[4 * i + 3] = u.w;
        }
      } else {
        #pragma unroll
        for (int i = 0; i < BITS; ++i) words[i] = wrow[c * BITS + i];
      }
      #pragma unroll
      for (int part = 0; part < 32 / SUB; ++part) {
        const int g = (c * 32 + part * SUB) / GS;
        float scale, bias = 0.f;
        if (MODE == 0) { scale = (float)scales[row * GROUPS + g]; bias = (float)biases[row * GROUPS + g]; }
        else if (MODE == 1) { scale = ldexpf(1.f, (int)((const uint8_t*)scales)[row * GROUPS + g] - 127); }
        else { scale = kq_e4m3(((const uint8_t*)scales)[row * GROUPS + g]); }
        float dot[M], xsum[M];
        #pragma unroll
        for (int m = 0; m < M; ++m) { dot[m] = 0.f; xsum[m] = 0.f; }
        #pragma unroll
        for (int jj = 0; jj < SUB; ++jj) {
          const int j = part * SUB + jj;
          const int off = j * BITS, wi = off >> 5, sh = off & 31;
          uint32_t q = words[wi] >> sh;
          if (sh + BITS > 32) q |= words[wi + 1] << (32 - sh);
          q &= (1u << BITS) - 1u;
          const float qv = MODE == 0 ? (float)q : kq_e2m1(q);
          #pragma unroll
          for (int m = 0; m < M; ++m) {
            const float xv = xs_tile[(m * CHUNKS_PER_TILE + cl) * 33 + j];
            dot[m] += qv * xv;
            xsum[m] += xv;
          }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[m] += scale * dot[m] + bias * xsum[m];
      }
    }
  }
  if (!active) return;
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[m];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) y[m * N + row] = (T)v;
  }
