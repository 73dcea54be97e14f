"""What a process pays before its first answer: the engine's idle warm-up (every decode batch size
serve readies on a GPU) and the first request, with MLX's PTX cache cold or warm.

    MLX_PTX_CACHE_DIR=/tmp/fresh python lab/startup_compile.py --shapes 4b                 # fills it
    MLX_PTX_CACHE_DIR=/tmp/fresh python lab/startup_compile.py --shapes 4b                 # reads it
    MLX_PTX_CACHE_DIR=/tmp/other python lab/startup_compile.py --shapes 4b --no-disk-cache # MLX alone
    python lab/startup_compile.py --tiny --shapes 4b                                       # any machine

One row per shape: the seconds to build the random-weight model, the warm-up's seconds, the first
request's time to first token and total (a 512-token prompt, 32 tokens), the custom-kernel modules
found in and added to the cache folder. `--no-disk-cache` leaves every custom kernel to MLX's
in-process compile (kernels/cuda_disk_cache.py off): the cost before the cache existed.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import mlx.core as mx

from kapitsa.engine.kernels import cuda_disk_cache
from lab.batch_sweep import engine, wait_warm
from lab.engine_timing import emit, stream
from lab.models_under_test import DTYPE, SHAPES, TINY, kapitsa_model, prompt_ids


def _custom_modules(folder: Path) -> int:
    return sum(1 for _ in folder.rglob("custom_kernel_*.ptx")) if folder.is_dir() else 0


def measure(shape: str, dims_of: dict, prompt_len: int, tokens: int, streams: int) -> dict:
    from kapitsa.testing.tiny import tiny_config

    kind, dims = dims_of[shape]
    config = tiny_config(kind, **dims)
    start = time.perf_counter()
    model = kapitsa_model(config)
    built = time.perf_counter() - start
    client = engine(model, prompt_len, tokens, streams, warm=True)
    try:  # closed before the next shape and before exit: a live engine thread at exit aborts
        warmup = wait_warm(client)
        vocab = (config.get("text_config") or config)["vocab_size"]
        request_start = time.perf_counter()
        _, first, end, _ = asyncio.run(stream(client, prompt_ids(prompt_len, vocab), tokens))
    finally:
        client.close()
    return dict(
        build_s=round(built, 2),
        warmup_s=round(warmup, 2),
        first_ttft_s=round(first - request_start, 4),
        first_request_s=round(end - request_start, 4),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="4b")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=16, help="the largest batch size the warm-up readies")
    parser.add_argument(
        "--no-disk-cache", action="store_true", help="every custom kernel compiled by MLX itself"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny widths (any machine)")
    args = parser.parse_args()
    if args.tiny:
        DTYPE["value"] = mx.float32
    if args.no_disk_cache:
        cuda_disk_cache.default_cache = lambda: None
    folder = cuda_disk_cache.mlx_cache_dir()
    for shape in args.shapes.split(","):
        before = _custom_modules(folder)
        row = measure(shape, TINY if args.tiny else SHAPES, args.prompt, args.tokens, args.streams)
        cuda_disk_cache.drain()  # modules still compiling on its worker threads
        after = _custom_modules(folder)
        disk = "off" if args.no_disk_cache else "on"
        emit(dict(shape=shape, disk_cache=disk, **row, custom_modules_before=before, added=after - before))
        mx.clear_cache()


if __name__ == "__main__":
    main()
