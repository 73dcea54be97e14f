"""One way to declare and launch a CUDA kernel through `mx.fast.cuda_kernel`, and to render the
exact source MLX will JIT-compile for it (so `nvcc` can check it on a machine without a GPU).

MLX wraps a kernel body into `__global__ void name(const T0* in0, ..., T* out0, ...)` followed by
`constexpr int NAME = value;` / `using NAME = type;` lines for the template arguments
(mlx/backend/cuda/custom_kernel.cpp, `build_kernel`). `render` reproduces that wrapping. A body
that names `<input>_shape` (`<input>_ndim`) gets that input's shape (rank) as a kernel parameter
after its pointer: how a kernel reads a size at run time that would otherwise be a template argument.
Each distinct template compiles once per process (NVRTC, about a second each on the H200), so a
size that changes with the decode batch (rows, tokens) is read from a shape, not templated.

Kernel bodies and headers live in `cuda_src/` beside this module (`name.cu` a body, `name.cuh`
the helpers it needs), read with `read_cuda_source`. A file's text goes to MLX with its comments,
indentation and blank lines removed (`compact_source`; modules may substitute a placeholder line,
e.g. moe_launch.py's WEIGHT_POINTERS), and `render` shows exactly that.

Why compact: MLX hashes a custom kernel's whole source string at every launch to find its
compiled module (mlx/backend/cuda/custom_kernel.cpp, `CustomKernel::eval_gpu`). On the H200 a
launch cost the host ~3.4 us with a short source and ~7.5 us with 16 KB more (4 KB more was
within noise; lab/host_costs.py), and a decode step launches 150+ of these kernels.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.engine.kernels import backend, cuda_disk_cache

TemplateValue = int | bool | mx.Dtype
SOURCE_DIR = pathlib.Path(__file__).parent / "cuda_src"  # inside the package: the wheel carries it

_CUDA_TYPES = {
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "mlx::core::cu::complex64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.bool_: "bool",
}


# mlx/backend/common/compiled.cpp, `get_type_string`: how a dtype template argument names a kernel
_MLX_TYPE_NAMES = {
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}


def cuda_type(dtype: mx.Dtype) -> str:
    return _CUDA_TYPES[dtype]


def template_constants(template: Sequence[tuple[str, TemplateValue]], type_name=cuda_type) -> list[str]:
    """A kernel's template arguments as the constants MLX's instantiation binds them to: bools and
    ints as `constexpr`, dtypes as type aliases (`type_name` spells a dtype for the target)."""
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"constexpr int {name} = {value};")
        else:
            lines.append(f"using {name} = {type_name(value)};")
    return lines


def compact_source(text: str) -> str:
    """The same CUDA text without `//` comments, indentation and blank lines; line breaks stay
    (preprocessor lines end at them). A `//` inside a string literal (inline asm) is kept."""
    lines = []
    for line in text.splitlines():
        cut = _comment_start(line)
        code = (line if cut < 0 else line[:cut]).strip()
        if code:
            lines.append(code)
    return "\n".join(lines) + ("\n" if lines else "")


def _comment_start(line: str) -> int:
    """Index of the `//` that starts a comment in `line`, or -1 (quotes tracked, escapes skipped)."""
    quoted, i = False, 0
    while i < len(line) - 1:
        ch = line[i]
        if ch == "\\" and quoted:
            i += 2
            continue
        if ch == '"':
            quoted = not quoted
        elif not quoted and line.startswith("//", i):
            return i
        i += 1
    return -1


@functools.cache
def read_cuda_source(filename: str) -> str:
    """The text of `cuda_src/<filename>`, read once per process and byte for byte (no newline
    translation: the text is part of what MLX compiles and caches)."""
    with open(SOURCE_DIR / filename, encoding="utf-8", newline="") as f:
        return f.read()


@dataclass(frozen=True)
class CudaKernel:
    """A kernel body plus its signature. `source` is the body only (MLX writes the signature)."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""

    def __call__(
        self,
        inputs: Sequence[mx.array],
        *,
        template: Sequence[tuple[str, TemplateValue]],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        shared_memory: int = 0,
        init_value: float | None = None,
    ) -> list[mx.array]:
        kernel = _compiled(self, shared_memory)
        if backend() == "cuda":
            self._prepare_module(inputs, template, output_dtypes)
        return kernel(
            inputs=list(inputs),
            template=list(template),
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
            init_value=init_value,
        )

    def _prepare_module(self, inputs, template, output_dtypes) -> None:
        """The first launch of each instantiation in this process puts its compiled module where
        MLX's JIT will find it (cuda_disk_cache.py); later launches cost one set lookup (~2 us of
        host time, paid only by launches outside compiled traces). Inputs MLX takes that this
        cannot render (Python scalars) leave the compile to MLX."""
        try:
            key = (self, tuple(template), tuple((x.dtype, x.ndim > 0) for x in inputs), tuple(output_dtypes))
            if key in _PREPARED:
                return
            _PREPARED.add(key)
            source = self.render([x.dtype for x in inputs], output_dtypes, template, [x.ndim for x in inputs])
        except (AttributeError, KeyError):
            return
        cuda_disk_cache.prepare(self.jit_name(template), source)

    @property
    def shape_inputs(self) -> tuple[str, ...]:
        """The inputs whose shape the body reads (`<name>_shape` in the text MLX gets, comments
        removed): MLX passes those as parameters."""
        return tuple(n for n in self.input_names if f"{n}_shape" in compact_source(self.source))

    @property
    def ndim_inputs(self) -> tuple[str, ...]:
        """The inputs whose rank the body reads (`<name>_ndim`)."""
        return tuple(n for n in self.input_names if f"{n}_ndim" in compact_source(self.source))

    def render(
        self,
        input_dtypes: Sequence[mx.Dtype],
        output_dtypes: Sequence[mx.Dtype],
        template: Sequence[tuple[str, TemplateValue]],
        input_ndims: Sequence[int] | None = None,
    ) -> str:
        """The translation unit MLX builds for these inputs and template values, byte for byte
        (`build_kernel`; inputs of rank 0 get no shape parameters, `input_ndims` None means none
        is). The disk cache (cuda_disk_cache.py) finds MLX's compiled module by its hash."""
        source = compact_source(self.source)
        ndims = input_ndims or [1] * len(self.input_names)
        params = []
        for name, dtype, ndim in zip(self.input_names, input_dtypes, ndims, strict=True):
            params.append(f"    const {cuda_type(dtype)}* {name},\n")
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if ndim > 0 and name + suffix in source:
                    params.append(f"    const __grid_constant__ {kind} {name}{suffix},\n")
        outputs = [f"    {cuda_type(d)}* {n}" for n, d in zip(self.output_names, output_dtypes, strict=True)]
        consts = "".join(f"  {line}\n" for line in template_constants(template))
        return (
            '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
            + compact_source(self.header)
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {self.jit_name(template)}(\n"
            + "".join(params)
            + ",\n".join(outputs)
            + ") {\n"
            + (consts + "\n" if consts else "")
            + source
            + "\n}\n\n} // namespace mlx::core::cu\n"
        )

    def jit_name(self, template: Sequence[tuple[str, TemplateValue]]) -> str:
        """The kernel's name in MLX's JIT module for these template values (`custom_kernel_`,
        the name, then `_value` per argument: `_t`/`_f` for bools, MLX's type names for dtypes)."""
        suffix = "".join(f"_{_template_tag(value)}" for _, value in template)
        return f"custom_kernel_{self.name}{suffix}"


def _template_tag(value: TemplateValue) -> str:
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, int):
        return str(value)
    return _MLX_TYPE_NAMES[value]


_PREPARED: set[tuple] = set()  # instantiations whose module is on disk (or left to MLX) this process


@functools.cache
def _compiled(kernel: CudaKernel, shared_memory: int):
    return mx.fast.cuda_kernel(
        name=kernel.name,
        input_names=list(kernel.input_names),
        output_names=list(kernel.output_names),
        source=compact_source(kernel.source),
        header=compact_source(kernel.header),
        shared_memory=shared_memory,
    )
