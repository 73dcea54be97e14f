"""Where a long prefill's time goes, per layer kind, kapitsa beside mlx-lm (JSON lines).

A shape's model is rebuilt with one kind of layer repeated (for Nemotron-H: eight Mamba-2
mixers, eight MoE blocks or eight attention blocks after one Mamba and one attention layer, at the
real widths; a small vocabulary so the head
costs little). The repeated layers come first: a layer after the last one holding a cache is needed
only for the last token's logits, and mlx-lm's prefill (which evaluates only the caches until the
last token) skips it, so after the base layers mlx-lm's MoE blocks would look free.
Each engine prefills the same prompt through its own path (kapitsa's engine,
mlx-lm's generate_step) after a warm-up prefill of the same length. The per-layer cost is the
difference against the model with one layer of that kind, divided by the layers added.

`--ssd-chunks 64 256` also times kapitsa's Mamba layers at each chunk length of its chunked scan
(KernelOptions.ssd_chunk); `--moe-dequant-ab` its MoE layers with the dequantize + grouped GEMM
route off (KernelOptions.moe_dequant).

Run on the H200: python lab/prefill_parts.py [--shape nemotron-30b-a3b] [--prompt 8192]
CPU smoke run: python lab/prefill_parts.py --tiny --prompt 64
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json

import mlx.core as mx

from kapitsa.testing.tiny import tiny_config
from lab.engine_timing import DEFAULTS, time_kapitsa, time_mlxlm
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, mlxlm_model, prompt_ids

KINDS = {"nemotron_h": {"mamba": "M", "moe": "E", "attention": "*"}}
BASE = {"nemotron_h": "M*"}  # mlx-lm's Nemotron-H needs a Mamba and an attention layer to build its masks
LAYERS = 8
VOCAB = 8192


def _prefill_s(
    kind: str, dims: dict, pattern: str, plen: int, engines=("mlx-lm", "kapitsa"), kernels=DEFAULTS
) -> dict:
    """Seconds per prefill of `plen` tokens, per engine, for a model of `pattern` layers; kapitsa's
    engine runs under `kernels`."""
    dims = dict(dims, num_hidden_layers=len(pattern), hybrid_override_pattern=pattern, vocab_size=VOCAB)
    config = tiny_config(kind, **dims)
    prompt, warmup = prompt_ids(plen, VOCAB), prompt_ids(plen, VOCAB, stride=104729)
    out = {}
    for engine, build, timer in (
        ("mlx-lm", mlxlm_model, time_mlxlm),
        ("kapitsa", kapitsa_model, functools.partial(time_kapitsa, kernels=kernels)),
    ):
        if engine not in engines:
            continue
        model = build(config)
        result = timer(model, prompt, 2, warmup)
        out[engine] = plen / result["prefill_tok_s"]
        del model
        gc.collect()
        mx.clear_cache()
    return out


def _variants(layer: str, args) -> list[tuple[str, object]]:
    """(KernelOptions field, value) pairs to time this layer kind under, beside the defaults."""
    if layer == "mamba":
        return [("ssd_chunk", chunk) for chunk in args.ssd_chunks]
    if layer == "moe" and args.moe_dequant_ab:
        return [("moe_dequant", False)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="nemotron-30b-a3b")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--kinds", nargs="*", default=None)
    ap.add_argument("--ssd-chunks", type=int, nargs="*", default=[])
    ap.add_argument("--moe-dequant-ab", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        DTYPE["value"] = mx.float32
    kind, dims = (TINY if args.tiny else SHAPES)[args.shape]
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    for name, letter in KINDS[kind].items():
        if args.kinds and name not in args.kinds:
            continue
        one = _prefill_s(kind, dims, letter + BASE[kind], args.prompt)
        many = _prefill_s(kind, dims, letter * LAYERS + BASE[kind], args.prompt)
        row = dict(kind="prefill_part", shape=args.shape, layer=name, prompt=args.prompt)
        for engine in one:
            per_layer_ms = (many[engine] - one[engine]) / (LAYERS - 1) * 1e3
            row[f"{engine}_ms_per_layer"] = round(per_layer_ms, 2)
            row[f"{engine}_total_s"] = round(many[engine], 3)
        row["kapitsa_over_mlxlm"] = round(row["kapitsa_ms_per_layer"] / row["mlx-lm_ms_per_layer"], 3)
        row.update(ssd_chunk=DEFAULTS.ssd_chunk, moe_dequant=DEFAULTS.moe_dequant)
        print(json.dumps(row), flush=True)
        for label, value in _variants(name, args):
            kernels = dataclasses.replace(DEFAULTS, **{label: value})
            pair = [
                _prefill_s(kind, dims, letter * n + BASE[kind], args.prompt, ("kapitsa",), kernels)
                for n in (1, LAYERS)
            ]
            per_layer_ms = (pair[1]["kapitsa"] - pair[0]["kapitsa"]) / (LAYERS - 1) * 1e3
            variant = dict(kind="prefill_part", shape=args.shape, layer=name, prompt=args.prompt)
            variant.update({label: value, "kapitsa_ms_per_layer": round(per_layer_ms, 2)})
            print(json.dumps(variant), flush=True)


if __name__ == "__main__":
    main()
