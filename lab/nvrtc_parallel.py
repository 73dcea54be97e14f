"""Whether kapitsa's kernel compiles run side by side: N distinct Gated DeltaNet kernel sources
(MLX's wrapping, the stand-in header, CCCL), each a different token count, compiled one after
another in this process, then on N worker threads in this process, then on N worker threads that
each run the compile in a child process (nvrtc.IsolatedNvrtc, what kernels/cuda_disk_cache.py
uses). Needs only NVRTC and the CUDA headers, no GPU.

    python lab/nvrtc_parallel.py --count 8                  # on the GPU machine: MLX's own NVRTC
    CUDA_HOME=... python lab/nvrtc_parallel.py --library /path/libnvrtc.so.13 --count 8 --workers 2

Prints one JSON line: seconds for each way and each compile's own seconds. On the GPU machine
the NVRTC is the one MLX's CUDA backend loads (the first compile MLX runs loads it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import time

import mlx.core as mx

from kapitsa.engine.kernels import cuda_disk_cache, nvrtc
from kapitsa.engine.kernels.gdn import CUDA_KERNEL
from kapitsa.engine.kernels.gdn_plan import launch_config

# the config.h stand-in the tests use where the installed MLX ships no CUDA headers (the CPU wheel)
STUB = pathlib.Path(__file__).resolve().parent.parent / "tests" / "kernels" / "cuda_stub"


def source(tokens: int) -> tuple[str, str]:
    """(jit name, source) of the 4B's GDN kernel at `tokens` tokens with a state."""
    template, _, _ = launch_config(
        "cuda",
        act=mx.bfloat16,
        out_dtype=mx.bfloat16,
        sum_dtype=mx.bfloat16,
        beta_dtype=mx.bfloat16,
        batch=1,
        T=tokens,
        K=4,
        num_k_heads=16,
        num_v_heads=32,
        head_k_dim=128,
        head_v_dim=128,
        norm_eps=1e-6,
        has_state=True,
        has_mask=False,
    )
    dtypes = [mx.bfloat16] * 8 + [mx.float32, mx.bool_]
    text = CUDA_KERNEL.render(dtypes, [mx.bfloat16, mx.float32], template, [3, 2, 3, 3, 1, 1, 3, 1, 4, 1])
    return CUDA_KERNEL.jit_name(template), text


def library(given: str | None) -> str:
    if given:
        return given
    if mx.cuda.is_available():
        mx.eval(mx.exp(mx.ones((4,))) * 2)  # MLX's first JIT compile loads its NVRTC
    found = nvrtc.loaded_library("libnvrtc.so")
    if found is None:
        raise SystemExit("no NVRTC loaded here: pass --library")
    return found


def include_path(compiler: nvrtc.Nvrtc) -> list[pathlib.Path]:
    root = pathlib.Path(mx.__file__).parent
    dirs = cuda_disk_cache.include_dirs(root, compiler.version()[0])
    config = root / "include" / "mlx" / "backend" / "cuda" / "device" / "config.h"
    return dirs if config.exists() else [STUB, *dirs]


def timed(compile_one, programs: list[tuple[str, str]], workers: int) -> tuple[float, list[float]]:
    started = time.perf_counter()
    if workers == 1:
        each = [compile_one(p) for p in programs]
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            each = list(pool.map(compile_one, programs))
    return round(time.perf_counter() - started, 2), [round(s, 2) for s in each]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--library", help="libnvrtc to use (default: the one MLX loaded)")
    parser.add_argument("--count", type=int, default=8, help="distinct programs per way")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--arch", default=None, help="compute capability as 9.0 (default: this GPU's)")
    args = parser.parse_args()
    path = library(args.library)
    here = nvrtc.Nvrtc(path)
    capability = tuple(int(x) for x in args.arch.split(".")) if args.arch else nvrtc.compute_capability()
    options = cuda_disk_cache.compile_options(here, capability, include_path(here))
    headers = dict(cuda_disk_cache._HEADERS)
    isolated = nvrtc.IsolatedNvrtc(path)
    row: dict = {"library": path, "nvrtc": here.version(), "count": args.count, "workers": args.workers}
    for way, compiler, workers, first in (
        ("one_after_another", here, 1, 1),
        ("threads", here, args.workers, 1 + args.count),
        ("threads_with_child_processes", isolated, args.workers, 1 + 2 * args.count),
    ):
        programs = [source(tokens) for tokens in range(first, first + args.count)]  # new each way

        def compile_one(program: tuple[str, str], compiler=compiler) -> float:
            name, text = program
            started = time.perf_counter()
            compiler.compile(
                text,
                filename=f"{name}.cu",
                name_expressions=[f"mlx::core::cu::{name}"],
                options=options,
                headers=headers,
            )
            return time.perf_counter() - started

        row[f"{way}_s"], row[f"{way}_each_s"] = timed(compile_one, programs, workers)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
