"""One launch of each one-row mat-vec kernel at the Qwen3.5-27B's four fused shapes, for Nsight
Compute to time on the GPU alone (the chain timings of lab/host_costs.py include the host's
encoding of each launch):

ncu --clock-control none --kernel-name regex:'kapitsa|qmv' --metrics gpu__time_duration.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed python lab/ncu_qmv.py

Each launch is evaluated alone, after a warm-up, so the profiled run is the kernel's own.
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import qmv_direct as direct
from lab.diag_h200 import FUSED_27B, GS, read_only
from lab.host_costs import _stream_impl


def _stream(tiles: int, stages: int | None, ks: int | None = None, warps: int = 4):
    return _stream_impl(GS, tiles, False, stages, ks, warps)


IMPLS = {  # read_only: a grid-stride read of the packed weights alone, the bandwidth a launch of this size can reach
    "read_only": lambda x, q, s, b: read_only(q),
    "stock": lambda x, q, s, b: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=GS, bits=4),
    "direct": lambda x, q, s, b: direct.qmv_direct(x, q, s, b, group_size=GS, bits=4),
    # persistent grids (5-6 resident blocks per SM at 80-90 registers, 132 SMs): warps loop over tasks
    "direct_p660": lambda x, q, s, b: direct.qmv_direct(
        x, q, s, b, group_size=GS, bits=4, shape=(4, 4, 2, False, 660)
    ),
    "direct_p792": lambda x, q, s, b: direct.qmv_direct(
        x, q, s, b, group_size=GS, bits=4, shape=(4, 4, 2, False, 792)
    ),
    "stream_t1": _stream(1, None),
    "stream_t2s4": _stream(2, 4),
    "stream_ks1024_w2": _stream(1, 3, 1024, 2),  # rows read in 512-byte runs per stage
    "stream_ks512": _stream(1, 4, 512),
    "stream_w1": _stream(1, None, None, 1),  # one warp per block: the finest blocks
}

for n, k in FUSED_27B:
    q, s, b = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02, group_size=GS, bits=4)
    x = mx.random.normal((1, k)).astype(mx.bfloat16)
    mx.eval(q, s, b, x)
    for name, impl in IMPLS.items():
        mx.eval(impl(x, q, s, b))  # warm-up (JIT)
        mx.synchronize()
        mx.eval(impl(x, q, s, b))
        mx.synchronize()
        print(f"{name} n={n} k={k} bytes={q.nbytes + s.nbytes + b.nbytes}", flush=True)
