"""CPU decode steps of several rows through BLAS (KernelOptions.cpu_blas_rows): the model runner
turns it on when every linear keeps its float32 copy; such a step then runs op by op with its
linears and tied head on the copies, and its logits equal the compiled step's (MLX's quantized
products); a single row and a verify's rows keep MLX's products (a verify's bits then equal the
decode steps')."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import mlx.core as mx
import pytest

from kapitsa.engine.kernels import cpu_blas
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.models.base import tied_embedding, use_kernel_options
from kapitsa.engine.ops import linear as qlinear
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.runner.model_runner import ModelRunner

DEMO = Path(str(resources.files("kapitsa").joinpath("demo")))
PROMPTS = [[5, 17, 301, 42, 9, 77], [8, 1000, 3, 64, 12, 500]]


@pytest.fixture
def blas_calls(monkeypatch) -> list[int]:
    """The row counts of every BLAS product (linears and the head) made while the test runs."""
    calls: list[int] = []
    original = cpu_blas.matmul_t

    def spy(x, weight_t):  # noqa: ANN001, ANN202
        calls.append(x.size // x.shape[-1])
        return original(x, weight_t)

    monkeypatch.setattr(cpu_blas, "matmul_t", spy)
    return calls


def _steps(runner: ModelRunner, rows: int, steps: int = 3) -> mx.array:
    """Prefill `rows` prompts as one batch, then `steps` greedy decode steps; the last logits."""
    cache = runner.model.make_cache(rows)
    logits = runner.model(mx.array(PROMPTS[:rows]), cache)[:, -1, :]
    for _ in range(steps):
        logits = runner.decode_lazy(cache, mx.argmax(logits, axis=-1).astype(mx.int32))
        mx.eval(logits)
    return logits


def test_the_runner_turns_it_on_only_when_every_copy_is_kept(on_cpu) -> None:
    roomy = ModelRunner(load_model(DEMO).model, cpu_float32_bytes=1 << 30)
    assert roomy.model.kernel_options.cpu_blas_rows == cpu_blas.STEP_MIN_ROWS
    assert qlinear.keeps_every_dense_copy(roomy.model) and tied_embedding(roomy.model).keeps_dense_copy
    # the float32 cast fits, the linears' copies do not
    tight = ModelRunner(load_model(DEMO).model, cpu_float32_bytes=1 << 20)
    assert tight.model.kernel_options.cpu_blas_rows == 0
    assert not qlinear.keeps_every_dense_copy(tight.model)


def test_a_batch_step_takes_blas_and_equals_the_compiled_step(on_cpu, blas_calls) -> None:
    runner = ModelRunner(load_model(DEMO).model, cpu_float32_bytes=1 << 30)
    options = runner.model.kernel_options
    by_blas = _steps(runner, rows=2)
    assert blas_calls and set(blas_calls) >= {2}  # the decode steps' two rows, head included
    assert blas_calls.count(2) > 3 * 8  # every linear of each of the 3 steps, not only a few
    blas_calls.clear()
    use_kernel_options(runner.model, dataclasses.replace(options, cpu_blas_rows=0))
    qlinear.route_quantized_linears(runner.model, runner.model.kernel_options, dense_copy_bytes=1 << 30)
    compiled = _steps(runner, rows=2)
    assert not [n for n in blas_calls if n < cpu_blas.MIN_ROWS]  # MLX's products throughout
    err = mx.abs(by_blas - compiled).max() / mx.abs(compiled).max()
    assert float(err) < 1e-4
    assert mx.array_equal(mx.argmax(by_blas, axis=-1), mx.argmax(compiled, axis=-1))


def test_a_single_row_keeps_the_compiled_step(on_cpu, blas_calls) -> None:
    runner = ModelRunner(load_model(DEMO).model, cpu_float32_bytes=1 << 30)
    cache = runner.model.make_cache(1)
    logits = runner.model(mx.array(PROMPTS[:1]), cache)[:, -1, :]
    blas_calls.clear()
    mx.eval(runner.decode_lazy(cache, mx.argmax(logits, axis=-1).astype(mx.int32)))
    assert blas_calls == []


def test_step_rows_need_the_option_and_the_cpu(on_cpu) -> None:
    x = mx.zeros((2, 1, 8))
    assert cpu_blas.takes_step_rows(x, 2) and not cpu_blas.takes_step_rows(x, 3)
    assert not cpu_blas.takes_step_rows(x, 0)
    assert not cpu_blas.takes_step_rows(mx.zeros((1, 2, 8)), 2)  # a verify's rows
    assert cpu_blas.steps_by_blas(2, 1, 2) and not cpu_blas.steps_by_blas(1, 1, 2)
    assert not cpu_blas.steps_by_blas(9, 1, 0) and not cpu_blas.steps_by_blas(1, 4, 2)


def test_a_verify_keeps_mlx_products_so_it_equals_decode_steps(on_cpu, blas_calls) -> None:
    """Greedy speculation's promise on the CPU: a verify's rows get a one-row step's bits."""
    runner = ModelRunner(load_model(DEMO).model, cpu_float32_bytes=1 << 30)
    prompt = PROMPTS[0]
    stepped = runner.model.make_cache(1)
    runner.model(mx.array([prompt[:2]]), stepped)
    rows = [runner.decode_lazy(stepped, mx.array([t], dtype=mx.int32)) for t in prompt[2:]]
    verified = runner.model.make_cache(1)
    runner.model(mx.array([prompt[:2]]), verified)
    blas_calls.clear()
    chain = runner.model(mx.array([prompt[2:]]), verified)[0]
    assert blas_calls == []
    assert mx.array_equal(mx.concatenate(rows, axis=0), chain)


def test_exact_verify_leaves_it_off(on_cpu) -> None:
    options = KernelOptions(exact_verify=True)
    runner = ModelRunner(load_model(DEMO).model, cpu_float32_bytes=1 << 30, kernels=options)
    assert runner.model.kernel_options.cpu_blas_rows == 0
