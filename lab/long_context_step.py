"""Where a decode step's extra time after a long prompt goes: kapitsa's step (fused, compiled,
routed, as the engine runs it) split into build / encode / wait (lab/decode_profile.py) after a
short and a long prompt, with the attention kernels (family "attn": the q/k/v prep and the decode
attention kernel) on and off.

The wait grows where the device's work grows (the attention over more keys, a KV write that copies
the whole buffer); build and encode grow where the host's does. Each (prompt, variant) is timed
in rounds that alternate the variants (a variant's traces are dropped when the other takes over:
a trace keeps the kernel choices it was made with), the first round compiling what it meets.

    python lab/long_context_step.py --shape 4b --prompts 512 8192 --steps 32
    python lab/long_context_step.py --tiny --shape 4b --prompts 64 256 --steps 8   # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import mlx.core as mx

from kapitsa.engine.kernels import DEFAULT_FAMILIES, backend
from kapitsa.engine.loading.fuse import fuse_model
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.ops.linear import route_quantized_linears
from kapitsa.engine.traces import drop_traces
from kapitsa.testing.tiny import tiny_config
from lab.decode_profile import _kapitsa_step, _profile
from lab.engine_timing import DEFAULTS
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, prompt_ids


def variants() -> dict[str, object]:
    """The engine's kernel options, and the same without the attention family."""
    families = DEFAULTS.families if DEFAULTS.families is not None else DEFAULT_FAMILIES[backend()]
    return {"kernels": DEFAULTS, "no attn": dataclasses.replace(DEFAULTS, families=families - {"attn"})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4b")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    table = TINY if args.tiny else SHAPES
    if args.tiny:
        DTYPE["value"] = mx.float32
    kind, dims = table[args.shape]
    model = kapitsa_model(tiny_config(kind, **dims))
    fuse_model(model)
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    route_quantized_linears(model, DEFAULTS)
    for rnd in range(args.rounds):
        for name, options in variants().items():
            drop_traces(model)
            use_kernel_options(model, options)
            for length in args.prompts:
                row = _profile(
                    *_kapitsa_step(model), prompt_ids(length, dims.get("vocab_size", 512)), args.steps
                )
                print(
                    json.dumps(dict(shape=args.shape, variant=name, prompt=length, round=rnd, **row)),
                    flush=True,
                )


if __name__ == "__main__":
    main()
