// MoE decode experts: a line-by-line port of the two CUDA kernels in kapitsa/engine/kernels/cuda_src/moe_*.cu,
// for mx.fast.metal_kernel. The hidden kernel's body follows "---- body ----", the output kernel's
// "---- out body ----" (moe.py splits them). A simdgroup plays the CUDA warp (32 lanes),
// simd_shuffle_xor its shuffles; WEIGHT_POINTERS is replaced by moe.py as for CUDA.
// Not run on Apple hardware yet; see tests/kernels/test_moe_kernel.py (marker `metal`).

// Registers indexed by loop counters must stay registers: unroll those loops fully.
#define MOE_UNROLL _Pragma("clang loop unroll(full)")

// Weight j of a 16-byte chunk (value j in word j / (32 / BITS) at bit (j % (32 / BITS)) * BITS).
template <int BITS>
inline float moe_weight(uint4 w4, int j) {
  constexpr int PER_WORD = 32 / BITS;
  const int wi = j / PER_WORD;
  const uint word = wi == 0 ? w4.x : wi == 1 ? w4.y : wi == 2 ? w4.z : w4.w;
  return static_cast<float>((word >> ((j % PER_WORD) * BITS)) & ((1u << BITS) - 1u));
}

// ---- body ----
  // Template: T (x), S (scales), M, K, E, D, N, GS, BITS, NW, KIND, LPR, WARPS, TILE, U.
  constexpr int VPC = 128 / BITS;
  constexpr int CPT = TILE / VPC;
  constexpr int ROW_CHUNKS = D / VPC;
  constexpr int GROUPS = D / GS;
  constexpr int RPW = 32 / LPR;
  threadgroup int pair_of_token[M];
  threadgroup int member_token[M];
  threadgroup int member_pair[M];
  threadgroup int n_members[1];
  threadgroup float xs[M * CPT * (VPC + 1)];
  const int tid = thread_index_in_threadgroup;
  const int threads = WARPS * 32;
  const int p = threadgroup_position_in_grid.y;
  const int e = static_cast<int>(indices[p]);
  bool seen = false;  // every thread scans all earlier pairs: the block leaves uniformly
  for (int q = 0; q < p; ++q) seen = seen || static_cast<int>(indices[q]) == e;
  if (seen) return;   // an earlier pair's block serves expert e
  for (int m = tid; m < M; m += threads) {
    int found = -1;
    for (int j = K - 1; j >= 0; --j) if (static_cast<int>(indices[m * K + j]) == e) found = m * K + j;
    pair_of_token[m] = found;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    int c = 0;
    for (int m = 0; m < M; ++m)
      if (pair_of_token[m] >= 0) { member_token[c] = m; member_pair[c] = pair_of_token[m]; ++c; }
    n_members[0] = c;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int count = n_members[0];
  const int lane = tid % 32, warp = tid / 32, sub = lane % LPR;
  const int row = (static_cast<int>(threadgroup_position_in_grid.x) * WARPS + warp) * RPW + lane / LPR;
  const bool active = row < N;
  if (e < 0 || e >= E) {
    if (active && sub == 0)
      for (int mi = 0; mi < count; ++mi) h[(ulong)member_pair[mi] * N + row] = 0.0f;
    return;
  }
  WEIGHT_POINTERS
  const ulong wrow = ((ulong)e * N + (active ? row : 0)) * ROW_CHUNKS;
  const ulong grow = ((ulong)e * N + (active ? row : 0)) * GROUPS;
  float acc[NW][M];
  MOE_UNROLL
  for (int s = 0; s < NW; ++s) {
    MOE_UNROLL
    for (int mi = 0; mi < M; ++mi) acc[s][mi] = 0.0f;
  }
  for (int t0 = 0; t0 < D; t0 += TILE) {
    const int tile_len = metal::min(TILE, D - t0);
    const int tile_chunks = tile_len / VPC;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < count * tile_len; i += threads) {
      const int mi = i / tile_len, v = i - mi * tile_len;
      xs[(mi * CPT + v / VPC) * (VPC + 1) + v % VPC] =
          static_cast<float>(x[(ulong)member_token[mi] * D + t0 + v]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!active) continue;
    for (int c0 = sub; c0 < tile_chunks; c0 += LPR * U) {
      uint4 wv[NW][U];
      float sc[NW][U], bi[NW][U];
      MOE_UNROLL
      for (int u = 0; u < U; ++u) {
        const int cl = c0 + u * LPR;
        if (cl < tile_chunks) {
          const int c = t0 / VPC + cl;
          MOE_UNROLL
          for (int s = 0; s < NW; ++s) {
            wv[s][u] = ((const device uint4*)wp[s])[wrow + c];
            sc[s][u] = static_cast<float>(sp[s][grow + c * VPC / GS]);
            bi[s][u] = static_cast<float>(bp[s][grow + c * VPC / GS]);
          }
        }
      }
      MOE_UNROLL
      for (int u = 0; u < U; ++u) {
        const int cl = c0 + u * LPR;
        if (cl >= tile_chunks) continue;
        MOE_UNROLL
        for (int mi = 0; mi < M; ++mi) {
          if (mi >= count) continue;
          const threadgroup float* xc = xs + (mi * CPT + cl) * (VPC + 1);
          float dot[NW];
          float xsum = 0.0f;
          MOE_UNROLL
          for (int s = 0; s < NW; ++s) dot[s] = 0.0f;
          MOE_UNROLL
          for (int j = 0; j < VPC; ++j) {
            const float xv = xc[j];
            xsum += xv;
            MOE_UNROLL
            for (int s = 0; s < NW; ++s) dot[s] += moe_weight<BITS>(wv[s][u], j) * xv;
          }
          MOE_UNROLL
          for (int s = 0; s < NW; ++s) acc[s][mi] += sc[s][u] * dot[s] + bi[s][u] * xsum;
        }
      }
    }
  }
  MOE_UNROLL
  for (int mi = 0; mi < M; ++mi) {
    if (mi >= count) continue;
    float v[NW];
    MOE_UNROLL
    for (int s = 0; s < NW; ++s) {
      v[s] = acc[s][mi];
      for (ushort o = LPR / 2; o > 0; o >>= 1) v[s] += simd_shuffle_xor(v[s], o);
    }
    if (active && sub == 0) {
      float hv;
      if (KIND == 0) hv = v[0] / (1.0f + metal::exp(-v[0])) * v[NW - 1];
      else { const float r = metal::max(v[0], 0.0f); hv = r * r; }
      h[(ulong)member_pair[mi] * N + row] = hv;
    }
  }
// ---- out body ----
  // Template: T (y), S, SC, M, K, E, D (hidden), N (output rows), GS, BITS, LPR, WARPS, TILE, U.
  constexpr int P = M * K;
  constexpr int VPC = 128 / BITS;
  constexpr int CPT = TILE / VPC;
  constexpr int ROW_CHUNKS = D / VPC;
  constexpr int GROUPS = D / GS;
  constexpr int RPW = 32 / LPR;
  threadgroup int pidx[P];
  threadgroup int leader[P];
  threadgroup int group_expert[P];
  threadgroup int group_pair[P][M];
  threadgroup float group_score[P][M];
  threadgroup int n_groups[1];
  threadgroup float hs[P * CPT * (VPC + 1)];
  const int tid = thread_index_in_threadgroup;
  const int threads = WARPS * 32;
  for (int q = tid; q < P; q += threads) pidx[q] = static_cast<int>(indices[q]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int q = tid; q < P; q += threads) {
    const int e = pidx[q];
    int lead = e >= 0 && e < E;
    for (int r = 0; r < q; ++r) lead &= pidx[r] != e;
    leader[q] = lead;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int q = tid; q < P; q += threads) {
    if (!leader[q]) continue;
    int g = 0;
    for (int r = 0; r < q; ++r) g += leader[r];
    const int e = pidx[q];
    group_expert[g] = e;
    for (int m = 0; m < M; ++m) {
      int first = -1;
      float score = 0.0f;
      for (int j = 0; j < K; ++j) {
        if (pidx[m * K + j] != e) continue;
        if (first < 0) first = m * K + j;
        score += static_cast<float>(scores[m * K + j]);
      }
      group_pair[g][m] = first;
      group_score[g][m] = score;
    }
  }
  if (tid == 0) {
    int c = 0;
    for (int q = 0; q < P; ++q) c += leader[q];
    n_groups[0] = c;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int groups = n_groups[0];
  const int lane = tid % 32, warp = tid / 32, sub = lane % LPR;
  const int row = (static_cast<int>(threadgroup_position_in_grid.x) * WARPS + warp) * RPW + lane / LPR;
  const bool active = row < N;
  const int safe_row = active ? row : 0;
  float acc[M];
  MOE_UNROLL
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  for (int t0 = 0; t0 < D; t0 += TILE) {
    const int tile_len = metal::min(TILE, D - t0);
    const int tile_chunks = tile_len / VPC;
    const int per_lane = (tile_chunks + LPR - 1) / LPR;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = tid; i < P * tile_len; i += threads) {
      const int q = i / tile_len, v = i - q * tile_len;
      hs[(q * CPT + v / VPC) * (VPC + 1) + v % VPC] = h[(ulong)q * D + t0 + v];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!active) continue;
    const int items = groups * per_lane;
    for (int i0 = 0; i0 < items; i0 += U) {
      uint4 wv[U];
      float sc[U], bi[U];
      int gi[U], cli[U];
      MOE_UNROLL
      for (int u = 0; u < U; ++u) {
        const int it = i0 + u;
        const int g = it / per_lane;
        const int cl = sub + (it - g * per_lane) * LPR;
        gi[u] = g;
        cli[u] = it < items && cl < tile_chunks ? cl : -1;
        if (cli[u] >= 0) {
          const ulong r = (ulong)group_expert[g] * N + safe_row;
          const int c = t0 / VPC + cl;
          wv[u] = ((const device uint4*)w)[r * ROW_CHUNKS + c];
          sc[u] = static_cast<float>(scales[r * GROUPS + c * VPC / GS]);
          bi[u] = static_cast<float>(biases[r * GROUPS + c * VPC / GS]);
        }
      }
      MOE_UNROLL
      for (int u = 0; u < U; ++u) {
        if (cli[u] < 0) continue;
        MOE_UNROLL
        for (int m = 0; m < M; ++m) {
          const int q = group_pair[gi[u]][m];
          if (q < 0) continue;
          const threadgroup float* hc = hs + (q * CPT + cli[u]) * (VPC + 1);
          float dot = 0.0f, hsum = 0.0f;
          MOE_UNROLL
          for (int j = 0; j < VPC; ++j) {
            const float hv = hc[j];
            dot += moe_weight<BITS>(wv[u], j) * hv;
            hsum += hv;
          }
          acc[m] += group_score[gi[u]][m] * (sc[u] * dot + bi[u] * hsum);
        }
      }
    }
  }
  MOE_UNROLL
  for (int m = 0; m < M; ++m) {
    float v = acc[m];
    for (ushort o = LPR / 2; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
    if (active && sub == 0) y[(ulong)m * N + row] = static_cast<T>(v);
  }
