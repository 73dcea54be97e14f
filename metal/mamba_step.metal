// Fused Mamba-2 step (Nemotron-H): a line-by-line port of the CUDA kernels in
// kapitsa/engine/kernels/cuda_src/mamba_*.cu (driven by kernels/mamba.py), for mx.fast.metal_kernel. Two bodies share this header:
// the step kernel after "---- body ----", the group-gated RMS norm after "---- norm body ----"
// (mamba.py splits them). A simdgroup plays the CUDA warp (32 lanes), simd_sum its shuffles.
// Not run on Apple hardware yet; see tests/kernels/test_mamba_kernel.py (marker `metal`).

// Registers indexed by loop counters must stay registers: unroll those loops fully.
#define KM_UNROLL _Pragma("clang loop unroll(full)")

// V consecutive floats from device memory (16- or 8-byte aligned: N is a multiple of 32).
template <int V>
inline void km_load(const device float* src, thread float* dst) {
  if (V == 4) {
    const float4 u = *(const device float4*)src;
    dst[0] = u.x; dst[1] = u.y; dst[2] = u.z; dst[3] = u.w;
  } else if (V == 2) {
    const float2 u = *(const device float2*)src;
    dst[0] = u.x; dst[1] = u.y;
  } else {
    dst[0] = src[0];
  }
}

template <int V>
inline void km_store(device float* dst, const thread float* src) {
  if (V == 4) {
    *(device float4*)dst = float4(src[0], src[1], src[2], src[3]);
  } else if (V == 2) {
    *(device float2*)dst = float2(src[0], src[1]);
  } else {
    dst[0] = src[0];
  }
}

inline float km_silu(float v) { return v / (1.0f + metal::exp(-v)); }

// log(1 + e^v) as logaddexp(v, 0): max(v, 0) + log(1 + e^-|v|).
inline float km_softplus(float v) { return metal::max(v, 0.0f) + metal::log(1.0f + metal::exp(-metal::abs(v))); }

// ---- body ----
  constexpr int VEC = N % 128 == 0 ? 4 : (N % 64 == 0 ? 2 : 1);
  constexpr int PER_LANE = N / 32;
  constexpr int RPW = ROWS / WARPS;
  constexpr int INNER = H * P;
  constexpr int C = INNER + 2 * G * N;
  constexpr int LEN = TOKENS + K - 1;
  constexpr int CH = ROWS + 2 * N;  // conv channels one threadgroup needs per token: x rows, B, C
  threadgroup float b_s[TC][N];
  threadgroup float c_s[TC][N];
  threadgroup float x_s[TC][ROWS];
  threadgroup float y_s[TC][ROWS];
  threadgroup float dt_s[TC];
  threadgroup float decay_s[TC];
  const int p0 = threadgroup_position_in_grid.x * ROWS;
  const int h = threadgroup_position_in_grid.y, b = threadgroup_position_in_grid.z;
  const int g = h / (H / G);
  const int tid = thread_index_in_threadgroup;
  const int threads = WARPS * 32;
  const int lane = tid % 32, warp = tid / 32;
  const float a = -metal::exp(static_cast<float>(a_log[h]));
  const float d = static_cast<float>(d_skip[h]);
  const float bias_dt = static_cast<float>(dt_bias[h]);
  const float lo = as_type<float>(LO_BITS), hi = as_type<float>(HI_BITS);
  const ulong row0 = ((ulong)(b * H + h) * P + p0 + warp * RPW) * N;
  float s[RPW][PER_LANE];
  KM_UNROLL
  for (int r = 0; r < RPW; ++r) {
    KM_UNROLL
    for (int j = 0; j < PER_LANE / VEC; ++j)
      km_load<VEC>(state_in + row0 + r * N + (j * 32 + lane) * VEC, &s[r][j * VEC]);
  }
  for (int t0 = 0; t0 < TOKENS; t0 += TC) {
    const int tn = metal::min(TC, TOKENS - t0);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous chunk's rows are no longer read
    for (int i = tid; i < tn * CH; i += threads) {
      const int tt = i / CH, k = i - tt * CH;
      const int ch = k < ROWS ? h * P + p0 + k
                   : (k < ROWS + N ? INNER + g * N + (k - ROWS) : INNER + (G + g) * N + (k - ROWS - N));
      float acc = HAS_BIAS ? static_cast<float>(conv_b[ch]) : 0.0f;
      const ulong src = ((ulong)b * LEN + t0 + tt) * C + ch;
      for (int j = 0; j < K; ++j)
        acc += static_cast<float>(conv_in[src + (ulong)j * C]) * static_cast<float>(conv_w[ch * K + j]);
      const float v = km_silu(acc);
      if (k < ROWS) x_s[tt][k] = v;
      else if (k < ROWS + N) b_s[tt][k - ROWS] = v;
      else c_s[tt][k - ROWS - N] = v;
    }
    if (tid < tn) {  // threads >= 64 >= TC
      const int t = t0 + tid;
      const float raw = static_cast<float>(dt_raw[((ulong)b * TOKENS + t) * H + h]) + bias_dt;
      float v = metal::min(metal::max(km_softplus(raw), lo), hi);
      if (HAS_MASK && !mask[b * TOKENS + t]) v = 0.0f;  // padding: decay 1, no input, state frozen
      dt_s[tid] = v;
      decay_s[tid] = metal::exp(v * a);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int tt = 0; tt < tn; ++tt) {
      const float dtv = dt_s[tt], decay = decay_s[tt];
      float bv[PER_LANE], cv[PER_LANE];
      KM_UNROLL
      for (int j = 0; j < PER_LANE / VEC; ++j) {
        KM_UNROLL
        for (int v = 0; v < VEC; ++v) {
          bv[j * VEC + v] = b_s[tt][(j * 32 + lane) * VEC + v];
          cv[j * VEC + v] = c_s[tt][(j * 32 + lane) * VEC + v];
        }
      }
      KM_UNROLL
      for (int r = 0; r < RPW; ++r) {
        const float xv = x_s[tt][warp * RPW + r];
        const float inject = dtv * xv;
        float acc = 0.0f;
        KM_UNROLL
        for (int i = 0; i < PER_LANE; ++i) {
          s[r][i] = metal::fma(s[r][i], decay, inject * bv[i]);
          acc = metal::fma(s[r][i], cv[i], acc);
        }
        acc = simd_sum(acc);
        if (lane == 0) y_s[tt][warp * RPW + r] = metal::fma(d, xv, acc);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < tn * ROWS; i += threads) {
      const int tt = i / ROWS, r = i - tt * ROWS;
      y[((ulong)b * TOKENS + t0 + tt) * INNER + h * P + p0 + r] = y_s[tt][r];
    }
  }
  KM_UNROLL
  for (int r = 0; r < RPW; ++r) {
    KM_UNROLL
    for (int j = 0; j < PER_LANE / VEC; ++j)
      km_store<VEC>(state_out + row0 + r * N + (j * 32 + lane) * VEC, &s[r][j * VEC]);
  }
// ---- norm body ----
  threadgroup float partial[32];
  threadgroup float total[1];
  const int grp = threadgroup_position_in_grid.x;
  const ulong base = (ulong)threadgroup_position_in_grid.y * INNER + (ulong)grp * GS;
  const int tid = thread_index_in_threadgroup;
  const int threads = THREADS;
  const int lane = tid % 32, warp = tid / 32;
  float ss = 0.0f;
  for (int i = tid; i < GS; i += threads) {
    const float v = y[base + i] * km_silu(static_cast<float>(gate[base + i]));
    ss += v * v;
  }
  ss = simd_sum(ss);
  if (lane == 0) partial[warp] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (warp == 0) {
    float v = lane < threads / 32 ? partial[lane] : 0.0f;
    v = simd_sum(v);
    if (lane == 0) total[0] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float scale = metal::rsqrt(total[0] / GS + as_type<float>(EPS_BITS));
  for (int i = tid; i < GS; i += threads) {
    const float v = y[base + i] * km_silu(static_cast<float>(gate[base + i]));
    out[base + i] = static_cast<OutT>(v * scale * static_cast<float>(norm_w[grp * GS + i]));
  }
