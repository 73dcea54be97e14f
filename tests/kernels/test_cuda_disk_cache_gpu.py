"""On the GPU: MLX compiles exactly the source `CudaKernel.render` predicts, reads a custom kernel's
module from the path the disk cache writes, and a second process runs the cached cubins (no NVRTC
compile) with the same outputs as MLX's own compile. Each case runs in a fresh process with its own
MLX_PTX_CACHE_DIR (MLX reads that variable once per process)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]

ATTENTION = """
import json, time, sys
import mlx.core as mx
from kapitsa.engine.kernels import attention, cuda_disk_cache
if sys.argv[1] == "off":
    cuda_disk_cache.default_cache = lambda: None  # MLX's own in-process compile
keys = mx.random.split(mx.random.key(0), 4)
q = mx.random.normal((2, 16, 1, 256), key=keys[0]).astype(mx.bfloat16)
k = mx.random.normal((2, 4, 700, 256), key=keys[1]).astype(mx.bfloat16)
v = mx.random.normal((2, 4, 700, 256), key=keys[2]).astype(mx.bfloat16)
gate = mx.random.normal((2, 1, 16 * 256), key=keys[3]).astype(mx.bfloat16)
mx.eval(q, k, v, gate)
start = time.perf_counter()
outs = [attention.decode_attention(q, k, v, n, scale=0.0625, gate=g, splits=s)
        for n, g, s in ((700, gate, None), (33, None, 1), (512, gate, 64))]
mx.eval(outs)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "out": [o.astype(mx.float32).reshape(-1)[::97].tolist() for o in outs]}))
"""


def _run(code: str, cache: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "MLX_PTX_CACHE_DIR": str(cache),
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _custom_modules(cache: pathlib.Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("custom_kernel_*.ptx"))


def test_render_is_what_mlx_compiles(tmp_path: pathlib.Path) -> None:
    """MLX's verbose output against `render` for kernels with and without a header, with int, bool
    and dtype template values, a shape parameter and a rank-0 input: nothing runs, MLX prints the
    source while it builds the graph."""
    code = """
    import mlx.core as mx
    from kapitsa.engine.kernels import attention, cuda, matvec_tensor_core as tc
    partial, combine = attention._templates(mx.bfloat16, 256, 4, 8, 0.0625, True)
    cases = [
        (attention._PARTIAL, [mx.bfloat16, mx.bfloat16, mx.bfloat16, mx.int32], [4, 4, 4, 1],
         [mx.float32, mx.float32], partial),
        (attention._COMBINE, [mx.float32, mx.float32, mx.bfloat16], [3, 3, 0], [mx.bfloat16], combine),
        (tc._KERNEL, [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [2, 2, 2, 2], [mx.bfloat16],
         tc.launch_config(8, 5120, 6144, 64, 2, True)[0]),
    ]
    for kernel, dtypes, ndims, out_dtypes, template in cases:
        inputs = [mx.zeros((2,) * n, dtype=d) for d, n in zip(dtypes, ndims)]
        cuda._compiled(kernel, 0)(inputs=inputs, template=list(template), grid=(32, 1, 1),
                                  threadgroup=(32, 1, 1), output_shapes=[(4,)] * len(out_dtypes),
                                  output_dtypes=out_dtypes, verbose=True)
        print("@@RENDER@@" + kernel.render(dtypes, out_dtypes, template, ndims) + "@@END@@", flush=True)
    """
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chunks = proc.stdout.split("@@END@@")[:-1]
    assert len(chunks) == 3, proc.stdout[-2000:]
    for chunk in chunks:
        printed, predicted = chunk.split("@@RENDER@@")
        generated = printed.split("```\n", 1)[1].rsplit("\n```", 1)[0]
        assert generated == predicted


def test_mlx_reads_the_module_the_cache_names(tmp_path: pathlib.Path) -> None:
    """A garbage module at the predicted path (tagged as built here, so the cache keeps it) makes
    MLX's loader fail: MLX looked exactly there."""
    code = """
    import mlx.core as mx
    from kapitsa.engine.kernels import cuda_disk_cache
    from kapitsa.engine.kernels.cuda import CudaKernel
    kernel = CudaKernel("disk_probe", ("x",), ("y",), "y[0] = x[0] + N;")
    x = mx.ones((4,))
    source = kernel.render([mx.float32], [mx.float32], [("N", 5)], [1])
    path = cuda_disk_cache.module_path(cuda_disk_cache.mlx_cache_dir(),
                                       cuda_disk_cache.module_name(kernel.jit_name([("N", 5)]), source))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".txt").write_text(f"mlx::core::cu::{kernel.jit_name([('N', 5)])}\\tnot_a_symbol\\n")
    path.write_bytes(b"not a cubin")
    path.with_suffix(".kapitsa").write_text(cuda_disk_cache.default_cache()._sidecar(b"not a cubin"))  # as if built here
    y = kernel([x], template=[("N", 5)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
    try:
        mx.eval(y)
        print("LOADED", y.item(), flush=True)
    except RuntimeError as error:
        print("REFUSED", error, flush=True)
    """
    proc = _run(code, tmp_path)
    assert "REFUSED" in proc.stdout and "disk_probe" in proc.stdout, proc.stdout[-2000:]


def test_a_second_process_runs_the_cached_modules(tmp_path: pathlib.Path) -> None:
    off = _run(ATTENTION, tmp_path / "off", "off")
    assert off.returncode == 0, off.stderr[-3000:]
    assert _custom_modules(tmp_path / "off") == []  # MLX itself never writes custom kernels
    first = _run(ATTENTION, tmp_path / "on", "on")
    assert first.returncode == 0, first.stderr[-3000:]
    modules = _custom_modules(tmp_path / "on")
    assert len(modules) == 3  # the partial kernel; the combine kernel gated and not
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "on").rglob("custom_kernel_*")}
    second = _run(ATTENTION, tmp_path / "on", "on")
    assert second.returncode == 0, second.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "on").rglob("custom_kernel_*")} == stamps
    results = [json.loads(p.stdout.strip().splitlines()[-1]) for p in (off, first, second)]
    assert results[0]["out"] == results[1]["out"] == results[2]["out"]
    print(
        "seconds, MLX's compile / this cache's compile / loaded:", [round(r["seconds"], 2) for r in results]
    )
    assert results[2]["seconds"] < results[0]["seconds"] / 2
