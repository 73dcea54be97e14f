"""The attention prep kernel (kernels/attn_prep.py): its reference is the model's projection
split, q/k norms and rotation; the CUDA body compiles for sm_90, runs on the CPU under the threads
emulator of test_gdn_kernel.py with the reference's results, and on the H200 (gpu test)."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.cache.layers import KVCache
from kapitsa.engine.kernels import attn_prep, backend
from kapitsa.engine.kernels.attn_prep import PrepSpec
from kapitsa.engine.models.base import Attention, use_kernel_options
from kapitsa.engine.ops.rope import Rope
from kapitsa.engine.options import KernelOptions
from tests.kernels.emulation import Emulated, cuda_host_translation

QWEN_27B = PrepSpec(heads=24, kv_heads=4, head_dim=256, gated=True, eps=1e-6, rotary_dims=64)


def _case(spec: PrepSpec, B: int, T: int, dtype, seed: int = 0):
    keys = mx.random.split(mx.random.key(seed), 4)
    qkv = (2 * mx.random.normal((B, T, spec.width), key=keys[0])).astype(dtype)
    q_w = (1 + 0.3 * mx.random.normal((spec.head_dim,), key=keys[1])).astype(dtype)
    k_w = (1 + 0.3 * mx.random.normal((spec.head_dim,), key=keys[2])).astype(dtype)
    dims = spec.rotary_dims or 2
    inv_freq = 1.0 / (10000.0 ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    offsets = mx.array([(7 + 911 * b) % 5000 for b in range(B)], dtype=mx.int32)
    return qkv, offsets, spec, q_w, k_w, inv_freq


def _close(got, ref, tol: float) -> None:
    assert (got[3] is None) == (ref[3] is None)
    for g, r in zip(got, ref, strict=True):
        if r is None:
            continue
        assert g.shape == r.shape and g.dtype == r.dtype
        diff = float(mx.abs(g.astype(mx.float32) - r.astype(mx.float32)).max())
        assert diff <= tol * max(1.0, float(mx.abs(r.astype(mx.float32)).max())), diff


@pytest.mark.parametrize("gated", [True, False])
def test_reference_is_the_models_projection(gated) -> None:
    """The reference over a fused projection's output equals Attention.project + rotate."""
    mx.random.seed(3)
    attn = Attention(64, 4, 2, 32, gated=gated, qk_norm_eps=1e-6, rope=Rope(16, 10000.0))
    attn.q_norm.weight = 1 + 0.3 * mx.random.normal((32,))
    attn.k_norm.weight = 1 + 0.3 * mx.random.normal((32,))
    x = mx.random.normal((2, 3, 64))
    offsets = mx.array([5, 40], dtype=mx.int32)
    q, k, v, gate = attn.project(x)
    q, k = attn.rotate(q, k, offsets)
    qkv = mx.concatenate([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], axis=-1)
    spec = PrepSpec(heads=4, kv_heads=2, head_dim=32, gated=gated, eps=1e-6, rotary_dims=16)
    ref = attn_prep.prep_reference(
        qkv, offsets, spec, attn.q_norm.weight, attn.k_norm.weight, attn.rope.inv_freq
    )
    _close(ref, (q, k, v, gate), 1e-5)


def test_supports() -> None:
    assert attn_prep.supports(1, mx.bfloat16, QWEN_27B) == (backend() == "cuda")
    assert not attn_prep.supports(17, mx.bfloat16, QWEN_27B)  # longer than a verification chain
    odd = PrepSpec(heads=2, kv_heads=1, head_dim=48, gated=False, eps=None, rotary_dims=0)
    assert not attn_prep.supports(1, mx.float32, odd)  # head dim not a multiple of 32


def test_probe_off_cuda_is_false_and_unused() -> None:
    if backend() == "cuda":
        pytest.skip("on CUDA the probe runs the kernel")
    assert attn_prep.probe() is False
    assert attn_prep.probe(QWEN_27B, mx.bfloat16) is False
    assert attn_prep.WORKING == {}


NEMOTRON = PrepSpec(heads=32, kv_heads=2, head_dim=128, gated=False, eps=None, rotary_dims=0)


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "dtype,spec,tokens", [(mx.bfloat16, QWEN_27B, 1), (mx.float16, QWEN_27B, 4), (mx.bfloat16, NEMOTRON, 8)]
)
def test_cuda_source_compiles(dtype, spec, tokens) -> None:
    template = attn_prep._template(dtype, spec)
    assert_compiles(
        attn_prep._KERNEL.render([dtype, dtype, dtype, mx.float32, mx.int32], [dtype] * 4, template)
    )


EMULATION = [
    # B, T, spec, dtype
    (1, 1, PrepSpec(heads=4, kv_heads=2, head_dim=256, gated=True, eps=1e-6, rotary_dims=64), mx.bfloat16),
    (2, 3, PrepSpec(heads=3, kv_heads=1, head_dim=64, gated=False, eps=1e-5, rotary_dims=64), mx.float32),
    (2, 1, PrepSpec(heads=2, kv_heads=2, head_dim=32, gated=True, eps=None, rotary_dims=0), mx.float32),
]


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize("B,T,spec,dtype", EMULATION)
def test_emulated_kernel_matches_reference(monkeypatch, tmp_path, B, T, spec, dtype) -> None:
    """The real launch path with the real CUDA body, run by host threads."""
    monkeypatch.setattr(attn_prep, "_KERNEL", Emulated(attn_prep._KERNEL, cuda_host_translation, tmp_path))
    case = _case(spec, B, T, dtype, seed=B * 10 + T)
    with mx.stream(mx.cpu):
        got = attn_prep.prep(*case)
        ref = attn_prep.prep_reference(*case)
    # bf16: the same roundings, but another summation order and another sin/cos can move a value
    # across a rounding boundary (one bf16 step of the larger values)
    _close(got, ref, 1e-5 if dtype == mx.float32 else 1.6e-2)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_matches_reference(T) -> None:
    assert attn_prep.probe(QWEN_27B, mx.bfloat16)
    case = _case(QWEN_27B, 2, T, mx.bfloat16, seed=T)
    _close(attn_prep.prep(*case), attn_prep.prep_reference(*case), 1.6e-2)


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "qwen3_5_moe", "qwen3_next", "nemotron_moe"])
def test_models_prepare_attention_through_the_kernel_when_on(monkeypatch, arch) -> None:
    """With the "attn" family on (the reference standing in for the kernel), every attention
    layer of a fused model's compiled steps (the 4-token prompt as a short chain, then decode
    steps) takes the prep, and the logits are those of the default path."""
    from kapitsa.engine.loading.fuse import fuse_model
    from tests.models.builders import build_ours, logits_under_families

    calls = []

    def kernel(qkv, offsets, spec, q_w, k_w, inv_freq):
        calls.append(qkv.shape[1])
        return attn_prep.prep_reference(qkv, offsets, spec, q_w, k_w, inv_freq)

    monkeypatch.setattr(attn_prep, "prep", kernel)
    monkeypatch.setattr(attn_prep, "usable", lambda tokens, dtype, spec: True)
    model = build_ours(arch)
    fuse_model(model)

    plain = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba")
    assert calls == []
    fast = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba,attn")
    attention_layers = sum(isinstance(c, KVCache) for c in model.make_cache(1).layers)
    # traced once per step length and layer: the prompt's chain (4) and the decode step (1)
    assert attention_layers > 0 and sorted(calls) == [1] * attention_layers + [4] * attention_layers
    for a, b in zip(plain, fast, strict=True):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), float(mx.abs(a - b).max())


def test_unprobed_kernel_is_never_used(monkeypatch) -> None:
    """Until its probe passed for that layout and dtype (never, off CUDA), the models keep the op
    path."""
    monkeypatch.setattr(attn_prep, "supports", lambda *a: True)
    monkeypatch.setattr(attn_prep, "WORKING", {})
    assert not attn_prep.usable(1, mx.bfloat16, QWEN_27B)
    monkeypatch.setitem(attn_prep.WORKING, (QWEN_27B, mx.bfloat16), True)
    assert attn_prep.usable(1, mx.bfloat16, QWEN_27B)
    assert not attn_prep.usable(1, mx.float16, QWEN_27B)  # another dtype: another probe
    assert not attn_prep.usable(1, mx.bfloat16, NEMOTRON)  # another layout too


def test_layers_probe_their_own_layout(monkeypatch) -> None:
    """A fused Qwen model's attention layers probe the prep for their layout and dtype before
    tracing (with the family on)."""
    from kapitsa.engine.loading.fuse import fuse_model
    from tests.models.builders import build_ours, greedy_logits

    probed = []
    monkeypatch.setattr(attn_prep, "probe", lambda spec, dtype: probed.append((spec, dtype)) or False)
    model = build_ours("qwen3_5_dense")
    fuse_model(model)
    use_kernel_options(model, KernelOptions(families=frozenset({"gdn", "moe", "qmv", "mamba", "attn"})))
    greedy_logits(model, steps=1)
    layer = next(layer for layer in model.layers if not layer.is_linear)
    assert probed and set(probed) == {(layer.self_attn.prep_spec, mx.float32)}
