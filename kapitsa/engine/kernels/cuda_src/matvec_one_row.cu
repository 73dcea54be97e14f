  // y[M, N] = x[M, K] @ dequantize(w)[N, K]^T, no shared memory: x is read through L1 (it is a
  // few KiB that every warp of the SM reads), so a block starts streaming weights at once.
  // NORM: x is a pre-norm hidden state and the product is RMSNorm(x) (weight nw, epsilon the
  // float whose bits are EPS_BITS) @ W^T = rsqrt(mean(x^2) + eps) * (W @ (x * nw)): the sum of
  // squares comes from the same x loads, the scalar is applied after the reduction.
  // RESID: y += res (the residual stream). Unused inputs (nw, res) are x again.
  // ACT: the product's input is an activation of x, made on load: 1 = SwiGLU (x rows are
  // [gate | up], 2K wide; the input is silu(gate) * up), 2 = relu(x)^2.
  // GLU: W's rows are [gate | up] (N = 2 * NH) and the output is y[M, NH] = silu(gate) * up,
  // made in the epilogue from the float32 sums: a warp's R rows are R / 2 gate rows and the
  // up rows of the same columns (no RESID with it).
  constexpr int CH = 128 / BITS;               // values per 16-byte chunk of a row
  constexpr int NCH = K / CH;                  // chunks per row
  constexpr int ROUNDS = (NCH + 31) / 32;      // a round: every lane takes one chunk
  constexpr int U = ROUNDS < UNROLL ? ROUNDS : UNROLL;  // rounds whose loads are issued together
  constexpr int GROUPS = K / GS;
  constexpr int XS = ACT == 1 ? 2 * K : K;     // x row stride
  // A warp's task: R consecutive output rows. PERSIST_BLOCKS = 0: one task per warp, the grid
  // covers them all. Else the grid has PERSIST_BLOCKS blocks and each warp takes every
  // (PERSIST_BLOCKS * WARPS)-th task: the warps stay resident and drift out of step, so some
  // are loading while others compute (a one-task grid loads in waves, then computes in waves).
  static_assert(!GLU || (R % 2 == 0 && N % 2 == 0 && !RESID), "GLU: even R and N, no residual");
  constexpr int NH = GLU ? N / 2 : N;          // output columns
  constexpr int COLS = GLU ? R / 2 : R;        // output columns per task
  constexpr int TASKS = (NH + COLS - 1) / COLS;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  auto task_rows = [&](const int task) {
  const int col0 = task * COLS;
  int rows[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) {  // past the last column: recompute it, never stored
    rows[r] = GLU ? min(col0 + r / 2, NH - 1) + (r % 2) * NH : min(col0 + r, N - 1);
  }

  float acc[R][M], ss[M];
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    ss[m] = 0.f;
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r][m] = 0.f;
  }

  // One round group: issue every weight load of U rounds before using any (R * U 16-byte loads
  // in flight per lane), then the math. PIPELINE unrolls the loop over groups completely, so the
  // compiler may issue the next group's loads while this one's math runs.
  auto group = [&](const int j0) {
    uint4 wq[U][R];
    float ws[U][R], wb[U][R];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (j0 + u) * 32 + lane;
      const int cc = c < NCH ? c : 0;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        wq[u][r] = __ldcs(wv + (size_t)rows[r] * NCH + cc);  // streamed once: don't keep in L1/L2
        ws[u][r] = (float)scales[(size_t)rows[r] * GROUPS + cc * CH / GS];
        wb[u][r] = (float)biases[(size_t)rows[r] * GROUPS + cc * CH / GS];
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (j0 + u) * 32 + lane;
      if (j0 + u < ROUNDS && c < NCH) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          const T* xc = x + (size_t)m * XS + (size_t)c * CH;
          float dot[R];
          #pragma unroll
          for (int r = 0; r < R; ++r) dot[r] = 0.f;
          float xsum = 0.f;
          #pragma unroll
          for (int e = 0; e < CH; e += 8) {
            float xv[8];
            kq2_load8(xc + e, xv);
            if constexpr (ACT == 1) {
              float uv[8];
              kq2_load8(xc + K + e, uv);
              #pragma unroll
              for (int t = 0; t < 8; ++t) xv[t] = xv[t] / (1.f + __expf(-xv[t])) * uv[t];
            } else if constexpr (ACT == 2) {
              #pragma unroll
              for (int t = 0; t < 8; ++t) xv[t] = xv[t] > 0.f ? xv[t] * xv[t] : 0.f;
            }
            if constexpr (NORM) {
              float gv[8];
              kq2_load8(nw + (size_t)c * CH + e, gv);
              #pragma unroll
              for (int t = 0; t < 8; ++t) {
                ss[m] = fmaf(xv[t], xv[t], ss[m]);
                xv[t] *= gv[t];
              }
            }
            #pragma unroll
            for (int t = 0; t < 8; ++t) xsum += xv[t];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
              #pragma unroll
              for (int h = 0; h < 8; h += 4) {
                const int q4 = (e + h) / 4;  // index of 4 values within the chunk
                const int word = BITS == 4 ? q4 >> 1 : q4;
                const uint4 cw = wq[u][r];
                const uint32_t wd = word == 0 ? cw.x : word == 1 ? cw.y : word == 2 ? cw.z : cw.w;
                float4 qv;
                if constexpr (BITS == 4) qv = kq2_nibbles(wd, q4 & 1);
                else qv = kq2_bytes(wd);
                dot[r] = fmaf(qv.x, xv[h], dot[r]);
                dot[r] = fmaf(qv.y, xv[h + 1], dot[r]);
                dot[r] = fmaf(qv.z, xv[h + 2], dot[r]);
                dot[r] = fmaf(qv.w, xv[h + 3], dot[r]);
              }
            }
          }
          #pragma unroll
          for (int r = 0; r < R; ++r) acc[r][m] = fmaf(ws[u][r], dot[r], fmaf(wb[u][r], xsum, acc[r][m]));
        }
      }
    }
  };
  if constexpr (PIPELINE) {
    #pragma unroll
    for (int j0 = 0; j0 < ROUNDS; j0 += U) group(j0);
  } else {
    for (int j0 = 0; j0 < ROUNDS; j0 += U) group(j0);
  }

  float inv[M];
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    inv[m] = 1.f;
    if constexpr (NORM) {
      float v = ss[m];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      inv[m] = rsqrtf(v / K + __uint_as_float((uint32_t)EPS_BITS));
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[r][m];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[r][m] = v * inv[m];
    }
  }
  #pragma unroll
  for (int c = 0; c < COLS; ++c) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v;
      if constexpr (GLU) {
        const float g = acc[2 * c][m];
        v = g / (1.f + __expf(-g)) * acc[2 * c + 1][m];
      } else {
        v = acc[c][m];
      }
      if constexpr (RESID) {
        if (col0 + c < NH) v += (float)res[(size_t)m * NH + col0 + c];
      }
      if (lane == 0 && col0 + c < NH) y[(size_t)m * NH + col0 + c] = (T)v;
    }
  }
  };
  if constexpr (PERSIST_BLOCKS == 0) {
    task_rows(blockIdx.x * WARPS + warp);
  } else {
    for (int task = blockIdx.x * WARPS + warp; task < TASKS; task += PERSIST_BLOCKS * WARPS) task_rows(task);
  }
