"""The fused Gated DeltaNet kernel's own CUDA body and Metal port executed on the CPU
(tests/kernels/emulation.py) against the reference, the one-time probe that keeps a broken kernel
out, and the Metal source's agreement with its launcher."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from nvcc_check import nvcc

from kapitsa.engine.kernels import gdn, gdn_plan, gdn_reference
from kapitsa.engine.kernels.metal import read_source
from tests.kernels.emulation import Emulated, cuda_translation, metal_translation
from tests.kernels.test_gdn_kernel import _config_args, embed_in_projection
from tests.kernels.test_gdn_reference import assert_close, make_inputs

EMULATION_SPECS = {  # name: (B, T, Hk, Hv, Dk, Dv, dtype, layout, masked, state, shared budget)
    "one-warp-no-state-f32": (2, 5, 1, 2, 32, 32, mx.float32, "plain", True, False, None),
    "grouped-chunked-f32": (2, 7, 2, 4, 64, 32, mx.float32, "plain", True, True, 2 * (4 * 160 + 12)),
    "bf16-qwen3next-views": (2, 3, 2, 4, 64, 64, mx.bfloat16, "qwen3_next", True, True, None),
    "real-head-dims-bf16": (1, 2, 1, 2, 128, 128, mx.bfloat16, "plain", True, True, None),
    "f16-qwen3_5-views": (1, 2, 1, 2, 96, 32, mx.float16, "qwen3_5", False, True, None),
}


def emulation_cases(fast: set[str]) -> list:
    """The specs as params; those not in `fast` are marked slow (each costs a g++ build and a run)."""
    return [
        pytest.param(*spec, id=name, marks=[] if name in fast else [pytest.mark.slow])
        for name, spec in EMULATION_SPECS.items()
    ]


EMULATION_CASES = emulation_cases(set(EMULATION_SPECS) - {"f16-qwen3_5-views"})
METAL_EMULATION_CASES = emulation_cases({"bf16-qwen3next-views"})  # same port: one case by default


def emulation_inputs(B, T, hk, hv, dk, dv, dtype, layout, masked, state) -> tuple[dict, dict, dict]:
    """(kernel args, heads, plain args for the reference) of one emulation case."""
    mask = mx.random.bernoulli(0.6, (B, T)) if masked else None
    args, heads = make_inputs(B, T, hk, hv, dk, dv, dtype=dtype, mask=mask, seed=5, state=state)
    plain = args
    if layout != "plain":
        views = embed_in_projection(args, packed=layout == "qwen3_next", hk=hk, hv=hv, dk=dk, dv=dv)
        cast = {
            k: gdn_reference.HeadView(v.array.astype(dtype), v.offset, v.group, v.group_stride)
            for k, v in views.items()
        }
        args = dict(args, **cast)
    return args, heads, plain


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize("B,T,hk,hv,dk,dv,dtype,layout,masked,state,budget", EMULATION_CASES)
def test_cuda_body_emulated_on_cpu_matches_reference(
    B, T, hk, hv, dk, dv, dtype, layout, masked, state, budget, monkeypatch, tmp_path
) -> None:
    """gdn_step's real launch path with the real CUDA body, executed by host threads."""
    args, heads, plain = emulation_inputs(B, T, hk, hv, dk, dv, dtype, layout, masked, state)
    ref_out, ref_state = gdn_reference.gdn_step_reference(**plain, **heads)
    mask = heads["mask"]
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(gdn, "CUDA_KERNEL", Emulated(gdn.CUDA_KERNEL, cuda_translation, tmp_path))
    if budget is not None:  # force several shared-memory chunks
        monkeypatch.setitem(gdn_plan.SHARED_BUDGET, "cuda", budget)
    out, new_state = gdn.gdn_step(**args, **heads)
    assert len(list(tmp_path.iterdir())) == 1  # the kernel ran, not the reference
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)
    if mask is not None:
        assert mx.array_equal(mx.where(mask[..., None], 0, out), mx.zeros_like(out)).item()


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize("B,T,hk,hv,dk,dv,dtype,layout,masked,state,budget", METAL_EMULATION_CASES)
def test_metal_body_emulated_on_cpu_matches_reference(
    B, T, hk, hv, dk, dv, dtype, layout, masked, state, budget, monkeypatch, tmp_path
) -> None:
    """The .metal port's logic, executed as host C++ the same way (its Metal compilation and
    Apple-GPU behaviour stay unverified here)."""
    args, heads, plain = emulation_inputs(B, T, hk, hv, dk, dv, dtype, layout, masked, state)
    ref_out, ref_state = gdn_reference.gdn_step_reference(**plain, **heads)
    monkeypatch.setattr(gdn, "backend", lambda: "metal")
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(gdn, "METAL_KERNEL", Emulated(gdn.METAL_KERNEL, metal_translation, tmp_path))
    if budget is not None:
        monkeypatch.setitem(gdn_plan.SHARED_BUDGET, "metal", budget)
    out, new_state = gdn.gdn_step(**args, **heads)
    assert len(list(tmp_path.iterdir())) == 1
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)


@pytest.fixture
def fresh_probe():
    gdn.kernel_works.cache_clear()
    yield
    gdn.kernel_works.cache_clear()


class BrokenKernel:
    def __init__(self, result=None):
        self.result = result

    def __call__(self, inputs, *, output_shapes, output_dtypes, **_):
        if self.result is None:
            raise RuntimeError("nvrtc: error: identifier 'x' is undefined")
        return [mx.full(s, self.result, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]


@pytest.mark.parametrize("result", [None, 0.5])
def test_a_kernel_that_fails_or_disagrees_is_not_used(result, monkeypatch, fresh_probe, caplog) -> None:
    """It raises at evaluation or returns wrong numbers: gdn_step keeps to the reference."""
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "CUDA_KERNEL", BrokenKernel(result))
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    out, state = gdn.gdn_step(**args, **heads)
    ref_out, ref_state = gdn_reference.gdn_step_reference(**args, **heads)
    assert mx.array_equal(out, ref_out).item() and mx.array_equal(state, ref_state).item()
    assert not gdn.kernel_works("cuda") and "fused GDN step kernel" in caplog.text


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
def test_a_working_kernel_passes_the_probe(monkeypatch, fresh_probe, tmp_path) -> None:
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "CUDA_KERNEL", Emulated(gdn.CUDA_KERNEL, cuda_translation, tmp_path))
    state = mx.random.state[0]
    assert gdn.kernel_works("cuda")
    assert mx.array_equal(state, mx.random.state[0]).item()  # the probe leaves the global seed alone


# ------------------------------------------------------------------- Metal source sanity


def test_metal_source_declares_what_the_launcher_passes() -> None:
    header, body = read_source(gdn.METAL_KERNEL.filename)
    template, _, _ = gdn_plan.launch_config("metal", **_config_args(mx.bfloat16, T=4, dk=128, dv=128))
    for name, _ in template:
        assert name in body, name
    for name in gdn.INPUT_NAMES + gdn.OUTPUT_NAMES:
        assert name in body, name
    assert "gdn_simd_sum" in header and "thread_index_in_threadgroup" in body
