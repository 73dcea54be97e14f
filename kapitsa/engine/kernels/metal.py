"""Metal kernels from the `.metal` sources in `metal/` (packaged as `kapitsa/_metal/`), launched
through `mx.fast.metal_kernel` on Apple GPUs.

A source file holds an optional header (helper functions), then a line `// ---- body ----`, then
the kernel body; MLX writes the `[[kernel]]` signature from the input/output names, as it does
for CUDA (see cuda.py).
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

BODY_MARKER = "// ---- body ----"
_PACKAGED = pathlib.Path(__file__).resolve().parents[2] / "_metal"  # kapitsa/_metal in a wheel
_SOURCE_TREE = pathlib.Path(__file__).resolve().parents[3] / "metal"  # metal/ in a checkout


def source_path(filename: str) -> pathlib.Path:
    for folder in (_PACKAGED, _SOURCE_TREE):
        if (folder / filename).is_file():
            return folder / filename
    raise FileNotFoundError(f"Metal source {filename} is in neither {_PACKAGED} nor {_SOURCE_TREE}")


@functools.cache
def read_source(filename: str) -> tuple[str, str]:
    """(header, body) of a `.metal` file."""
    text = source_path(filename).read_text()
    if BODY_MARKER not in text:
        raise ValueError(f"{filename} has no '{BODY_MARKER}' line")
    header, body = text.split(BODY_MARKER, 1)
    return header, body


@dataclass(frozen=True)
class MetalKernel:
    name: str
    filename: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def __call__(
        self,
        inputs: Sequence[mx.array],
        *,
        template: Sequence[tuple[str, int | bool | mx.Dtype]],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        init_value: float | None = None,
    ) -> list[mx.array]:
        return _compiled(self)(
            inputs=list(inputs),
            template=list(template),
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
            init_value=init_value,
        )


@functools.cache
def _compiled(kernel: MetalKernel):
    header, body = read_source(kernel.filename)
    return mx.fast.metal_kernel(
        name=kernel.name,
        input_names=list(kernel.input_names),
        output_names=list(kernel.output_names),
        source=body,
        header=header,
    )
