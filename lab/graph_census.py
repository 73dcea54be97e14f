"""Count the primitives of one decode step as the CUDA engine builds it, on a machine without a GPU.

On MLX's CUDA backend a decode step at batch 1 costs the host ~3-5 us per primitive of its graph
(lab/host_costs.py, lab/runs/decode-h200.md), views and reshapes included, so the count is a
host-time budget. This builds the bench's real-width model (fewer experts and a smaller vocabulary:
neither changes the graph), makes the kernel code paths believe they are on CUDA, and replaces
every custom kernel launch by one `Depends` node on its inputs (counted as CustomKernel), then
prints the step's primitive histogram. Nothing here runs a kernel; the numbers are graph sizes.

    python lab/graph_census.py --shapes 4b nemotron-30b-a3b [--env KAPITSA_FUSED_NORMS=norm,residual]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import mlx.core as mx

from kapitsa.engine import kernels
from kapitsa.engine.kernels import attention, attn_prep, gdn, mamba, router
from kapitsa.engine.kernels import cuda as cuda_mod
from kapitsa.engine.ops import gated_delta
from kapitsa.engine.ops import linear as qlinear
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.testing.tiny import tiny_config
from lab.host_costs import primitive_histogram
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model

SMALLER = {"num_experts": 8, "n_routed_experts": 8, "vocab_size": 4096}


@functools.cache
def _zeros(shape: tuple, dtype) -> mx.array:
    z = mx.zeros(shape, dtype=dtype)
    mx.eval(z)
    return z


def _placeholder_launch(self, inputs, *, output_shapes, output_dtypes, **_):  # noqa: ANN001
    outs = [_zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
    return mx.depends(outs, list(inputs))


def pretend_cuda() -> None:
    kernels.backend.cache_clear()
    kernels.backend = lambda: "cuda"
    for module in list(sys.modules.values()):
        found = (
            getattr(module, "backend", None)
            if getattr(module, "__name__", "").startswith("kapitsa.")
            else None
        )
        if callable(found) and found.__module__ == "kapitsa.engine.kernels":
            module.backend = kernels.backend
    cuda_mod.CudaKernel.__call__ = _placeholder_launch
    gdn.kernel_works = lambda kind: True
    gdn.decode_kernel_works = lambda kind: True
    gated_delta.fast_kernel_works = lambda: True
    qlinear.probe_kernels = lambda options: {name: True for name in qlinear.PROBES}
    qlinear.WORKING.update({name: True for name in qlinear.PROBES})
    router.WORKING["router"] = True
    attention.WORKING["attn"] = True
    attn_prep.probe = lambda *a, **k: True
    attn_prep.usable = attn_prep.supports
    mamba.WORKING["cuda"] = True


def census(shape: str, tiny: bool = False, kernels: KernelOptions = KernelOptions()) -> dict:  # noqa: B008
    kind, dims = (TINY if tiny else SHAPES)[shape]
    config = tiny_config(kind, **{**dims, **{k: v for k, v in SMALLER.items() if k in dims}})
    model = kapitsa_model(config)
    runner = ModelRunner(model, kernels=kernels)
    cache = model.make_cache(1)
    runner.prefill(cache, [5, 6, 7, 8])
    # a step in the steady state: the first one after a prefill also makes the KV tails' buffers
    mx.eval(runner.decode_lazy(cache, mx.array([9], dtype=mx.int32)), *cache.state_arrays())
    hist = primitive_histogram(mx.argmax(runner.decode_lazy(cache, mx.array([10], dtype=mx.int32)), axis=-1))
    launches = hist.pop("Depends", 0)
    hist["CustomKernel"] += launches
    return dict(shape=shape, primitives=sum(hist.values()), histogram=dict(hist.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4b"])
    ap.add_argument("--env", nargs="*", default=[], help="KAPITSA_NAME=VALUE kernel options (KernelOptions)")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a smoke run)")
    args = ap.parse_args()
    kernels = KernelOptions.from_environ(dict(setting.partition("=")[::2] for setting in args.env))
    pretend_cuda()
    if args.tiny:
        DTYPE["value"] = mx.float32
    for shape in args.shapes:
        print(json.dumps(census(shape, args.tiny, kernels)), flush=True)


if __name__ == "__main__":
    main()
