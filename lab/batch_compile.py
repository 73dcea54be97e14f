"""What each new decode batch size costs the first time it runs, and which kernels it compiles.

    python lab/batch_compile.py --shapes 4b --sizes 1,2,3,4,6,8,16      # the H200 (lab/h200_all.sh compile)
    python lab/batch_compile.py --tiny --sizes 1,2,3 --tokens 4            # any machine

One engine per shape (kapitsa's defaults, no prefix cache). For each size N in increasing order a
burst of N streams runs twice: the first burst meets batch size N for the first time (the sizes
below it ran before), the second is warm. Each row: both bursts' wall times, their difference,
and the modules MLX's CUDA backend JIT-compiled during the first burst (new files in its PTX
cache, `$MLX_PTX_CACHE_DIR`: one `<module>.ptx` per module; the module names say which kernel
and template). Run twice over the same cache directory: the second process shows what the disk
cache leaves of the stall (traces, graph plans, module loads).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
from pathlib import Path

import mlx.core as mx

from lab.batch_sweep import burst, engine
from lab.engine_timing import emit
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, prompt_ids


def _modules(folder: Path | None) -> set[str]:
    if folder is None or not folder.is_dir():
        return set()
    return {p.stem for p in folder.glob("*.ptx")}


def _kind(module: str) -> str:
    """A module's kernel family: its name without template arguments and hashes."""
    return re.sub(r"(_[0-9a-f]{8,}|_?\d+)+$", "", re.split(r"[<(]", module, maxsplit=1)[0])[:60]


def sizes_run(
    shape: str, dims_of: dict, sizes: list[int], tokens: int, prompt_len: int, ptx: Path | None
) -> None:
    from kapitsa.testing.tiny import tiny_config

    kind, dims = dims_of[shape]
    config = tiny_config(kind, **dims)
    vocab = (config.get("text_config") or config)["vocab_size"]
    prompts = [prompt_ids(prompt_len, vocab, stride=7919 + 2 * i) for i in range(max(sizes))]
    client = engine(kapitsa_model(config), prompt_len, tokens, max(sizes))
    try:
        before = _modules(ptx)
        first = burst(client, prompts[:1], 4)  # prefill and one stream's decode
        emit(
            dict(
                shape=shape,
                phase="first-request",
                wall_s=first["wall_s"],
                modules=len(_modules(ptx) - before),
            )
        )
        for n in sizes:
            before = _modules(ptx)
            cold = burst(client, prompts[:n], tokens)
            new = sorted(_modules(ptx) - before)
            warm = burst(client, prompts[:n], tokens)
            kinds = collections.Counter(_kind(m) for m in new)
            emit(
                dict(
                    shape=shape,
                    streams=n,
                    cold_s=cold["wall_s"],
                    warm_s=warm["wall_s"],
                    first_burst_extra_s=round(cold["wall_s"] - warm["wall_s"], 3),
                    new_modules=len(new),
                    kinds=dict(kinds.most_common(12)),
                    aggregate_tok_s=warm["aggregate_tok_s"],
                )
            )
    finally:
        client.close()
    mx.clear_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="4b")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,16")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="small widths, float32 (any machine)")
    args = parser.parse_args()
    if args.tiny:
        DTYPE["value"] = mx.float32
    folder = os.environ.get("MLX_PTX_CACHE_DIR")
    ptx = Path(folder) if folder else None
    emit(dict(phase="start", ptx_dir=folder, modules_cached=len(_modules(ptx))))
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    for shape in args.shapes.split(","):
        sizes_run(shape, TINY if args.tiny else SHAPES, sizes, args.tokens, args.prompt, ptx)


if __name__ == "__main__":
    main()
