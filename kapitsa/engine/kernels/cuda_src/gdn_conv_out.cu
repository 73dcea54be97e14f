  // The split decode variant's second product: the conv state after these NT tokens (window rows
  // NT .. NT + K - 2) for this block's channels. A value head's own v channels are written by its
  // block; the q and k channels of a key head, shared by its HV / HK value heads, by the first.
  for (int i = tid; i < (K - 1) * W; i += NW * 32) {
    const int rr = i / W, j = i - rr * W;
    if (j < 2 * DK && h % (HV / HK) != 0) continue;
    const int c = j < DK ? kh * DK + j : (j < 2 * DK ? HK * DK + kh * DK + (j - DK) : 2 * HK * DK + h * DV + (j - 2 * DK));
    conv_out[((size_t)bi * (K - 1) + rr) * C + c] = static_cast<CT>(GDN_WINDOW(NT + rr, c));
  }
