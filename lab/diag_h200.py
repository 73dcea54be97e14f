"""Where a 27B decode step's GPU time goes on the H200, in one short run (prints JSON lines):

- qmv: a chain of the 27B's fused weight mat-vecs (4 per layer x 64 layers, 4 distinct layers
  cycled so L2 can't hold them) for MLX's stock kernel, kapitsa's general, one-row and
  tensor-core kernels (kernels/matvec*.py, several launch variants) and a read-only kernel that only streams the same bytes (the ceiling for one
  launch per matrix). Host encode time (`mx.async_eval` returning) is reported beside the total.
- gdn_prefill: one 27B Gated DeltaNet layer's recurrence at T tokens: the op path the model runs
  (mx.fast.gated_delta_update) against the fused gdn_step kernel run over all T tokens.
- qmm: the fused chain at M=512 rows (prefill's mat-muls): TFLOP/s of stock quantized_matmul.

Run: python lab/diag_h200.py [--skip qmv gdn qmm]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from kapitsa.engine.kernels import gdn, matvec, matvec_one_row, matvec_tensor_core
from kapitsa.engine.kernels.cuda import CudaKernel

GS = 64
FUSED_27B = [(10240 + 6144 + 96, 5120), (5120, 6144), (2 * 17408, 5120), (5120, 17408)]

_READ = CudaKernel(
    name="kapitsa_read_only",
    input_names=("w",),
    output_names=("y",),
    source="""
  const uint4* p = reinterpret_cast<const uint4*>(w);
  const size_t n = (size_t)NBYTES / 16;
  uint32_t a = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int o = 16; o > 0; o >>= 1) a ^= __shfl_xor_sync(0xffffffffu, a, o);
  if ((threadIdx.x & 31) == 0) y[(blockIdx.x * blockDim.x + threadIdx.x) >> 5] = a;
""",
)


def read_only(w: mx.array) -> mx.array:
    blocks = min(132 * 8, max(1, w.nbytes // 16 // 256))
    return _READ(
        [w],
        template=[("NBYTES", w.nbytes)],
        grid=(blocks * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(blocks * 8,)],
        output_dtypes=[mx.uint32],
    )[0]


def timed(fn, iters: int = 5) -> tuple[float, float]:
    """(total ms, host encode ms) per call of fn() -> list of arrays, after two warm-ups."""
    for _ in range(2):
        mx.eval(fn())
    total = encode = 0.0
    for _ in range(iters):
        start = time.perf_counter()
        outs = fn()
        mx.async_eval(outs)
        queued = time.perf_counter()
        mx.eval(outs)
        done = time.perf_counter()
        total += done - start
        encode += queued - start
    return total / iters * 1e3, encode / iters * 1e3


def _tensor_core(x, q, s, b, tiles: int, exact: bool) -> mx.array:
    return matvec_tensor_core.qmv_tensor_core(x, q, s, b, group_size=GS, tiles=tiles, exact_q=exact)


def qmv_diag(rows_list, bits: int) -> None:
    layers = []
    for _ in range(4):
        layer = []
        for n, k in FUSED_27B:
            wf = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
            q, s, b = mx.quantize(wf, group_size=GS, bits=bits)
            mx.eval(q, s, b)
            layer.append((q, s, b, k))
        layers.append(layer)
    chain = [layers[i % 4][j] for i in range(64) for j in range(4)]
    nbytes = sum(q.nbytes + s.nbytes + b.nbytes for q, s, b, _ in chain)
    for rows in rows_list:
        xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for k in {c[3] for c in chain}}
        impls = {
            "stock": lambda x, q, s, b: mx.quantized_matmul(
                x, q, s, b, transpose=True, group_size=GS, bits=bits
            ),
            "general": lambda x, q, s, b: matvec.qmv_general(x, q, s, b, group_size=GS, bits=bits),
            "read_only": lambda x, q, s, b: read_only(q),
        }
        impls["one_row"] = lambda x, q, s, b: matvec_one_row.qmv_one_row(x, q, s, b, group_size=GS, bits=bits)
        impls["one_row(2, 4, 8)"] = lambda x, q, s, b: matvec_one_row.qmv_one_row(
            x, q, s, b, group_size=GS, bits=bits, shape=(2, 4, 8)
        )
        for tiles, exact in [(2, True), (2, False), (1, True)]:
            impls[f"tensor_core(tiles={tiles}, exact={exact})"] = lambda x, q, s, b, o=(tiles, exact): (
                _tensor_core(x, q, s, b, *o)
            )
        ref = [impls["stock"](xs[k], q, s, b) for q, s, b, k in layers[0]]
        for name, impl in impls.items():
            try:
                if name != "read_only":
                    got = [impl(xs[k], q, s, b) for q, s, b, k in layers[0]]
                    err = max(
                        (mx.abs(g.astype(mx.float32) - r.astype(mx.float32)).max() / mx.abs(r).max()).item()
                        for g, r in zip(got, ref, strict=True)
                    )
                else:
                    err = 0.0
                ms, enc = timed(lambda impl=impl, xs=xs: [impl(xs[k], q, s, b) for q, s, b, k in chain])
                row = dict(
                    kind="qmv", bits=bits, rows=rows, impl=name, ms=round(ms, 2), encode_ms=round(enc, 2)
                )
                row.update(gbs=round(nbytes / ms / 1e6, 1), rel_err=round(err, 5))
            except Exception as e:  # a launch shape that fails must not hide the others
                row = dict(kind="qmv", bits=bits, rows=rows, impl=name, error=str(e)[:300])
            print(json.dumps(row), flush=True)


def gdn_diag(tokens_list) -> None:
    hk, hv, dk, dv, K = 16, 48, 128, 128, 4
    C = 2 * hk * dk + hv * dv
    heads = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    w = mx.random.normal((C, K, 1)).astype(mx.bfloat16) * 0.3
    for T in tokens_list:
        conv_in = mx.random.normal((1, K - 1 + T, C)).astype(mx.bfloat16)
        a, b = (mx.random.normal((1, T, hv)).astype(mx.bfloat16) for _ in range(2))
        z = mx.random.normal((1, T, hv * dv)).astype(mx.bfloat16)
        args = (conv_in, w, a, b, mx.zeros((hv,)) - 1, mx.ones((hv,)), z, mx.ones((dv,)), None)
        mx.eval(*args[:8])
        ref_ms, _ = timed(lambda args=args: list(gdn.gdn_step_reference(*args, **heads, norm_eps=1e-6)))
        try:
            out_k, st_k = gdn.gdn_step(*args, **heads, norm_eps=1e-6)
            out_r, st_r = gdn.gdn_step_reference(*args, **heads, norm_eps=1e-6)
            err = (mx.abs(st_k - st_r).max() / mx.abs(st_r).max()).item()
            k_ms, _ = timed(lambda args=args: list(gdn.gdn_step(*args, **heads, norm_eps=1e-6)))
            row = dict(kind="gdn_prefill", T=T, op_path_ms=round(ref_ms, 3), kernel_ms=round(k_ms, 3))
            print(json.dumps({**row, "state_rel_err": round(err, 5)}), flush=True)
        except Exception as e:
            print(json.dumps(dict(kind="gdn_prefill", T=T, op_path_ms=round(ref_ms, 3), error=str(e)[:300])))


def qmm_diag(rows: int) -> None:
    chain = []
    for n, k in FUSED_27B * 4:
        q, s, b = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02, group_size=GS, bits=4)
        mx.eval(q, s, b)
        chain.append((q, s, b, k, n))
    xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for k in {c[3] for c in chain}}
    flops = sum(2 * rows * n * k for _, _, _, k, n in chain)
    for name, fn in {
        "stock_qmm": lambda x, q, s, b: mx.quantized_matmul(
            x, q, s, b, transpose=True, group_size=GS, bits=4
        ),
        "dequant_then_bf16_mm": lambda x, q, s, b: x @ mx.dequantize(q, s, b, group_size=GS, bits=4).T,
    }.items():
        ms, enc = timed(lambda fn=fn: [fn(xs[k], q, s, b) for q, s, b, k, _ in chain])
        print(
            json.dumps(
                dict(kind="qmm", rows=rows, impl=name, ms=round(ms, 2), tflops=round(flops / ms / 1e9, 1))
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    print(json.dumps(dict(mlx=mx.__version__, device=str(mx.default_device()))), flush=True)
    if "gdn" not in args.skip:
        gdn_diag([64, 512, 2048])
    if "qmm" not in args.skip:
        qmm_diag(512)
    if "qmv" not in args.skip:
        qmv_diag(args.rows, 4)


if __name__ == "__main__":
    main()
