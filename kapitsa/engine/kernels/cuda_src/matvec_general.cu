
  constexpr int CH = 128 / BITS;               // values per 16-byte chunk of a row
  constexpr int NCH = K / CH;                  // chunks per row
  constexpr int ROUNDS = (NCH + 31) / 32;      // a round: every lane takes one chunk
  constexpr int TCH = TILE_ROUNDS * 32 < NCH ? TILE_ROUNDS * 32 : NCH;  // chunks per staged tile
  constexpr int STRIDE = CH + 4;               // staged floats per chunk (padded)
  constexpr int GROUPS = K / GS;
  extern __shared__ __align__(16) float kq2_smem[];
  float* xs = kq2_smem;                        // [M][TCH][STRIDE]
  float* xsum = kq2_smem + M * TCH * STRIDE;   // [M][TCH]
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * WARPS + warp) * R;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  int rows[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = min(row0 + r, N - 1);  // past N: recompute row N-1, never stored

  uint4 cur[R];
  float cur_s[R], cur_b[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = lane < NCH ? lane : 0;
    cur[r] = wv[(size_t)rows[r] * NCH + c];
    cur_s[r] = (float)scales[rows[r] * GROUPS + c * CH / GS];
    cur_b[r] = (float)biases[rows[r] * GROUPS + c * CH / GS];
  }
  float acc[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  }

  for (int j = 0; j < ROUNDS; ++j) {
    const int c0 = (j / TILE_ROUNDS) * TCH;    // first chunk of the staged tile
    if (j % TILE_ROUNDS == 0) {
      const int tile_chunks = min(TCH, NCH - c0);
      __syncthreads();                           // the previous tile is no longer read
      for (int i = threadIdx.x; i < M * tile_chunks; i += WARPS * 32) {
        const int m = i / tile_chunks, cl = i - m * tile_chunks;
        const T* src = x + (size_t)m * K + (size_t)(c0 + cl) * CH;
        float* dst = xs + (m * TCH + cl) * STRIDE;
        float total = 0.f;
        #pragma unroll
        for (int e = 0; e < CH; e += 8) {
          float v[8];
          kq2_load8(src + e, v);
          #pragma unroll
          for (int t = 0; t < 8; ++t) total += v[t];
          *reinterpret_cast<float4*>(dst + e) = make_float4(v[0], v[1], v[2], v[3]);
          *reinterpret_cast<float4*>(dst + e + 4) = make_float4(v[4], v[5], v[6], v[7]);
        }
        xsum[m * TCH + cl] = total;
      }
      __syncthreads();
    }
    const int c = j * 32 + lane;
    // Next round's chunk: its loads are in flight while this one is computed.
    uint4 nxt[R];
    float nxt_s[R], nxt_b[R];
    const int cn = c + 32 < NCH ? c + 32 : 0;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      nxt[r] = wv[(size_t)rows[r] * NCH + cn];
      nxt_s[r] = (float)scales[rows[r] * GROUPS + cn * CH / GS];
      nxt_b[r] = (float)biases[rows[r] * GROUPS + cn * CH / GS];
    }
    if (c < NCH) {
      const int cl = c - c0;
      float dot[R][M];
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) dot[r][m] = 0.f;
      }
      #pragma unroll
      for (int q4 = 0; q4 < CH / 4; ++q4) {     // 4 values at a time: one float4 of x per row
        const int word = BITS == 4 ? q4 >> 1 : q4;
        float4 qv[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t wd = word == 0 ? cur[r].x : word == 1 ? cur[r].y : word == 2 ? cur[r].z : cur[r].w;
          if constexpr (BITS == 4) qv[r] = kq2_nibbles(wd, q4 & 1);
          else qv[r] = kq2_bytes(wd);
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          const float4 xv = *reinterpret_cast<const float4*>(xs + (m * TCH + cl) * STRIDE + 4 * q4);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            dot[r][m] = fmaf(qv[r].x, xv.x, dot[r][m]);
            dot[r][m] = fmaf(qv[r].y, xv.y, dot[r][m]);
            dot[r][m] = fmaf(qv[r].z, xv.z, dot[r][m]);
            dot[r][m] = fmaf(qv[r].w, xv.w, dot[r][m]);
          }
        }
      }
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        const float sx = xsum[m * TCH + cl];
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] = fmaf(cur_s[r], dot[r][m], fmaf(cur_b[r], sx, acc[r][m]));
      }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) { cur[r] = nxt[r]; cur_s[r] = nxt_s[r]; cur_b[r] = nxt_b[r]; }
  }

  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[r][m];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && row0 + r < N) y[(size_t)m * N + row0 + r] = (T)v;
    }
  }
