"""Decode attention for head sizes MLX's CUDA backend has no fast kernel for (kernels/attention.py):
the CUDA bodies compile for sm_90 and, run on the CPU by the threads emulator of
test_gdn_kernel.py, give the reference's output; the GPU test runs on the H200."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import attention, backend
from tests.kernels.emulation import Emulated, cuda_host_translation


def _case(B, hq, hkv, D, cap, dtype, seed=0, gated=False):
    keys = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((B, hq, 1, D), key=keys[0]).astype(dtype)
    k = mx.random.normal((B, hkv, cap, D), key=keys[1]).astype(dtype)
    v = mx.random.normal((B, hkv, cap, D), key=keys[2]).astype(dtype)
    gate = mx.random.normal((B, 1, hq * D), key=keys[3]).astype(dtype) if gated else None
    return q, k, v, gate


def test_supports_only_what_mlx_lacks() -> None:
    q, k, v, _ = _case(1, 8, 2, 256, 16, mx.bfloat16)
    assert attention.supports(q, k, v) == (backend() == "cuda")
    q128, k128, v128, _ = _case(1, 8, 2, 128, 16, mx.bfloat16)
    assert not attention.supports(q128, k128, v128)  # MLX's own sdpa_vector takes head dim 128
    q2 = mx.concatenate([q, q], axis=2)
    assert not attention.supports(q2, k, v)  # one query token per row only


def test_reference_is_the_models_attention() -> None:
    """The reference over the first L positions equals SDPA over a cache holding exactly L."""
    q, k, v, gate = _case(2, 8, 2, 64, 24, mx.float32, gated=True)
    got = attention.decode_attention_reference(q, k, v, 19, scale=0.125, gate=gate)
    want = mx.fast.scaled_dot_product_attention(q, k[:, :, :19], v[:, :, :19], scale=0.125)
    want = want.transpose(0, 2, 1, 3).reshape(2, 1, -1) * mx.sigmoid(gate)
    assert mx.allclose(got, want, atol=1e-6).item()


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "dtype,D,nrep,gated",
    [(mx.bfloat16, 256, 4, True), (mx.bfloat16, 256, 8, True), (mx.float16, 192, 6, False)],
)
def test_cuda_sources_compile(dtype, D, nrep, gated) -> None:
    partial, combine = attention._templates(dtype, D, nrep, 4 * nrep, D**-0.5, gated)
    sources = [
        attention._PARTIAL.render([dtype] * 5 + [mx.int32], [mx.float32, mx.float32], partial),
        attention._COMBINE.render([mx.float32, mx.float32, dtype], [dtype], combine),
    ]
    for source in sources:
        assert_compiles(source)


def test_splits_cover_the_context_within_bounds() -> None:
    """Enough splits for TARGET_BLOCKS partial blocks over the kv heads at batch 1, at most
    MAX_SPLITS, and fewer on a short context (no split without keys); 1..MAX_SPLITS asked for
    explicitly, anything else refused."""
    assert attention.splits_for(1) == attention.splits_for(1, 4) == 1
    assert attention.splits_for(100, 4) == 100 // attention.MIN_KEYS_PER_SPLIT
    assert attention.splits_for(8192, 4) == attention.splits_for(10**6, 4) == attention.TARGET_BLOCKS // 4
    assert attention.splits_for(10**6, 1) == attention.MAX_SPLITS
    assert attention.splits_for(10**6, 32) * 32 == attention.TARGET_BLOCKS
    assert attention.splits_for(10**6, 10**4) == 1  # more heads than blocks wanted: one split each
    for rows in (1, 2, 4, 32, 64, 1000):
        for length in (1, 7, 64, 300, 4097, 65536):
            splits = attention.splits_for(length, rows)
            assert 1 <= splits <= attention.MAX_SPLITS and (
                splits == 1 or length // splits >= attention.MIN_KEYS_PER_SPLIT
            )
    q, k, v, _ = _case(1, 8, 2, 256, 16, mx.bfloat16)
    q8, k8, v8, _ = _case(8, 8, 2, 256, 16, mx.bfloat16)
    assert attention.splits_for(9000, k8.shape[1]) == attention.splits_for(9000, k.shape[1])  # any batch
    for bad in (0, attention.MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="splits"):
            attention.decode_attention(q, k, v, 5, scale=1.0, splits=bad)
    for bad in (0, 17):  # no key, or more keys than the buffer holds
        with pytest.raises(ValueError, match="length"):
            attention.decode_attention(q, k, v, bad, scale=1.0)


def test_a_tail_is_checked_against_the_buffers() -> None:
    q, k, v, _ = _case(1, 8, 2, 64, 16, mx.float32)
    tail = (k[:, :, :8], v[:, :, :8])
    with pytest.raises(ValueError, match="committed"):
        attention.decode_attention(q, k, v, 5, scale=1.0, tail=tail)  # where the tail starts is unsaid
    with pytest.raises(ValueError, match="committed"):
        attention.decode_attention(q, k, v, 20, scale=1.0, tail=tail, committed=17)  # past the buffers
    with pytest.raises(ValueError, match="length"):
        attention.decode_attention(q, k, v, 21, scale=1.0, tail=tail, committed=12)  # past the tail
    with pytest.raises(ValueError, match="does not match"):
        attention.decode_attention(
            q, k, v, 14, scale=1.0, tail=(tail[0].astype(mx.float16), tail[1]), committed=12
        )


def test_reference_with_a_tail_attends_over_both_parts() -> None:
    q, k, v, gate = _case(1, 8, 2, 64, 24, mx.float32, gated=True)
    tk, tv = k[:, :, 10:] * 2, v[:, :, 10:] * 3
    got = attention.decode_attention_reference(
        q, k, v, 19, scale=0.125, gate=gate, tail=(tk, tv), committed=12
    )
    keys = mx.concatenate([k[:, :, :12], tk[:, :, :7]], axis=2)
    values = mx.concatenate([v[:, :, :12], tv[:, :, :7]], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125)
    want = want.transpose(0, 2, 1, 3).reshape(1, 1, -1) * mx.sigmoid(gate)
    assert mx.allclose(got, want, atol=1e-6).item()


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,B,hq,hkv,D,cap,length,gated,splits",
    [
        (mx.float32, 1, 4, 2, 64, 64, 37, False, None),  # several keys per warp
        (mx.bfloat16, 2, 8, 2, 256, 32, 5, True, 16),  # most splits and warps see no key
        (mx.float32, 1, 3, 1, 32, 16, 16, True, None),  # the whole buffer
        (mx.float32, 1, 4, 2, 64, 160, 150, False, 3),  # uneven splits, a warp prefetching its next key
        (mx.float32, 2, 4, 1, 32, 96, 90, True, 1),  # one split: every partial of a query in one block
        (mx.float32, 1, 2, 1, 32, 200, 190, False, 32),  # more partials than a warp's lanes
        (mx.bfloat16, 1, 4, 1, 256, 64, 50, True, 5),  # 16-byte loads of bf16 rows, split of 10 keys
        (mx.float32, 1, 8, 2, 128, 300, 300, False, None),  # 16-byte loads of float32 rows, 4 per lane
        (mx.float16, 1, 6, 1, 96, 40, 40, True, 2),  # 6-byte lane slices: loaded value by value
    ],
)
def test_emulated_kernels_match_reference(
    monkeypatch, tmp_path, dtype, B, hq, hkv, D, cap, length, gated, splits
) -> None:
    monkeypatch.setattr(attention, "_PARTIAL", Emulated(attention._PARTIAL, cuda_host_translation, tmp_path))
    monkeypatch.setattr(attention, "_COMBINE", Emulated(attention._COMBINE, cuda_host_translation, tmp_path))
    q, k, v, gate = _case(B, hq, hkv, D, cap, dtype, seed=length, gated=gated)
    with mx.stream(mx.cpu):
        got = attention.decode_attention(q, k, v, length, scale=D**-0.5, gate=gate, splits=splits)
        got = got.astype(mx.float32)
        ref = attention.decode_attention_reference(q, k, v, length, scale=D**-0.5, gate=gate).astype(
            mx.float32
        )
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert got.shape == ref.shape == (B, 1, hq * D)
    assert mx.allclose(got, ref, atol=tol, rtol=tol).item(), float(mx.abs(got - ref).max())


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,B,hq,hkv,D,cap,tail_cap,length,committed,splits",
    [
        (mx.float32, 1, 4, 2, 64, 48, 32, 60, 40, 3),  # a split across the seam
        (mx.bfloat16, 2, 8, 2, 256, 32, 16, 40, 30, None),  # 16-byte loads from both buffers
        (mx.float32, 1, 4, 1, 32, 16, 32, 20, 0, 2),  # every key from the tail
        (mx.float32, 1, 4, 1, 32, 64, 8, 50, 50, 4),  # a tail with nothing in it yet
    ],
)
def test_emulated_kernels_with_a_tail_match_reference(
    monkeypatch, tmp_path, dtype, B, hq, hkv, D, cap, tail_cap, length, committed, splits
) -> None:
    monkeypatch.setattr(attention, "_PARTIAL", Emulated(attention._PARTIAL, cuda_host_translation, tmp_path))
    monkeypatch.setattr(attention, "_COMBINE", Emulated(attention._COMBINE, cuda_host_translation, tmp_path))
    q, k, v, gate = _case(B, hq, hkv, D, cap, dtype, seed=length, gated=True)
    _, tk, tv, _ = _case(B, hq, hkv, D, tail_cap, dtype, seed=length + 1)
    tail = {"tail": (tk, tv), "committed": committed}
    with mx.stream(mx.cpu):
        got = attention.decode_attention(q, k, v, length, scale=D**-0.5, gate=gate, splits=splits, **tail)
        ref = attention.decode_attention_reference(q, k, v, length, scale=D**-0.5, gate=gate, **tail)
        # the same keys in one buffer: the same bits (a verify reads them so, the decode step
        # that wrote them through the tail so: KernelOptions.exact_verify's token-for-token rule)
        joined_k, joined_v = attention.keys_read(k, v, length, **tail)
        one = attention.decode_attention(
            q, joined_k, joined_v, length, scale=D**-0.5, gate=gate, splits=splits
        )
    assert mx.array_equal(got, one).item()
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    assert mx.allclose(got, ref, atol=tol, rtol=tol).item(), float(mx.abs(got - ref).max())


def test_per_row_spans_are_checked() -> None:
    q, k, v, _ = _case(2, 8, 2, 64, 16, mx.float32)
    tail = (k[:, :, :8], v[:, :, :8])
    with pytest.raises(ValueError, match="one value per row"):
        attention.decode_attention(q, k, v, [5], scale=1.0)
    with pytest.raises(ValueError, match="length"):
        attention.decode_attention(q, k, v, [5, 17], scale=1.0)  # the second row past the buffer
    with pytest.raises(ValueError, match="length"):
        attention.decode_attention(q, k, v, [5, 13], scale=1.0, tail=tail, committed=[3, 4])


def test_reference_rows_of_different_lengths_are_each_rows_own() -> None:
    """Per-row lengths (and split points): each row as the reference computes it alone."""
    q, k, v, gate = _case(3, 8, 2, 64, 24, mx.float32, gated=True)
    tk, tv = k[:, :, 4:] * 2, v[:, :, 4:] * 3
    lengths, committed = [19, 7, 12], [12, 7, 3]
    got = attention.decode_attention_reference(
        q, k, v, lengths, scale=0.125, gate=gate, tail=(tk, tv), committed=committed
    )
    for b in range(3):
        alone = attention.decode_attention_reference(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], lengths[b], scale=0.125, gate=gate[b : b + 1],
            tail=(tk[b : b + 1], tv[b : b + 1]), committed=committed[b],
        )  # fmt: skip
        assert mx.array_equal(got[b : b + 1], alone).item()


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,hq,hkv,D,cap,lengths,committed,splits",
    [
        (mx.float32, 4, 2, 64, 48, [60, 33, 41], [40, 20, 41], 3),  # rows at three positions
        (mx.bfloat16, 8, 2, 256, 32, [40, 1], [30, 0], None),  # one row's only key in the tail
        (mx.float32, 4, 1, 32, 64, [9, 70], None, 4),  # no tail: most of one row's splits empty
    ],
)
def test_emulated_kernels_with_rows_at_different_positions(
    monkeypatch, tmp_path, dtype, hq, hkv, D, cap, lengths, committed, splits
) -> None:
    """A batch of conversations at different positions: each row over its own keys, the bits
    the same as that row's keys in one buffer with the batch's split count."""
    monkeypatch.setattr(attention, "_PARTIAL", Emulated(attention._PARTIAL, cuda_host_translation, tmp_path))
    monkeypatch.setattr(attention, "_COMBINE", Emulated(attention._COMBINE, cuda_host_translation, tmp_path))
    B = len(lengths)
    q, k, v, gate = _case(B, hq, hkv, D, max(cap, *lengths), dtype, seed=B, gated=True)
    extra = {}
    if committed is not None:
        _, tk, tv, _ = _case(B, hq, hkv, D, 32, dtype, seed=B + 1)
        extra = {"tail": (tk, tv), "committed": committed}
    with mx.stream(mx.cpu):
        got = attention.decode_attention(q, k, v, lengths, scale=D**-0.5, gate=gate, splits=splits, **extra)
        ref = attention.decode_attention_reference(q, k, v, lengths, scale=D**-0.5, gate=gate, **extra)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got.astype(mx.float32), ref.astype(mx.float32), atol=tol, rtol=tol).item()
    batch_splits = splits or attention.splits_for(max(lengths), hkv)
    for b in range(B):
        keys, values = k[b : b + 1], v[b : b + 1]
        if committed is not None:
            row_tail = (extra["tail"][0][b : b + 1], extra["tail"][1][b : b + 1])
            keys, values = attention.keys_read(
                keys, values, lengths[b], tail=row_tail, committed=committed[b]
            )
        with mx.stream(mx.cpu):
            alone = attention.decode_attention(
                q[b : b + 1], keys, values, lengths[b], scale=D**-0.5, gate=gate[b : b + 1],
                splits=batch_splits,
            )  # fmt: skip
        assert mx.array_equal(got[b : b + 1], alone).item(), b


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs CUDA")
@pytest.mark.parametrize(
    "length,splits", [(1, None), (300, None), (4097, None), (8192, None), (8192, 16), (8192, 128)]
)
def test_gpu_matches_reference(length, splits) -> None:
    q, k, v, gate = _case(1, 16, 4, 256, 8448, mx.bfloat16, gated=True)
    got = attention.decode_attention(q, k, v, length, scale=1 / 16, gate=gate, splits=splits).astype(
        mx.float32
    )
    ref = attention.decode_attention_reference(q, k, v, length, scale=1 / 16, gate=gate).astype(mx.float32)
    assert mx.allclose(got, ref, atol=2e-2, rtol=2e-2).item(), float(mx.abs(got - ref).max())


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("length,committed", [(8300, 8192), (8192, 8192), (200, 0)])
def test_gpu_with_a_tail_matches_reference(length, committed) -> None:
    q, k, v, gate = _case(1, 16, 4, 256, 8192, mx.bfloat16, gated=True)
    _, tk, tv, _ = _case(1, 16, 4, 256, 256, mx.bfloat16, seed=1)
    tail = {"tail": (tk, tv), "committed": committed}
    got = attention.decode_attention(q, k, v, length, scale=1 / 16, gate=gate, **tail)
    ref = attention.decode_attention_reference(q, k, v, length, scale=1 / 16, gate=gate, **tail)
    assert mx.allclose(got.astype(mx.float32), ref.astype(mx.float32), atol=2e-2, rtol=2e-2).item()
    joined_k, joined_v = attention.keys_read(k, v, length, **tail)
    one = attention.decode_attention(q, joined_k, joined_v, length, scale=1 / 16, gate=gate)
    assert mx.array_equal(got, one).item()  # bit for bit: a verify reads the keys from one buffer


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "qwen3_5_moe"])
def test_models_attend_through_the_kernel_when_on(monkeypatch, arch) -> None:
    """With the "attn" family on and a head size it takes (its reference standing in for the
    kernel), every attention layer of the compiled decode takes it, the gate included, and the
    logits are those of the default path."""
    from kapitsa.engine.models import base
    from tests.models.builders import build_ours, logits_under_families

    calls = []

    def kernel(q, keys, values, length, *, scale, gate=None, splits=None, tail=None, committed=None):
        calls.append(gate is not None and tail is not None)  # the step's row went to the tail
        return attention.decode_attention_reference(
            q, keys, values, length, scale=scale, gate=gate, tail=tail, committed=committed
        )

    monkeypatch.setattr(base, "decode_attention", kernel)
    monkeypatch.setattr(base, "attention_usable", lambda q, k, v: True)
    model = build_ours(arch)

    plain = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba")
    assert calls == []
    fast = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba,attn")
    attention_layers = sum(1 for layer in model.layers if not layer.is_linear)
    assert len(calls) == 3 * attention_layers > 0 and all(calls)  # 3 decode steps, gated attention
    for a, b in zip(plain, fast, strict=True):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), float(mx.abs(a - b).max())


def test_unprobed_kernel_is_never_used(monkeypatch) -> None:
    """Until its probe passed (never, off CUDA), the models keep MLX's attention."""
    q, k, v, _ = _case(1, 8, 2, 256, 16, mx.bfloat16)
    monkeypatch.setattr(attention, "supports", lambda *a: True)
    monkeypatch.setattr(attention, "WORKING", {})
    assert not attention.usable(q, k, v)
    monkeypatch.setitem(attention.WORKING, "attn", True)
    assert attention.usable(q, k, v)
    if backend() != "cuda":
        monkeypatch.setattr(attention, "WORKING", {})
        assert attention.probe() is False and "attn" not in attention.WORKING


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs CUDA")
def test_gpu_rows_at_different_positions_match_reference() -> None:
    q, k, v, gate = _case(3, 16, 4, 256, 8192, mx.bfloat16, gated=True)
    _, tk, tv, _ = _case(3, 16, 4, 256, 256, mx.bfloat16, seed=1)
    lengths, committed = [8300, 300, 4097], [8192, 250, 4000]
    tail = {"tail": (tk, tv), "committed": committed}
    got = attention.decode_attention(q, k, v, lengths, scale=1 / 16, gate=gate, **tail)
    ref = attention.decode_attention_reference(q, k, v, lengths, scale=1 / 16, gate=gate, **tail)
    assert mx.allclose(got.astype(mx.float32), ref.astype(mx.float32), atol=2e-2, rtol=2e-2).item()
