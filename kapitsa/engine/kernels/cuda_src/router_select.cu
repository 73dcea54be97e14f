  // One warp per token, after router_logits.cu: from the float32 logits of the EW weight rows (E
  // experts, then EW - E extra rows such as Qwen's shared-expert gate, written out in T), the
  // family's scores, the top TOPK experts (largest first, the lowest index on ties), their weights.
  // MODE 0 (Qwen): softmax over the logits rounded to T (what a T matmul returns), choice = prob,
  //   weight = prob, divided by the chosen probs' sum when NORM.
  // MODE 1 (Nemotron-H): fp32 logits, score = sigmoid, choice = score + bias, weight = score,
  //   divided by (sum + 1e-20) when NORM, times the float whose bits are SCALE_BITS.
  // The weights are written as WD (float32, or the model's dtype: rounded as a cast rounds).
  // SLOTS > 0: folded shared experts SLOT0 .. SLOT0 + SLOTS - 1 follow the TOPK in every row, at
  //   weight sigmoid(the first extra row's logit rounded to T, the result rounded to T) when GATED
  //   (Qwen's shared-expert gate), else 1.
  constexpr int W = TOPK + SLOTS;  // indices and weights per token
  constexpr int PER = (E + 31) / 32;  // experts per lane
  const float NEG_INF = __int_as_float(-8388608);  // 0xff800000
  const int token = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const float* kr_logit = logits + (size_t)token * EW;
  float score[PER], choice[PER];
  float top = NEG_INF;
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = lane + 32 * j;
    float l = e < E ? kr_logit[e] : NEG_INF;
    if (MODE == 0 && e < E) l = (float)(T)l;
    score[j] = l;
    top = fmaxf(top, l);
  }
  if (MODE == 0) {  // softmax
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    float total = 0.f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      score[j] = lane + 32 * j < E ? expf(score[j] - top) : 0.f;
      total += score[j];
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      score[j] = score[j] / total;
      choice[j] = lane + 32 * j < E ? score[j] : NEG_INF;
    }
  } else {  // sigmoid, choice biased
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int e = lane + 32 * j;
      score[j] = e < E ? 1.f / (1.f + expf(-score[j])) : 0.f;
      choice[j] = e < E ? score[j] + (float)bias[e] : NEG_INF;
    }
  }

  float picked[TOPK];
  float sum = 0.f;
  #pragma unroll
  for (int k = 0; k < TOPK; ++k) {
    float bv = NEG_INF, bs = 0.f, be = (float)E;  // index as float: exact below 2^24
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      if (choice[j] > bv) {
        bv = choice[j];
        bs = score[j];
        be = (float)(lane + 32 * j);
      }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const float os = __shfl_xor_sync(0xffffffffu, bs, o);
      const float oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) {
        bv = ov;
        bs = os;
        be = oe;
      }
    }
    const int chosen = (int)be;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      if (lane + 32 * j == chosen) choice[j] = NEG_INF;
    }
    picked[k] = bs;
    sum += bs;
    if (lane == 0) inds[(size_t)token * W + k] = (uint32_t)chosen;
  }
  const float denom = NORM ? (MODE == 0 ? sum : sum + 1e-20f) : 1.f;
  const float scale = __int_as_float(SCALE_BITS);
  if (lane == 0) {
    #pragma unroll
    for (int k = 0; k < TOPK; ++k) weights[(size_t)token * W + k] = (WD)(picked[k] / denom * scale);
  }
  if (SLOTS > 0 && lane < SLOTS) {
    float gate = 1.f;
    if (GATED) gate = (float)(T)(1.f / (1.f + expf(-(float)(T)kr_logit[E])));
    inds[(size_t)token * W + TOPK + lane] = (uint32_t)(SLOT0 + lane);
    weights[(size_t)token * W + TOPK + lane] = (WD)gate;
  }
  for (int e = E + lane; e < EW; e += 32) extra[(size_t)token * (EW - E > 0 ? EW - E : 1) + e - E] = (T)kr_logit[e];
