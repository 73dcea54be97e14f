
  constexpr int W = 2 * DK + DV;              // this head's q, k, v channels
  constexpr int C = 2 * HK * DK + HV * DV;    // all conv channels: q | k | v
  constexpr int ROWS = DV / NW;               // state rows per warp
  constexpr int COLS = DK / 32;               // state columns per lane
  constexpr int VEC = COLS % 4 == 0 ? 4 : (COLS % 2 == 0 ? 2 : 1);
  constexpr float QK_EPS = 1e-6f;
  __shared__ __align__(16) float qkv_s[TC * W];  // per token: q[DK] k[DK] v[DV] (v becomes y)
  __shared__ float g_s[TC];
  __shared__ float beta_s[TC];
  __shared__ bool keep_s[TC];
  const int bh = blockIdx.x;
  const int bi = bh / HV, h = bh - bi * HV, kh = h / (HV / HK);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float norm_eps = __int_as_float(EPS_BITS);
  const float q_scale = gdn_round<T>(1.f / DK);          // l2norm_qk: (Dk^-0.5)^2 on q
  const float k_scale = gdn_round<T>(rsqrtf((float)DK));  // and Dk^-0.5 on k
  const size_t head = (size_t)bh * DV * DK;

  float s[ROWS][COLS];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if constexpr (HAS_STATE) {
      gdn_load_row<VEC, COLS>(state_in + head + (size_t)(warp * ROWS + r) * DK, lane, s[r]);
    } else {
      #pragma unroll
      for (int j = 0; j < COLS; ++j) s[r][j] = 0.f;
    }
  }

  for (int t0 = 0; t0 < NT; t0 += TC) {
    const int tn = min(TC, NT - t0);
    // 1. Depthwise causal conv + silu of this head's channels, and the token's decay and beta.
    for (int i = tid; i < tn * W; i += NW * 32) {
      const int t = i / W, j = i - t * W;
      const int c = j < DK ? kh * DK + j : (j < 2 * DK ? HK * DK + kh * DK + (j - DK) : 2 * HK * DK + h * DV + (j - 2 * DK));
      float acc = 0.f;  // GDN_WINDOW(r, c): row r of the conv window, channel c (gdn.py defines it)
      #pragma unroll
      for (int tap = 0; tap < K; ++tap) acc += GDN_WINDOW(t0 + t + tap, c) * (float)conv_w[c * K + tap];
      const float x = gdn_round<T>(acc);
      qkv_s[i] = gdn_round<T>(x * gdn_round<T>(gdn_sigmoid(x)));
    }
    for (int i = tid; i < tn; i += NW * 32) {  // a block may have fewer threads than tokens
      const size_t row = (size_t)bi * NT + t0 + i;
      const size_t ai = row * A_ROW + A_OFF + (h / A_GROUP) * A_GSTRIDE + h % A_GROUP;
      const size_t bj = row * B_ROW + B_OFF + (h / B_GROUP) * B_GSTRIDE + h % B_GROUP;
      const float dt = gdn_round<ST>((float)a_in[ai] + (float)dt_bias[h]);
      g_s[i] = expf(-expf((float)a_log[h]) * gdn_softplus(dt));
      beta_s[i] = gdn_round<BT>(gdn_sigmoid((float)b_in[bj]));
      if constexpr (HAS_MASK) keep_s[i] = mask[row]; else keep_s[i] = true;
    }
    __syncthreads();
    // 2. q and k: x * rsqrt(mean(x^2) + eps/DK) (= x / sqrt(sum x^2 + eps)), then the readout scale.
    for (int p = warp; p < 2 * tn; p += NW) {
      float* x = qkv_s + (p >> 1) * W + (p & 1) * DK;
      float ss[1] = {0.f};
      for (int i = lane; i < DK; i += 32) ss[0] += x[i] * x[i];
      gdn_warp_sum(ss);
      const float inv = rsqrtf(ss[0] / DK + QK_EPS / DK);
      const float scale = (p & 1) ? k_scale : q_scale;
      __syncwarp();
      for (int i = lane; i < DK; i += 32) x[i] = gdn_round<T>(gdn_round<T>(x[i] * inv) * scale);
    }
    __syncthreads();
    // 3. Gated delta rule, token by token; the state never leaves registers.
    for (int t = 0; t < tn; ++t) {
      const float* qk = qkv_s + t * W;
      float* vy = qkv_s + t * W + 2 * DK;
      if (!keep_s[t]) {  // masked step: state untouched, y = 0
        if (lane == 0) {
          #pragma unroll
          for (int r = 0; r < ROWS; ++r) vy[warp * ROWS + r] = 0.f;
        }
        continue;
      }
      float kr[COLS], qr[COLS];
      #pragma unroll
      for (int j = 0; j < COLS; ++j) {
        const int col = gdn_col<VEC>(lane, j);
        qr[j] = qk[col];
        kr[j] = qk[DK + col];
      }
      const float g = g_s[t], beta = beta_s[t];
      float kv[ROWS];
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        kv[r] = 0.f;
        #pragma unroll
        for (int j = 0; j < COLS; ++j) {
          s[r][j] *= g;
          kv[r] += s[r][j] * kr[j];
        }
      }
      gdn_warp_sum(kv);
      float y[ROWS];
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float delta = beta * (vy[warp * ROWS + r] - kv[r]);
        y[r] = 0.f;
        #pragma unroll
        for (int j = 0; j < COLS; ++j) {
          s[r][j] += delta * kr[j];
          y[r] += s[r][j] * qr[j];
        }
      }
      // Every lane read its v values before these (synchronising) shuffles, so lane 0 may then
      // overwrite them with y.
      gdn_warp_sum(y);
      if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) vy[warp * ROWS + r] = gdn_round<T>(y[r]);
      }
    }
    __syncthreads();
    // 4. Output: rms_norm(y) * weight (as mx.fast.rms_norm rounds it) * silu(z) in float32.
    for (int t = warp; t < tn; t += NW) {
      const float* yt = qkv_s + t * W + 2 * DK;
      float ss[1] = {0.f};
      for (int i = lane; i < DV; i += 32) ss[0] += yt[i] * yt[i];
      gdn_warp_sum(ss);
      const float inv = rsqrtf(ss[0] / DV + norm_eps);
      const size_t row = (size_t)bi * NT + t0 + t;
      const size_t o = (row * HV + h) * DV;
      const size_t zo = row * Z_ROW + Z_OFF + (h / Z_GROUP) * Z_GSTRIDE + (h % Z_GROUP) * DV;
      for (int i = lane; i < DV; i += 32) {
        const float normed = gdn_round<OT>(gdn_round<OT>(yt[i] * inv) * (float)norm_w[i]);
        const float gate = (float)z[zo + i];
        out[o + i] = static_cast<OT>(normed * (gate * gdn_sigmoid(gate)));
      }
    }
    __syncthreads();  // the next chunk reuses the shared buffers
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    gdn_store_row<VEC, COLS>(state_out + head + (size_t)(warp * ROWS + r) * DK, lane, s[r]);
  }
