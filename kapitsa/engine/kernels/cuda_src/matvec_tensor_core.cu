  // y[M, N] = x[M, K] @ dequantize(w)[N, K]^T for M <= 16, affine 4-bit, bf16 x, on tensor cores:
  // mma.m16n8k16 with the weights as A (16 rows) and the M rows of x as B's 8 columns, in NB
  // blocks of 8 rows (one A fragment serves every block).
  // Layout of a lane (g = lane / 4, t = lane % 4): weight rows g and g + 8 of each 16-row tile,
  // x row g (B's column g), accumulators for columns 2t, 2t + 1. A 64-value span of a row is 8
  // words; lane t takes words 2t and 2t + 1 (one 8-byte load; a quad reads 32 contiguous bytes),
  // and for each word two MMA steps take nibble pairs (0,4),(1,5) then (2,6),(3,7). The k order
  // inside an MMA is free as long as A and B agree, and every step stays inside one group.
  // A holds 128 + q (exact in bf16), or q itself with EXACT_Q (one bf16 subtraction per pair, so
  // the MMA never sums the 128 * x offsets); a second MMA with A = 1 gives sum(x) per column, so a
  // group adds scale * dot + (bias - 128 * scale) * sum(x) (bias * sum(x) with EXACT_Q).
  constexpr int SPANS = K / 64;                  // 64-value spans per row
  constexpr int SPG = GS / 64;                   // spans per group
  constexpr int GROUPS = K / GS;
  constexpr int ROWS_PER_WARP = 16 * TILES;
  constexpr int TG = (N + ROWS_PER_WARP - 1) / ROWS_PER_WARP;  // warp tiles over N
  constexpr int NB = MB / 8;                     // 8-row blocks of x (B operands)
  int M = 1;                                     // rows at run time (<= MB): one compile per block count
  for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];
  constexpr uint32_t ONES = 0x3F803F80u;         // bf16 pair (1, 1)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int gw = blockIdx.x * WARPS + warp;      // global warp: S consecutive warps split K
  const int tile = gw / S, split = gw - tile * S;
  const int tile_c = tile < TG ? tile : TG - 1;  // spare warps recompute the last tile, never store
  const int g0 = split * GROUPS / S, g1 = (split + 1) * GROUPS / S;
  const uint2* w2 = reinterpret_cast<const uint2*>(w);
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  int xrow[NB];                                  // B's columns past M repeat the last row
  #pragma unroll
  for (int nb = 0; nb < NB; ++nb) xrow[nb] = nb * 8 + g < M ? nb * 8 + g : M - 1;

  int rows[TILES][2];
  #pragma unroll
  for (int tt = 0; tt < TILES; ++tt) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) rows[tt][h] = min(tile_c * ROWS_PER_WARP + tt * 16 + h * 8 + g, N - 1);
  }
  float acc[TILES][NB][4];
  #pragma unroll
  for (int tt = 0; tt < TILES; ++tt) {
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) acc[tt][nb][j] = 0.f;
    }
  }

  for (int gi0 = g0; gi0 < g1; gi0 += UG) {
    // Loads of UG groups first (all in flight), then their math.
    uint2 wv[UG][SPG][TILES][2];
    uint4 xv[UG][SPG][NB][2];
    #pragma unroll
    for (int u = 0; u < UG; ++u) {
      const int gi = gi0 + u < g1 ? gi0 + u : g0;  // past the range: reload a valid group, unused
      #pragma unroll
      for (int sp = 0; sp < SPG; ++sp) {
        const int span = gi * SPG + sp;
        #pragma unroll
        for (int tt = 0; tt < TILES; ++tt) {
          #pragma unroll
          for (int h = 0; h < 2; ++h) wv[u][sp][tt][h] = __ldcs(w2 + (size_t)rows[tt][h] * (SPANS * 4) + span * 4 + t);
        }
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          const size_t xi = (size_t)xrow[nb] * (K / 8) + span * 8 + 2 * t;
          xv[u][sp][nb][0] = x4[xi];
          xv[u][sp][nb][1] = x4[xi + 1];
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < UG; ++u) {
      if (gi0 + u >= g1) break;
      const int gi = gi0 + u;
      float dq[TILES][NB][4], dn[NB][4];
      #pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          dn[nb][j] = 0.f;
          #pragma unroll
          for (int tt = 0; tt < TILES; ++tt) dq[tt][nb][j] = 0.f;
        }
      }
      #pragma unroll
      for (int sp = 0; sp < SPG; ++sp) {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {   // word 2t (x values 0-7), word 2t+1 (8-15)
          #pragma unroll
          for (int step = 0; step < 2; ++step) {  // nibble pairs (2s, 2s+4) and (2s+1, 2s+5)
            uint32_t a[TILES][4];
            #pragma unroll
            for (int tt = 0; tt < TILES; ++tt) {
              const uint32_t w0 = half ? wv[u][sp][tt][0].y : wv[u][sp][tt][0].x;
              const uint32_t w1 = half ? wv[u][sp][tt][1].y : wv[u][sp][tt][1].x;
              a[tt][0] = ktc_pair<EXACT_Q>(w0, 2 * step);
              a[tt][1] = ktc_pair<EXACT_Q>(w1, 2 * step);
              a[tt][2] = ktc_pair<EXACT_Q>(w0, 2 * step + 1);
              a[tt][3] = ktc_pair<EXACT_Q>(w1, 2 * step + 1);
            }
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
              const uint4 xq = xv[u][sp][nb][half];
              const uint32_t xw[4] = {xq.x, xq.y, xq.z, xq.w};
              const uint32_t b0 = ktc_xpair(xw, 2 * step), b1 = ktc_xpair(xw, 2 * step + 1);
              const uint32_t ones[4] = {ONES, ONES, ONES, ONES};
              ktc_mma(dn[nb], ones, b0, b1);
              #pragma unroll
              for (int tt = 0; tt < TILES; ++tt) ktc_mma(dq[tt][nb], a[tt], b0, b1);
            }
          }
        }
      }
      #pragma unroll
      for (int tt = 0; tt < TILES; ++tt) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float s = (float)scales[(size_t)rows[tt][h] * GROUPS + gi];
          const float c = (float)biases[(size_t)rows[tt][h] * GROUPS + gi] - (EXACT_Q ? 0.f : 128.f * s);
          #pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            acc[tt][nb][2 * h] = fmaf(s, dq[tt][nb][2 * h], fmaf(c, dn[nb][0], acc[tt][nb][2 * h]));
            acc[tt][nb][2 * h + 1] = fmaf(s, dq[tt][nb][2 * h + 1], fmaf(c, dn[nb][1], acc[tt][nb][2 * h + 1]));
          }
        }
      }
    }
  }

  if constexpr (S > 1) {  // the S warps of a tile sit in one block: sum their partial dots
    __shared__ float ktc_red[WARPS][TILES * NB * 4][32];
    #pragma unroll
    for (int tt = 0; tt < TILES; ++tt) {
      #pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) ktc_red[warp][(tt * NB + nb) * 4 + j][lane] = acc[tt][nb][j];
      }
    }
    __syncthreads();
    if (split == 0) {
      #pragma unroll
      for (int tt = 0; tt < TILES; ++tt) {
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          #pragma unroll
          for (int j = 0; j < 4; ++j) {
            for (int p = 1; p < S; ++p) acc[tt][nb][j] += ktc_red[warp + p][(tt * NB + nb) * 4 + j][lane];
          }
        }
      }
    }
  }
  if (split == 0 && tile < TG) {
    #pragma unroll
    for (int tt = 0; tt < TILES; ++tt) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = tile * ROWS_PER_WARP + tt * 16 + h * 8 + g;
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          #pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int m = nb * 8 + 2 * t + j;
            if (m < M && n < N) y[(size_t)m * N + n] = (__nv_bfloat16)acc[tt][nb][2 * h + j];
          }
        }
      }
    }
  }
