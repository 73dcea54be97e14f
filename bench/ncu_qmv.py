"""One launch of each mat-vec kernel on Qwen3.5-27B shapes, for Nsight Compute to profile:

ncu --kernel-name regex:'kapitsa|qmv|gemv' --section SpeedOfLight ... python bench/ncu_qmv.py
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import qmv_direct as direct
from kapitsa.engine.kernels import qmv_fast as fast

GS = 64
for n, k in [(2 * 17408, 5120), (5120, 17408)]:
    q, s, b = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02, group_size=GS, bits=4)
    x = mx.random.normal((1, k)).astype(mx.bfloat16)
    mx.eval(q, s, b, x)
    mx.eval(mx.quantized_matmul(x, q, s, b, transpose=True, group_size=GS, bits=4))
    mx.eval(fast.qmv_fast(x, q, s, b, group_size=GS, bits=4))
    mx.eval(direct.qmv_direct(x, q, s, b, group_size=GS, bits=4, shape=(2, 4, 8)))
