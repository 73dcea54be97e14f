  // y[M, N] = [res +] [RMSNorm](x)[M, K] @ dequantize(w)[N, K]^T, M <= 8, bf16 x, affine 4-bit.
  // Each warp streams its weights through a private ring of STAGES shared-memory stages with
  // cp.async, STAGES - 1 stages in flight while it computes one, so the memory system always has
  // work queued and no registers hold loads in flight. A stage is KS values of K for the warp's
  // ROWS rows (16 * TILES), plus the same span of x, of the norm weight (NORM) and the rows'
  // scales and biases. The math is qmv_tc's: ldmatrix gives lane (g, t) word t of a 16-byte chunk
  // of rows g and g + 8; two nibble pairs per word become bf16 pairs (ktc_pair) for
  // mma.m16n8k16 with the M rows of x as B's columns; a second MMA with A = 1 sums x per column,
  // and each group adds scale * dot + (bias - 128 * scale) * sum(x) (bias * sum(x) with EXACT_Q).
  // S consecutive warps of a block split a tile's K and add their partial sums in shared memory.
  // NORM: x is a pre-norm hidden state; each stage's x is multiplied by the norm weight in place
  // (once per warp) while the sum of squares accumulates, and rsqrt(mean(x^2) + eps) scales the
  // result. RESID: y += res. Unused inputs (nw, res) are x again.
  constexpr int ROWS = 16 * TILES;
  constexpr int CPS = KS / 32;               // 16-byte chunks of a row per stage
  constexpr int GPS = KS / GS;               // groups per stage (at least 2: SBB >= 4)
  constexpr int CPG = GS / 32;               // chunks per group
  constexpr int NST = K / KS;                // stages per row
  constexpr int GROUPS = K / GS;
  constexpr int TG = (N + ROWS - 1) / ROWS;  // warp tiles over N
  constexpr int WP = KS / 2 + 16;            // bytes per weight row of a stage (the pad spreads ldmatrix rows over the banks)
  constexpr int XP = KS * 2 + 16;            // bytes per x row of a stage
  constexpr int SBB = 2 * GPS;               // bytes of one row's scales (or biases) in a stage
  constexpr int SBC = SBB < 16 ? SBB : 16;   // ... copied in pieces of SBC bytes (4, 8 or 16)
  constexpr int X_OFF = ROWS * WP;
  constexpr int NW_OFF = X_OFF + M * XP;
  constexpr int SB_OFF = NW_OFF + (NORM ? XP : 0);
  constexpr int STAGE = (SB_OFF + 2 * ROWS * SBB + 15) / 16 * 16;
  constexpr uint32_t ONES = 0x3F803F80u;     // bf16 pair (1, 1)
  KST_SHARED;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int gw = blockIdx.x * WARPS + warp;
  const int tile = gw / S, split = gw - tile * S;
  const int tile_c = tile < TG ? tile : TG - 1;  // spare warps recompute the last tile, never store
  const int st0 = split * NST / S, st1 = (split + 1) * NST / S;
  unsigned char* const ring = kst_smem + warp * (STAGES * STAGE);
  const uint4* const w16 = reinterpret_cast<const uint4*>(w);
  const int xrow = g < M ? g : M - 1;            // B's columns past M repeat the last row

  auto issue = [&](const int st, unsigned char* const base) {
    #pragma unroll
    for (int i = lane; i < ROWS * CPS; i += 32) {
      const int r = i / CPS, c = i - r * CPS;
      const int row = min(tile_c * ROWS + r, N - 1);  // past N: row N - 1 again, never stored
      kst_copy_stream(base + r * WP + c * 16, w16 + (size_t)row * (K / 32) + st * CPS + c);
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      #pragma unroll
      for (int c = lane; c < KS / 8; c += 32) kst_copy_shared<16>(base + X_OFF + m * XP + c * 16, x + (size_t)m * K + st * KS + c * 8);
    }
    if constexpr (NORM) {
      #pragma unroll
      for (int c = lane; c < KS / 8; c += 32) kst_copy_shared<16>(base + NW_OFF + c * 16, nw + st * KS + c * 8);
    }
    #pragma unroll
    for (int i = lane; i < 2 * ROWS; i += 32) {     // scales of the ROWS rows, then their biases
      const int r = i < ROWS ? i : i - ROWS;
      const int row = min(tile_c * ROWS + r, N - 1);
      const __nv_bfloat16* const src = (i < ROWS ? scales : biases) + (size_t)row * GROUPS + st * GPS;
      #pragma unroll
      for (int piece = 0; piece < SBB / SBC; ++piece) {
        kst_copy_shared<SBC>(base + SB_OFF + i * SBB + piece * SBC, src + piece * (SBC / 2));
      }
    }
  };

  float acc[TILES][4], ss[M];
  #pragma unroll
  for (int tt = 0; tt < TILES; ++tt) {
    #pragma unroll
    for (int j = 0; j < 4; ++j) acc[tt][j] = 0.f;
  }
  #pragma unroll
  for (int m = 0; m < M; ++m) ss[m] = 0.f;

  auto compute = [&](unsigned char* const base) {
    if constexpr (NORM) {  // x *= norm weight in place, once per warp; squares of the raw x
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int c = lane; c < KS / 8; c += 32) {
          uint4* const xp = reinterpret_cast<uint4*>(base + X_OFF + m * XP + c * 16);
          float xv[8], gv[8];
          kst_unpack8(*xp, xv);
          kst_unpack8(*reinterpret_cast<const uint4*>(base + NW_OFF + c * 16), gv);
          #pragma unroll
          for (int e = 0; e < 8; ++e) {
            ss[m] = fmaf(xv[e], xv[e], ss[m]);
            xv[e] *= gv[e];
          }
          *xp = kst_pack8(xv);
        }
      }
      __syncwarp();
    }
    const unsigned char* const xs = base + X_OFF + xrow * XP;
    const __nv_bfloat16* const sb = reinterpret_cast<const __nv_bfloat16*>(base + SB_OFF);
    float dq[TILES][4], dn[4];
    #pragma unroll
    for (int pc = 0; pc < CPS / 2; ++pc) {         // pairs of chunks: one ldmatrix.x4 per tile
      uint32_t wr[TILES][4];
      #pragma unroll
      for (int tt = 0; tt < TILES; ++tt) {
        const int r = tt * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        kst_ldmatrix4(wr[tt], base + r * WP + (2 * pc + (lane >> 4)) * 16);
      }
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * pc + h;                  // chunk of the stage; wr[tt][2h], [2h + 1]: rows g, g + 8
        if (c % CPG == 0) {
          #pragma unroll
          for (int j = 0; j < 4; ++j) {
            dn[j] = 0.f;
            #pragma unroll
            for (int tt = 0; tt < TILES; ++tt) dq[tt][j] = 0.f;
          }
        }
        const uint4 xq = *reinterpret_cast<const uint4*>(xs + c * 64 + t * 16);
        const uint32_t xw[4] = {xq.x, xq.y, xq.z, xq.w};
        #pragma unroll
        for (int step = 0; step < 2; ++step) {      // nibble pairs (2s, 2s+4) and (2s+1, 2s+5)
          const uint32_t b0 = ktc_xpair(xw, 2 * step), b1 = ktc_xpair(xw, 2 * step + 1);
          const uint32_t ones[4] = {ONES, ONES, ONES, ONES};
          ktc_mma(dn, ones, b0, b1);
          #pragma unroll
          for (int tt = 0; tt < TILES; ++tt) {
            const uint32_t w0 = wr[tt][2 * h], w1 = wr[tt][2 * h + 1];
            const uint32_t a[4] = {ktc_pair<EXACT_Q>(w0, 2 * step), ktc_pair<EXACT_Q>(w1, 2 * step),
                                   ktc_pair<EXACT_Q>(w0, 2 * step + 1), ktc_pair<EXACT_Q>(w1, 2 * step + 1)};
            ktc_mma(dq[tt], a, b0, b1);
          }
        }
        if (c % CPG == CPG - 1) {                  // the group's last chunk: scale and bias
          const int gi = c / CPG;
          #pragma unroll
          for (int tt = 0; tt < TILES; ++tt) {
            #pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int r = tt * 16 + hh * 8 + g;
              const float s = (float)sb[r * GPS + gi];
              const float bias = (float)sb[(ROWS + r) * GPS + gi] - (EXACT_Q ? 0.f : 128.f * s);
              acc[tt][2 * hh] = fmaf(s, dq[tt][2 * hh], fmaf(bias, dn[0], acc[tt][2 * hh]));
              acc[tt][2 * hh + 1] = fmaf(s, dq[tt][2 * hh + 1], fmaf(bias, dn[1], acc[tt][2 * hh + 1]));
            }
          }
        }
      }
    }
  };

  #pragma unroll
  for (int p = 0; p < STAGES - 1; ++p) {
    if (st0 + p < st1) issue(st0 + p, ring + p * STAGE);
    kst_commit();
  }
  int slot = 0, ahead_slot = STAGES - 1;
  for (int st = st0; st < st1; ++st) {
    kst_wait<STAGES - 2>();                        // this lane's copies of stage st have landed
    __syncwarp();                                  // ... and every lane's; stage st - 1 is consumed
    if (st + STAGES - 1 < st1) issue(st + STAGES - 1, ring + ahead_slot * STAGE);
    kst_commit();                                  // (empty groups too: the wait counts groups)
    compute(ring + slot * STAGE);
    slot = slot + 1 == STAGES ? 0 : slot + 1;
    ahead_slot = ahead_slot + 1 == STAGES ? 0 : ahead_slot + 1;
  }
  kst_wait<0>();

  if constexpr (NORM) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
    }
  }
  if constexpr (S > 1) {  // a tile's S warps are consecutive in the block: split 0 adds the others'
    constexpr int PARTS = TILES * 4 + (NORM ? M : 0);
    float* const red = reinterpret_cast<float*>(kst_smem);  // the rings are done with
    __syncthreads();
    #pragma unroll
    for (int tt = 0; tt < TILES; ++tt) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) red[(warp * PARTS + tt * 4 + j) * 32 + lane] = acc[tt][j];
    }
    if constexpr (NORM) {
      #pragma unroll
      for (int m = 0; m < M; ++m) red[(warp * PARTS + TILES * 4 + m) * 32 + lane] = ss[m];
    }
    __syncthreads();
    if (split == 0) {
      for (int p = 1; p < S; ++p) {
        #pragma unroll
        for (int tt = 0; tt < TILES; ++tt) {
          #pragma unroll
          for (int j = 0; j < 4; ++j) acc[tt][j] += red[((warp + p) * PARTS + tt * 4 + j) * 32 + lane];
        }
        if constexpr (NORM) {
          #pragma unroll
          for (int m = 0; m < M; ++m) ss[m] += red[((warp + p) * PARTS + TILES * 4 + m) * 32 + lane];
        }
      }
    }
  }
  if (split != 0 || tile >= TG) return;
  float inv[2] = {1.f, 1.f};                       // for this lane's columns 2t, 2t + 1
  if constexpr (NORM) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = rsqrtf(ss[m] / K + __int_as_float(EPS_BITS));
      if (m == 2 * t) inv[0] = v;
      if (m == 2 * t + 1) inv[1] = v;
    }
  }
  #pragma unroll
  for (int tt = 0; tt < TILES; ++tt) {
    #pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int n = tile * ROWS + tt * 16 + hh * 8 + g;
      #pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int m = 2 * t + j;
        if (m < M && n < N) {
          float v = acc[tt][2 * hh + j] * inv[j];
          if constexpr (RESID) v += (float)res[(size_t)m * N + n];
          y[(size_t)m * N + n] = (__nv_bfloat16)v;
        }
      }
    }
  }
