"""One launch of each one-row mat-vec kernel at the Qwen3.5-27B's four fused shapes, for Nsight
Compute to time on the GPU alone (the chain timings of lab/host_costs.py include the host's
encoding of each launch):

ncu --clock-control none --kernel-name regex:'kapitsa|qmv' --metrics gpu__time_duration.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed python lab/ncu_qmv.py

Each launch is evaluated alone, after a warm-up, so the profiled run is the kernel's own.
"""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.kernels import matvec_one_row as one_row
from lab.diag_h200 import FUSED_27B, GS, read_only

IMPLS = {  # read_only: a grid-stride read of the packed weights alone, the bandwidth a launch of this size can reach
    "read_only": lambda x, q, s, b: read_only(q),
    "stock": lambda x, q, s, b: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=GS, bits=4),
    "one_row": lambda x, q, s, b: one_row.qmv_one_row(x, q, s, b, group_size=GS, bits=4),
    # persistent grids (5-6 resident blocks per SM at 80-90 registers, 132 SMs): warps loop over tasks
    "one_row_p660": lambda x, q, s, b: one_row.qmv_one_row(
        x, q, s, b, group_size=GS, bits=4, shape=(4, 4, 2, False, 660)
    ),
    "one_row_p792": lambda x, q, s, b: one_row.qmv_one_row(
        x, q, s, b, group_size=GS, bits=4, shape=(4, 4, 2, False, 792)
    ),
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
