"""Time the fused Gated DeltaNet step against the model's current op path on real head shapes.

Run on a CUDA (or Metal) machine: python lab/kernels_gdn.py [--batch 1 4] [--tokens 1 8]
Prints one JSON line per case: microseconds per call of the fused kernel (`gdn_step`; with z/b/a as
slices of the fused in-projection, which MLX copies before the launch, and as in-place HeadViews)
and of the reference (`gdn_step_reference`: the ops GatedDeltaNet runs today), each evaluated
alone in a loop after warm-up; per-layer time of a chain of as many steps as the model has GDN
layers evaluated as one graph (launch overhead amortised, as in a decode step); and the largest
difference between kernel and reference.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import mlx.core as mx

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.gdn import gdn_step, kernel_works
from kapitsa.engine.kernels.gdn_plan import supports
from kapitsa.engine.kernels.gdn_reference import gdn_step_reference, projection_views

SHAPES = {  # Hk, Hv, Dk, Dv of the GDN layers; layers = how many GDN layers the model has
    "qwen3.5-27b": dict(hk=16, hv=48, dk=128, dv=128, layers=48),
    "qwen3.5-4b": dict(hk=16, hv=32, dk=128, dv=128, layers=24),
}


def make_inputs(B: int, T: int, hk: int, hv: int, dk: int, dv: int, dtype=mx.bfloat16, K: int = 4):
    """Inputs as the model has them: z, b, a are slices of the fused in-projection `[qkv | z | b | a]`
    (what `mx.split` gives GatedDeltaNet), plus the same three as in-place `HeadView`s."""
    C = 2 * hk * dk + hv * dv
    proj = mx.random.normal((B, T, C + hv * dv + 2 * hv)).astype(dtype)
    qkv, z, b, a = mx.split(proj, [C, C + hv * dv, C + hv * dv + hv], axis=-1)
    conv_state = mx.random.normal((B, K - 1, C)).astype(dtype)
    args = dict(
        conv_in=mx.concatenate([conv_state, qkv], axis=1),
        conv_weight=(0.5 * mx.random.normal((C, K, 1))).astype(dtype),
        a=a,
        b=b,
        A_log=mx.log(mx.random.uniform(1.0, 16.0, (hv,))),
        dt_bias=mx.random.normal((hv,)).astype(dtype),
        z=z.reshape(B, T, hv, dv),
        norm_weight=mx.ones((dv,), dtype),
        state=0.1 * mx.random.normal((B, hv, dv, dk)),
    )
    mx.eval(proj, list(args.values()))
    heads = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, norm_eps=1e-6)
    dims = {k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
    z_view, b_view, a_view = projection_views(proj, packed=False, **dims)
    return args, heads, dict(args, z=z_view, b=b_view, a=a_view)


def _time(fn, *, warmup: int = 10, iters: int = 200) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters


def _chain(step, args: dict, heads: dict, layers: int) -> list[mx.array]:
    """`layers` steps, each from the previous one's state, as one graph (a decode step's shape)."""
    state, outs = args["state"], []
    for _ in range(layers):
        out, state = step(**dict(args, state=state), **heads)
        outs.append(out)
    return [*outs, state]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"mlx {mx.__version__} device {mx.default_device()} backend {backend()}")
    results = []
    for name, shape in SHAPES.items():
        dims = {k: shape[k] for k in ("hk", "hv", "dk", "dv")}
        for B in args.batch:
            for T in args.tokens:
                inputs, heads, viewed = make_inputs(B, T, **dims)
                fused = supports(
                    inputs["conv_in"],
                    inputs["conv_weight"],
                    inputs["state"],
                    **{k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")},
                ) and kernel_works(backend())
                kernel_us = _time(partial(gdn_step, **inputs, **heads), iters=args.iters) * 1e6
                views_us = _time(partial(gdn_step, **viewed, **heads), iters=args.iters) * 1e6
                ref_us = _time(partial(gdn_step_reference, **inputs, **heads), iters=args.iters) * 1e6
                layers = shape["layers"]
                chain_iters = max(5, args.iters // 10)
                kernel_chain = _time(partial(_chain, gdn_step, viewed, heads, layers), iters=chain_iters)
                ref_chain = _time(
                    partial(_chain, gdn_step_reference, inputs, heads, layers), iters=chain_iters
                )
                out, state = gdn_step(**viewed, **heads)
                ref_out, ref_state = gdn_step_reference(**inputs, **heads)
                row = dict(
                    shape=name,
                    batch=B,
                    tokens=T,
                    fused_kernel=fused,
                    kernel_us=round(kernel_us, 1),
                    kernel_views_us=round(views_us, 1),
                    reference_us=round(ref_us, 1),
                    speedup=round(ref_us / views_us, 2),
                    layers=layers,
                    kernel_chain_us_per_layer=round(kernel_chain * 1e6 / layers, 1),
                    reference_chain_us_per_layer=round(ref_chain * 1e6 / layers, 1),
                    max_abs_err_out=float(mx.abs(out.astype(mx.float32) - ref_out.astype(mx.float32)).max()),
                    max_abs_err_state=float(mx.abs(state - ref_state).max()),
                )
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
