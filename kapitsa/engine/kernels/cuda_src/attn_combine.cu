  // Decode attention, part 2: block (b, query head) merges the P = S * WARPS partials of
  // attn_partial.cu (max m_i, sum l_i, weighted values o_i): out = sum_i e^(m_i - M) o_i /
  // sum_i e^(m_i - M) l_i with M = max m_i; a partial that saw no key has m = -inf and weighs 0.
  // The result is written as [B, Hq * D] (what the output projection reads), times
  // sigmoid(gate) when GATE (Qwen's gated attention).
  const int bq = blockIdx.x;  // b * HQ + query head
  const int b = bq / HQ, hq = bq % HQ;
  float M = __int_as_float(-8388608);
  for (int p = 0; p < P; ++p) M = fmaxf(M, part_ml[((size_t)bq * P + p) * 2]);
  float denom = 0.f;
  for (int p = 0; p < P; ++p) {
    denom = fmaf(expf(part_ml[((size_t)bq * P + p) * 2] - M), part_ml[((size_t)bq * P + p) * 2 + 1], denom);
  }
  for (int d = threadIdx.x; d < D; d += THREADS) {
    float o = 0.f;
    for (int p = 0; p < P; ++p) {
      o = fmaf(expf(part_ml[((size_t)bq * P + p) * 2] - M), part_o[((size_t)bq * P + p) * D + d], o);
    }
    o = o / denom;
    const size_t at = (size_t)b * HQ * D + (size_t)hq * D + d;
    if (GATE) o = o / (1.f + expf(-(float)gate[at]));
    out[at] = (T)o;
  }
