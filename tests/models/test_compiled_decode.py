"""The compiled decode step (models/base.py) computes what the op-by-op path computes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.loading.fuse import fuse_model
from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.options import KernelOptions
from tests.models.builders import ARCHS, build_ours


def _assert_close(a: mx.array, b: mx.array) -> None:
    """Op for op on the CPU; on a GPU the compiled path runs other kernels (fused GDN/Mamba steps,
    TF32 float32 mat-muls on CUDA) than the op-by-op one, which sum in another order: 1e-3 of the
    logits' scale there (a wrong state or mask is off by the whole scale)."""
    cpu = mx.default_device() == mx.cpu
    tol = 1e-5 if cpu else 1e-3 * max(float(mx.abs(a).max()), 1.0)
    assert mx.allclose(a, b, rtol=tol, atol=tol).item(), float(mx.abs(a - b).max())


def _steps(model, prompts: list[list[int]], steps: int, compile_on: bool) -> list[mx.array]:
    use_kernel_options(model, KernelOptions(compile_decode=compile_on))
    cache = model.make_cache(len(prompts))
    width = max(len(p) for p in prompts)
    padded = mx.array([p + [0] * (width - len(p)) for p in prompts])
    lengths = [len(p) for p in prompts]
    hidden = model.forward(padded, cache, lengths=lengths).hidden
    logits = model.logits(model.last_hidden(hidden, lengths))[:, -1]
    out = [logits]
    for _ in range(steps):
        tok = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
        logits = model(tok, cache)[:, -1]
        out.append(logits)
    mx.eval(out)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fused", [False, True])
def test_compiled_decode_matches_op_by_op(arch: str, fused: bool) -> None:
    model = build_ours(arch)
    if fused:
        fuse_model(model)
    prompts = [[3, 17, 5, 9, 41, 2], [7, 8, 9]]  # two rows at different offsets
    plain = _steps(model, prompts, 4, compile_on=False)
    fast = _steps(model, prompts, 4, compile_on=True)
    assert "_compiled_steps" in model.layers[0].__dict__  # the compiled path did run
    for a, b in zip(plain, fast, strict=True):
        _assert_close(a, b)


def test_fusing_after_a_compiled_step_drops_the_stale_traces() -> None:
    model = build_ours("qwen3_5_dense")
    before = _steps(model, [[3, 17, 5]], 2, compile_on=True)
    assert "_compiled_steps" in model.layers[0].__dict__
    fuse_model(model)
    assert "_compiled_steps" not in model.layers[0].__dict__  # retraced with the fused weights
    after = _steps(model, [[3, 17, 5]], 2, compile_on=True)
    for a, b in zip(before, after, strict=True):
        _assert_close(a, b)


def _verify_then_rollback(model, compile_on: bool, T: int) -> list[mx.array]:
    """Prefill two rows at different offsets, verify T tokens per row with a replay record, roll
    back a different number per row, then decode one step: every logit along the way."""
    use_kernel_options(model, KernelOptions(compile_decode=compile_on))
    prompts = [[3, 17, 5, 9, 41, 2], [7, 8, 9]]
    cache = model.make_cache(2)
    padded = mx.array([p + [0] * (6 - len(p)) for p in prompts])
    hidden = model.forward(padded, cache, lengths=[6, 3]).hidden
    out = [model.logits(model.last_hidden(hidden, [6, 3]))[:, -1]]
    drafts = mx.array([[11 + i for i in range(T)], [23 + 2 * i for i in range(T)]], dtype=mx.int32)
    out.append(model.logits(model.forward(drafts, cache, record=True).hidden))
    cache.rollback([T - 1, 1])
    out.append(model(mx.array([[4], [6]], dtype=mx.int32), cache)[:, -1])
    out.append(model(mx.array([[5], [1]], dtype=mx.int32), cache)[:, -1])
    mx.eval(out)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("T", [2, 5])
def test_compiled_verify_chain_matches_op_by_op(arch: str, T: int) -> None:
    """Short chains with replay records (speculative verification) take compiled functions; the
    logits, and the states left by the rollback, equal the op-by-op path's."""
    model = build_ours(arch)
    fuse_model(model)
    plain = _verify_then_rollback(model, False, T)
    fast = _verify_then_rollback(model, True, T)
    tables = [layer.__dict__.get("_compiled_steps", {}) for layer in model.layers]
    assert any(name in ("linear_chain", "mamba_chain") for t in tables for name, _ in t)  # it ran
    mixers = [m for _, m in model.named_modules() if "_compiled_steps" in m.__dict__]
    names = [name for m in mixers for name, _ in m.__dict__["_compiled_steps"]]
    assert any(isinstance(n, tuple) and n[0] == "rollback" for n in names)  # one compiled rollback
    for a, b in zip(plain, fast, strict=True):
        _assert_close(a, b)
