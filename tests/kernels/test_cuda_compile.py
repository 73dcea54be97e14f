"""Every CUDA kernel body compiles with nvcc for sm_90, wrapped exactly as MLX wraps it.

Runs wherever nvcc is installed (no GPU needed); the numerical comparisons against the references
are the `gpu`-marked tests, run on the H200.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from nvcc_check import compile_source, nvcc

from kapitsa.engine.kernels import qmv as qmv_mod

pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")


def _check(source: str) -> None:
    ok, log = compile_source(source)
    assert ok, log[-4000:]


@pytest.mark.parametrize("mode,bits", [(0, 4), (0, 3), (1, 4), (2, 4)])
def test_qmv_compiles(mode: int, bits: int) -> None:
    x = mx.zeros((2, 256), mx.bfloat16)
    gs = 16 if mode == 2 else 32
    template, _ = qmv_mod.launch_template(x, 64, group_size=gs, bits=bits, mode_id=mode)
    kernel = qmv_mod._kernel(mode)
    _check(
        kernel.render(
            [mx.bfloat16, mx.uint32, mx.bfloat16 if mode == 0 else mx.uint8, mx.bfloat16],
            [mx.bfloat16],
            template,
        )
    )


def test_broken_source_is_caught() -> None:
    """Negative control: the harness does fail on a kernel that cannot compile."""
    kernel = qmv_mod.CudaKernel("broken", ("x",), ("y",), "y[0] = undefined_symbol;")
    ok, _ = compile_source(kernel.render([mx.float32], [mx.float32], []))
    assert not ok
