// The general quantized mat-vec (MLX affine 4/8-bit, M <= 8 rows): a line-by-line port of the CUDA
// kernel in kapitsa/engine/kernels/cuda_src/matvec_general.cu for mx.fast.metal_kernel. A simdgroup plays the CUDA warp
// (32 lanes) and simd_sum its shuffle reduction; x is staged per threadgroup as float with chunk
// sums (SMEM_FLOATS sized by the host to Apple's 32 KiB of threadgroup memory).
// Not run on Apple hardware yet; see tests/kernels/test_matvec_metal.py (marker `metal`).

// The field (w & mask) sits at bit p of the mantissa of 2^23: the float is 2^23 + q * 2^p, and
// fma(f, 2^-p, -2^(23-p)) is q with no rounding (both steps are exact in float32).
inline float kq2_field(uint w, uint mask, float inv, float off) {
  return metal::fma(as_type<float>((w & mask) | 0x4B000000u), inv, off);
}

// Values 4h..4h+3 of a 32-bit word of 4-bit weights (h = 0 or 1).
inline float4 kq2_nibbles(uint w, int h) {
  if (h == 0) {
    return float4(kq2_field(w, 0xFu, 1.f, -8388608.f), kq2_field(w, 0xF0u, 0.0625f, -524288.f),
                  kq2_field(w, 0xF00u, 0.00390625f, -32768.f),
                  kq2_field(w, 0xF000u, 0.000244140625f, -2048.f));
  }
  const uint hi = w >> 12;  // values 5, 6, 7 move to bits 8, 12, 16
  return float4(kq2_field(w, 0xF0000u, 1.52587890625e-05f, -128.f),
                kq2_field(hi, 0xF00u, 0.00390625f, -32768.f),
                kq2_field(hi, 0xF000u, 0.000244140625f, -2048.f),
                kq2_field(hi, 0xF0000u, 1.52587890625e-05f, -128.f));
}

// The four bytes of a word of 8-bit weights (no byte_perm in Metal: shift and mask each).
inline float4 kq2_bytes(uint w) {
  return float4(as_type<float>((w & 0xFFu) | 0x4B000000u), as_type<float>(((w >> 8) & 0xFFu) | 0x4B000000u),
                as_type<float>(((w >> 16) & 0xFFu) | 0x4B000000u), as_type<float>((w >> 24) | 0x4B000000u)) -
         8388608.f;
}

// ---- body ----
  constexpr int CH = 128 / BITS;               // values per 16-byte chunk of a row
  constexpr int NCH = K / CH;                  // chunks per row
  constexpr int ROUNDS = (NCH + 31) / 32;      // a round: every lane takes one chunk
  constexpr int TCH = TILE_ROUNDS * 32 < NCH ? TILE_ROUNDS * 32 : NCH;  // chunks per staged tile
  constexpr int STRIDE = CH + 4;               // staged floats per chunk (padded)
  constexpr int GROUPS = K / GS;
  threadgroup float4 kq2_smem4[SMEM_FLOATS / 4];
  threadgroup float* xs = (threadgroup float*)kq2_smem4;  // [M][TCH][STRIDE]
  threadgroup float* xsum = xs + M * TCH * STRIDE;        // [M][TCH]
  const int lane = thread_index_in_simdgroup;
  const int warp = simdgroup_index_in_threadgroup;
  const int tid = thread_index_in_threadgroup;
  const int row0 = (int(threadgroup_position_in_grid.x) * WARPS + warp) * R;
  const device uint4* wv = (const device uint4*)w;
  int rows[R];
  for (int r = 0; r < R; ++r) rows[r] = metal::min(row0 + r, N - 1);  // past N: recompute row N-1, never stored

  uint4 cur[R];
  float cur_s[R], cur_b[R];
  for (int r = 0; r < R; ++r) {
    const int c = lane < NCH ? lane : 0;
    cur[r] = wv[size_t(rows[r]) * NCH + c];
    cur_s[r] = float(scales[rows[r] * GROUPS + c * CH / GS]);
    cur_b[r] = float(biases[rows[r] * GROUPS + c * CH / GS]);
  }
  float acc[R][M];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  }

  for (int j = 0; j < ROUNDS; ++j) {
    const int c0 = (j / TILE_ROUNDS) * TCH;    // first chunk of the staged tile
    if (j % TILE_ROUNDS == 0) {
      const int tile_chunks = metal::min(TCH, NCH - c0);
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile is no longer read
      for (int i = tid; i < M * tile_chunks; i += WARPS * 32) {
        const int m = i / tile_chunks, cl = i - m * tile_chunks;
        const device T* src = x + size_t(m) * K + size_t(c0 + cl) * CH;
        threadgroup float* dst = xs + (m * TCH + cl) * STRIDE;
        float total = 0.f;
        for (int e = 0; e < CH; ++e) {
          const float v = float(src[e]);
          dst[e] = v;
          total += v;
        }
        xsum[m * TCH + cl] = total;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const int c = j * 32 + lane;
    // Next round's chunk: its loads are in flight while this one is computed.
    uint4 nxt[R];
    float nxt_s[R], nxt_b[R];
    const int cn = c + 32 < NCH ? c + 32 : 0;
    for (int r = 0; r < R; ++r) {
      nxt[r] = wv[size_t(rows[r]) * NCH + cn];
      nxt_s[r] = float(scales[rows[r] * GROUPS + cn * CH / GS]);
      nxt_b[r] = float(biases[rows[r] * GROUPS + cn * CH / GS]);
    }
    if (c < NCH) {
      const int cl = c - c0;
      float dot[R][M];
      for (int r = 0; r < R; ++r) {
        for (int m = 0; m < M; ++m) dot[r][m] = 0.f;
      }
      for (int q4 = 0; q4 < CH / 4; ++q4) {     // 4 values at a time: one float4 of x per row
        const int word = BITS == 4 ? q4 >> 1 : q4;
        float4 qv[R];
        for (int r = 0; r < R; ++r) {
          const uint wd = cur[r][word];
          qv[r] = BITS == 4 ? kq2_nibbles(wd, q4 & 1) : kq2_bytes(wd);
        }
        for (int m = 0; m < M; ++m) {
          const float4 xv = *(const threadgroup float4*)(xs + (m * TCH + cl) * STRIDE + 4 * q4);
          for (int r = 0; r < R; ++r) dot[r][m] += metal::dot(qv[r], xv);
        }
      }
      for (int m = 0; m < M; ++m) {
        const float sx = xsum[m * TCH + cl];
        for (int r = 0; r < R; ++r) acc[r][m] = metal::fma(cur_s[r], dot[r][m], metal::fma(cur_b[r], sx, acc[r][m]));
      }
    }
    for (int r = 0; r < R; ++r) { cur[r] = nxt[r]; cur_s[r] = nxt_s[r]; cur_b[r] = nxt_b[r]; }
  }

  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      const float v = metal::simd_sum(acc[r][m]);
      if (lane == 0 && row0 + r < N) y[size_t(m) * N + row0 + r] = static_cast<T>(v);
    }
  }
