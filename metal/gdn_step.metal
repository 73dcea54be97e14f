// Fused Gated DeltaNet step (kapitsa/engine/kernels/gdn.py): a line-by-line port of the CUDA
// kernel in kapitsa/engine/kernels/cuda_src/gdn_step.cu. One threadgroup per (batch row, value head); the float32 state [DV, DK] stays in
// registers for all NT tokens, each simdgroup owning DV / NW rows, lanes splitting DK.
// Template arguments: T, OT, ST, BT dtypes; HK, HV, DK, DV, K, NT, TC, NW ints; HAS_STATE,
// HAS_MASK bools; EPS_BITS the norm eps as float bits; {Z,A,B}_{ROW,OFF,GROUP,GSTRIDE} where
// z, a and b sit in their arrays (HeadView; see launch_config).

// x rounded to dtype U and back: where the op-by-op path stores an intermediate in U.
template <typename U>
inline float gdn_round(float x) { return static_cast<float>(static_cast<U>(x)); }
inline float gdn_sigmoid(float x) { return 1.0f / (1.0f + metal::exp(-x)); }
inline float gdn_softplus(float x) {
  return metal::max(x, 0.0f) + metal::log(1.0f + metal::exp(-metal::abs(x)));
}
// Sums each of N values over the simdgroup; every lane gets the totals.
template <int N>
inline void gdn_simd_sum(thread float (&v)[N]) {
  for (ushort o = 16; o > 0; o >>= 1) {
    for (int i = 0; i < N; ++i) v[i] += metal::simd_shuffle_xor(v[i], o);
  }
}
// Column of slot j of a lane's share of a row: VEC contiguous floats per 32*VEC-wide chunk.
template <int VEC>
inline int gdn_col(int lane, int j) { return (j / VEC) * 32 * VEC + lane * VEC + j % VEC; }
template <int VEC, int COLS>
inline void gdn_load_row(const device float* row, int lane, thread float (&dst)[COLS]) {
  for (int c = 0; c < COLS / VEC; ++c) {
    const device float* p = row + c * 32 * VEC + lane * VEC;
    if (VEC == 4) {
      const float4 v = *reinterpret_cast<const device float4*>(p);
      dst[4 * c] = v.x; dst[4 * c + 1] = v.y; dst[4 * c + 2] = v.z; dst[4 * c + 3] = v.w;
    } else if (VEC == 2) {
      const float2 v = *reinterpret_cast<const device float2*>(p);
      dst[2 * c] = v.x; dst[2 * c + 1] = v.y;
    } else {
      dst[c] = p[0];
    }
  }
}
template <int VEC, int COLS>
inline void gdn_store_row(device float* row, int lane, thread const float (&src)[COLS]) {
  for (int c = 0; c < COLS / VEC; ++c) {
    device float* p = row + c * 32 * VEC + lane * VEC;
    if (VEC == 4) {
      *reinterpret_cast<device float4*>(p) = float4(src[4 * c], src[4 * c + 1], src[4 * c + 2], src[4 * c + 3]);
    } else if (VEC == 2) {
      *reinterpret_cast<device float2*>(p) = float2(src[2 * c], src[2 * c + 1]);
    } else {
      p[0] = src[c];
    }
  }
}
// ---- body ----
  constexpr int W = 2 * DK + DV;              // this head's q, k, v channels
  constexpr int C = 2 * HK * DK + HV * DV;    // all conv channels: q | k | v
  constexpr int ROWS = DV / NW;               // state rows per simdgroup
  constexpr int COLS = DK / 32;               // state columns per lane
  constexpr int VEC = COLS % 4 == 0 ? 4 : (COLS % 2 == 0 ? 2 : 1);
  constexpr float QK_EPS = 1e-6f;
  threadgroup float qkv_s[TC * W];  // per token: q[DK] k[DK] v[DV] (v becomes y)
  threadgroup float g_s[TC];
  threadgroup float beta_s[TC];
  threadgroup int keep_s[TC];  // 1 = real token
  const int bh = int(threadgroup_position_in_grid.x);
  const int bi = bh / HV, h = bh - bi * HV, kh = h / (HV / HK);
  const int tid = int(thread_index_in_threadgroup), lane = tid & 31, warp = tid >> 5;
  const float norm_eps = as_type<float>(int(EPS_BITS));
  const float q_scale = gdn_round<T>(1.0f / DK);
  const float k_scale = gdn_round<T>(metal::rsqrt(float(DK)));
  const int head = bh * DV * DK;

  float s[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r) {
    if (HAS_STATE) {
      gdn_load_row<VEC, COLS>(state_in + head + (warp * ROWS + r) * DK, lane, s[r]);
    } else {
      for (int j = 0; j < COLS; ++j) s[r][j] = 0.0f;
    }
  }

  for (int t0 = 0; t0 < NT; t0 += TC) {
    const int tn = metal::min(TC, NT - t0);
    // 1. Depthwise causal conv + silu of this head's channels, and the token's decay and beta.
    for (int i = tid; i < tn * W; i += NW * 32) {
      const int t = i / W, j = i - t * W;
      const int c = j < DK ? kh * DK + j : (j < 2 * DK ? HK * DK + kh * DK + (j - DK) : 2 * HK * DK + h * DV + (j - 2 * DK));
      const int x0 = (bi * (K - 1 + NT) + t0 + t) * C + c;
      float acc = 0.0f;
      for (int tap = 0; tap < K; ++tap) acc += float(conv_in[x0 + tap * C]) * float(conv_w[c * K + tap]);
      const float x = gdn_round<T>(acc);
      qkv_s[i] = gdn_round<T>(x * gdn_round<T>(gdn_sigmoid(x)));
    }
    for (int i = tid; i < tn; i += NW * 32) {  // a threadgroup may have fewer threads than tokens
      const int row = bi * NT + t0 + i;
      const int ai = row * A_ROW + A_OFF + (h / A_GROUP) * A_GSTRIDE + h % A_GROUP;
      const int bj = row * B_ROW + B_OFF + (h / B_GROUP) * B_GSTRIDE + h % B_GROUP;
      const float dt = gdn_round<ST>(float(a_in[ai]) + float(dt_bias[h]));
      g_s[i] = metal::exp(-metal::exp(float(a_log[h])) * gdn_softplus(dt));
      beta_s[i] = gdn_round<BT>(gdn_sigmoid(float(b_in[bj])));
      keep_s[i] = HAS_MASK ? int(mask[row]) : 1;
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    // 2. q and k: x * rsqrt(mean(x^2) + eps/DK), then the readout scale.
    for (int p = warp; p < 2 * tn; p += NW) {
      threadgroup float* x = qkv_s + (p >> 1) * W + (p & 1) * DK;
      float ss[1] = {0.0f};
      for (int i = lane; i < DK; i += 32) ss[0] += x[i] * x[i];
      gdn_simd_sum(ss);
      const float inv = metal::rsqrt(ss[0] / DK + QK_EPS / DK);
      const float scale = (p & 1) ? k_scale : q_scale;
      for (int i = lane; i < DK; i += 32) x[i] = gdn_round<T>(gdn_round<T>(x[i] * inv) * scale);
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    // 3. Gated delta rule, token by token; the state never leaves registers.
    for (int t = 0; t < tn; ++t) {
      const threadgroup float* qk = qkv_s + t * W;
      threadgroup float* vy = qkv_s + t * W + 2 * DK;
      if (keep_s[t] == 0) {  // masked step: state untouched, y = 0
        if (lane == 0) {
          for (int r = 0; r < ROWS; ++r) vy[warp * ROWS + r] = 0.0f;
        }
        continue;
      }
      float kr[COLS], qr[COLS];
      for (int j = 0; j < COLS; ++j) {
        const int col = gdn_col<VEC>(lane, j);
        qr[j] = qk[col];
        kr[j] = qk[DK + col];
      }
      const float g = g_s[t], beta = beta_s[t];
      float kv[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        kv[r] = 0.0f;
        for (int j = 0; j < COLS; ++j) {
          s[r][j] *= g;
          kv[r] += s[r][j] * kr[j];
        }
      }
      gdn_simd_sum(kv);
      float y[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        const float delta = beta * (vy[warp * ROWS + r] - kv[r]);
        y[r] = 0.0f;
        for (int j = 0; j < COLS; ++j) {
          s[r][j] += delta * kr[j];
          y[r] += s[r][j] * qr[j];
        }
      }
      // Simdgroups run in lockstep and every lane read its v values above, so lane 0 may now
      // overwrite them with y.
      gdn_simd_sum(y);
      if (lane == 0) {
        for (int r = 0; r < ROWS; ++r) vy[warp * ROWS + r] = gdn_round<T>(y[r]);
      }
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    // 4. Output: rms_norm(y) * weight (rounded as mx.fast.rms_norm does) * silu(z) in float32.
    for (int t = warp; t < tn; t += NW) {
      const threadgroup float* yt = qkv_s + t * W + 2 * DK;
      float ss[1] = {0.0f};
      for (int i = lane; i < DV; i += 32) ss[0] += yt[i] * yt[i];
      gdn_simd_sum(ss);
      const float inv = metal::rsqrt(ss[0] / DV + norm_eps);
      const int row = bi * NT + t0 + t;
      const int o = (row * HV + h) * DV;
      const int zo = row * Z_ROW + Z_OFF + (h / Z_GROUP) * Z_GSTRIDE + (h % Z_GROUP) * DV;
      for (int i = lane; i < DV; i += 32) {
        const float normed = gdn_round<OT>(gdn_round<OT>(yt[i] * inv) * float(norm_w[i]));
        const float gate = float(z[zo + i]);
        out[o + i] = static_cast<OT>(normed * (gate * gdn_sigmoid(gate)));
      }
    }
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);  // the next chunk reuses the buffers
  }
  for (int r = 0; r < ROWS; ++r) {
    gdn_store_row<VEC, COLS>(state_out + head + (warp * ROWS + r) * DK, lane, s[r]);
  }
