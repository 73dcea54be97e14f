
  constexpr int VEC = N % 128 == 0 ? 4 : (N % 64 == 0 ? 2 : 1);
  constexpr int PER_LANE = N / 32;
  constexpr int RPW = ROWS / WARPS;
  constexpr int INNER = H * P;
  constexpr int C = INNER + 2 * G * N;
  constexpr int LEN = TOKENS + K - 1;
  constexpr int CH = ROWS + 2 * N;  // conv channels one block needs per token: its x rows, B, C
  constexpr int THREADS = WARPS * 32;
  __shared__ __align__(16) float b_s[TC][N];
  __shared__ __align__(16) float c_s[TC][N];
  __shared__ float x_s[TC][ROWS];
  __shared__ float y_s[TC][ROWS];
  __shared__ float dt_s[TC];
  __shared__ float decay_s[TC];
  const int p0 = blockIdx.x * ROWS, h = blockIdx.y, b = blockIdx.z;
  const int g = h / (H / G);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float a = -expf(static_cast<float>(a_log[h]));
  const float d = static_cast<float>(d_skip[h]);
  const float bias_dt = static_cast<float>(dt_bias[h]);
  const float lo = __int_as_float(LO_BITS), hi = __int_as_float(HI_BITS);
  const size_t row0 = ((size_t)(b * H + h) * P + p0 + warp * RPW) * N;
  float s[RPW][PER_LANE];
  #pragma unroll
  for (int r = 0; r < RPW; ++r) {
    #pragma unroll
    for (int j = 0; j < PER_LANE / VEC; ++j)
      km_load<VEC>(state_in + row0 + r * N + (j * 32 + lane) * VEC, &s[r][j * VEC]);
  }
  for (int t0 = 0; t0 < TOKENS; t0 += TC) {
    const int tn = min(TC, TOKENS - t0);
    __syncthreads();  // the previous chunk's shared rows are no longer read
    for (int i = threadIdx.x; i < tn * CH; i += THREADS) {
      const int tt = i / CH, k = i - tt * CH;
      const int ch = k < ROWS ? h * P + p0 + k
                   : (k < ROWS + N ? INNER + g * N + (k - ROWS) : INNER + (G + g) * N + (k - ROWS - N));
      float acc = HAS_BIAS ? static_cast<float>(conv_b[ch]) : 0.f;
      const size_t src = ((size_t)b * LEN + t0 + tt) * C + ch;
      #pragma unroll
      for (int j = 0; j < K; ++j)
        acc += static_cast<float>(conv_in[src + (size_t)j * C]) * static_cast<float>(conv_w[ch * K + j]);
      const float v = km_silu(acc);
      if (k < ROWS) x_s[tt][k] = v;
      else if (k < ROWS + N) b_s[tt][k - ROWS] = v;
      else c_s[tt][k - ROWS - N] = v;
    }
    if (threadIdx.x < tn) {  // THREADS >= 64 >= TC
      const int t = t0 + threadIdx.x;
      const float raw = static_cast<float>(dt_raw[((size_t)b * TOKENS + t) * H + h]) + bias_dt;
      float v = fminf(fmaxf(km_softplus(raw), lo), hi);
      if (HAS_MASK && !mask[b * TOKENS + t]) v = 0.f;  // padding: decay 1, no input, state frozen
      dt_s[threadIdx.x] = v;
      decay_s[threadIdx.x] = expf(v * a);
    }
    __syncthreads();
    for (int tt = 0; tt < tn; ++tt) {
      const float dtv = dt_s[tt], decay = decay_s[tt];
      float bv[PER_LANE], cv[PER_LANE];
      #pragma unroll
      for (int j = 0; j < PER_LANE / VEC; ++j) {
        km_load<VEC>(&b_s[tt][(j * 32 + lane) * VEC], &bv[j * VEC]);
        km_load<VEC>(&c_s[tt][(j * 32 + lane) * VEC], &cv[j * VEC]);
      }
      #pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float xv = x_s[tt][warp * RPW + r];
        const float inject = dtv * xv;
        float acc = 0.f;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          s[r][i] = fmaf(s[r][i], decay, inject * bv[i]);
          acc = fmaf(s[r][i], cv[i], acc);
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) y_s[tt][warp * RPW + r] = fmaf(d, xv, acc);
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < tn * ROWS; i += THREADS) {
      const int tt = i / ROWS, r = i - tt * ROWS;
      y[((size_t)b * TOKENS + t0 + tt) * INNER + h * P + p0 + r] = y_s[tt][r];
    }
  }
  #pragma unroll
  for (int r = 0; r < RPW; ++r) {
    #pragma unroll
    for (int j = 0; j < PER_LANE / VEC; ++j)
      km_store<VEC>(state_out + row0 + r * N + (j * 32 + lane) * VEC, &s[r][j * VEC]);
  }
