"""Whether plain greedy decoding writes the same tokens every time: one prompt decoded `--repeats`
times through kapitsa's engine, under each kernel setting named in `--variants`, on a random-weight
4-bit model of a real shape.

Greedy decoding of one prompt on one engine should repeat itself token for token; a run that does
not points at a kernel whose result depends on scheduling (atomics, races, a library picking
another plan). Each variant is a set of `KAPITSA_*` settings (`KernelOptions.from_environ`), so a
family that repeats once switched off names the suspect. MLX's own settings (cuDNN attention:
`MLX_CUDA_USE_CUDNN_SDPA=0`) are read once per process: run the script again under them.

    python lab/repeat_decode.py --shape nemotron-30b-a3b --tokens 128 --repeats 3 \
        --variants default KAPITSA_KERNELS=none KAPITSA_COMPILE_DECODE=0 KAPITSA_QLINEAR=stock
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx

from kapitsa.engine.options import KernelOptions
from kapitsa.testing.tiny import tiny_config
from lab.engine_timing import emit, generate, kapitsa_engine
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, prompt_ids


def variant_options(variant: str) -> KernelOptions:
    """The options of a variant: `default`, or `NAME=value` settings joined by `+`."""
    settings = {} if variant == "default" else dict(part.split("=", 1) for part in variant.split("+"))
    return KernelOptions.from_environ({**os.environ, **settings})


def first_divergence(reference: list[int], ids: list[int]) -> int | None:
    """The first position where `ids` leaves `reference`, None when they are equal."""
    for position, (want, got) in enumerate(zip(reference, ids, strict=False)):
        if want != got:
            return position
    return None if len(reference) == len(ids) else min(len(reference), len(ids))


def repeat_variant(model, prompt: list[int], tokens: int, repeats: int, variant: str) -> list[int]:
    """Decode `prompt` `repeats` times on one engine; emit how each run compares with the first."""
    client = kapitsa_engine(model, len(prompt), tokens, kernels=variant_options(variant))
    try:
        runs = [generate(client, prompt, tokens) for _ in range(repeats)]
    finally:
        client.close()
    reference = runs[0]["ids"]
    divergences = [first_divergence(reference, run["ids"]) for run in runs[1:]]
    emit(
        dict(
            variant=variant,
            cudnn_sdpa=os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "default"),
            repeats=repeats,
            identical=all(d is None for d in divergences),
            first_divergence=divergences,
            decode_tok_s=[round(run["decode_tok_s"], 1) for run in runs],
        )
    )
    return reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="nemotron-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["default"], help="default or NAME=value[+NAME=value]")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke run on CPU")
    args = ap.parse_args()
    if args.tiny:
        DTYPE["value"] = mx.float32
        kind, dims = TINY[args.shape]
        config = tiny_config(kind, **dims)
    else:
        config = SHAPES[args.shape][1]
    mx.random.seed(0)
    model = kapitsa_model(config)
    prompt = prompt_ids(args.prompt, config["vocab_size"])
    references = {v: repeat_variant(model, prompt, args.tokens, args.repeats, v) for v in args.variants}
    default = references.get("default")
    if default is not None:
        emit(
            dict(
                summary="repeat_decode",
                shape=args.shape,
                same_as_default={v: first_divergence(default, ids) for v, ids in references.items()},
            )
        )


if __name__ == "__main__":
    main()
