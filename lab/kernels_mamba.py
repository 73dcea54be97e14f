"""Time kapitsa's fused Mamba-2 step against its reference and the model's current op path.

Run on a CUDA (or Metal) machine: python lab/kernels_mamba.py [--tokens 1 8] [--batch 1] [--layers 23]
Each path starts from what Mamba2Mixer has after in_proj (one [B, T, inner + conv_dim + H] tensor
split into gate / xbc / dt, plus the conv rows and the state), so the copies a path needs for
non-contiguous slices are counted. Prints JSON lines, microseconds per call:
  kernel_us / kernel_compiled_us / reference_us / model_us / model_compiled_us: one call, evaluated alone (host sync
    included, as a lone op would see it);
  *_chain_us: per layer, for --layers independent layers evaluated as one graph (how a forward
    sees it; launch overhead amortised).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.kernels import backend
from kapitsa.engine.kernels.mamba import mamba_step, mamba_step_reference, supports
from kapitsa.engine.ops.conv import causal_conv
from kapitsa.engine.ops.norm import GroupGatedRMSNorm
from kapitsa.engine.ops.ssm import ssm_dt, ssm_scan

# (heads, head_dim, groups, state_size, conv kernel, Mamba layers in the model)
SHAPES = {
    "nemotron-3-nano-30b": (64, 64, 8, 128, 4, 23),
    "nemotron-h-4b (dory)": (112, 64, 8, 128, 4, 24),
}


def model_path(conv_in, conv_weight, conv_bias, dt, dt_bias, A_log, D, gate, norm_weight, state, **dims):
    """Mamba2Mixer.__call__ today (chain forward), from conv to norm."""
    H, P, G, N = dims["heads"], dims["head_dim"], dims["groups"], dims["state_size"]
    B, T = dt.shape[:2]
    conv_out = causal_conv(conv_in, conv_weight, conv_bias)
    xs, Bm, Cm = mx.split(nn.silu(conv_out), [H * P, H * P + G * N], axis=-1)
    step = ssm_dt(dt, dt_bias, dims["time_step_limit"], dims.get("mask"))
    y, state = ssm_scan(
        xs.reshape(B, T, H, P), step, A_log, Bm.reshape(B, T, G, N), Cm.reshape(B, T, G, N), D, state
    )
    norm = GroupGatedRMSNorm(H * P, dims["norm_eps"], H * P // G)
    norm.weight = norm_weight
    return norm(y.reshape(B, T, H * P), gate), state


def make_layer(B: int, T: int, shape, dtype=mx.bfloat16) -> dict:
    H, P, G, N, K, _ = shape
    inner, conv_dim = H * P, H * P + 2 * G * N
    layer = dict(
        proj=mx.random.normal((B, T, inner + conv_dim + H)).astype(dtype),
        conv_state=mx.random.normal((B, K - 1, conv_dim)).astype(dtype),
        conv_weight=(0.5 * mx.random.normal((conv_dim, K, 1))).astype(dtype),
        conv_bias=(0.1 * mx.random.normal((conv_dim,))).astype(dtype),
        dt_bias=mx.random.uniform(-2.0, 0.0, (H,)).astype(dtype),
        A_log=mx.log(mx.random.uniform(1.0, 8.0, (H,))).astype(dtype),
        D=mx.ones((H,), dtype),
        norm_weight=mx.ones((inner,), dtype),
        state=mx.random.normal((B, H, P, N)) * 0.1,
    )
    mx.eval(layer)
    return layer


def run_layer(path, layer: dict, dims: dict):
    inner, conv_dim = dims["heads"] * dims["head_dim"], layer["conv_weight"].shape[0]
    gate, xbc, dt = mx.split(layer["proj"], [inner, inner + conv_dim], axis=-1)
    conv_in = mx.concatenate([layer["conv_state"], xbc], axis=1)
    return path(
        conv_in, layer["conv_weight"], layer["conv_bias"], dt, layer["dt_bias"], layer["A_log"],
        layer["D"], gate, layer["norm_weight"], layer["state"], **dims,
    )  # fmt: skip


def run_chain(path, layers: list[dict], dims: dict):
    return [run_layer(path, layer, dims) for layer in layers]


def per_call_us(fn, iters: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters * 1e6


def bench_case(name: str, shape, B: int, T: int, args) -> dict:
    H, P, G, N, K, n_layers = shape
    layers_n = args.layers or n_layers
    dims = dict(
        heads=H, head_dim=P, groups=G, state_size=N, time_step_limit=(0.0, float("inf")), norm_eps=1e-5
    )
    layers = [make_layer(B, T, shape) for _ in range(layers_n)]
    model_compiled, kernel_compiled = mx.compile(model_path), mx.compile(mamba_step)
    paths = {
        "kernel": mamba_step,
        "kernel_compiled": lambda *a, **d: kernel_compiled(*a, **d),  # as inside a compiled decode step
        "reference": mamba_step_reference,
        "model": model_path,
        "model_compiled": lambda *a, **d: model_compiled(*a, **d),
    }
    row = dict(shape=name, batch=B, tokens=T, layers=layers_n, backend=backend())
    conv_in = mx.zeros((B, K - 1 + T, 1), mx.bfloat16)
    row["kernel_runs"] = supports(conv_in, layers[0]["conv_weight"], head_dim=P, state_size=N)
    for label, path in paths.items():
        row[f"{label}_us"] = per_call_us(partial(run_layer, path, layers[0], dims), args.iters)
        row[f"{label}_chain_us"] = (
            per_call_us(partial(run_chain, path, layers, dims), max(args.iters // 10, 5)) / layers_n
        )
    got, ref = run_layer(mamba_step, layers[0], dims), run_layer(mamba_step_reference, layers[0], dims)
    row["max_abs_err_out"] = float(mx.abs(got[0].astype(mx.float32) - ref[0].astype(mx.float32)).max())
    row["max_abs_err_state"] = float(mx.abs(got[1] - ref[1]).max())
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--layers", type=int, default=0, help="layers in the chain (default: the model's)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(json.dumps(dict(mlx=mx.__version__, device=str(mx.default_device()), backend=backend())))
    results = []
    for name, shape in SHAPES.items():
        for B in args.batch:
            for T in args.tokens:
                row = bench_case(name, shape, B, T, args)
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
