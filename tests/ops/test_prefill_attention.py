"""Prefill attention in blocks of query rows (ops/prefill_attention.py) against one
`mx.fast.scaled_dot_product_attention` call: the same values for every mask the engine passes, the
blocks chosen only where MLX would materialise the scores, and a peak of about two blocks' scores."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from kapitsa.engine.ops import prefill_attention as pa


def _qkv(B: int = 2, H: int = 8, Hkv: int = 2, T: int = 40, L: int = 72, D: int = 32, seed: int = 0):
    mx.random.seed(seed)
    q, k, v = (mx.random.normal((B, h, n, D)) for h, n in ((H, T), (Hkv, L), (Hkv, L)))
    return q, k, v


def _masks(B: int, T: int, L: int) -> dict[str, object]:
    offsets = mx.array([L - T, L - T - 5])[:B]  # a ragged batch: row 1 has 5 keys fewer
    limit = offsets[:, None] + mx.arange(T)[None, :]
    ragged = (mx.arange(L)[None, None, :] <= limit[..., None])[:, None]  # [B, 1, T, L]
    return {"causal": "causal", "none": None, "ragged": ragged, "broadcast": ragged[:, :, -1:, :]}


@pytest.mark.parametrize("mask_name", ["causal", "none", "ragged", "broadcast"])
@pytest.mark.parametrize("rows", [1, 7, 16, 39])
def test_blocks_give_one_calls_values(mask_name: str, rows: int) -> None:
    q, k, v = _qkv()
    mask = _masks(2, 40, 72)[mask_name]
    whole = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    blocked = pa.attention_in_blocks(q, k, v, scale=0.2, mask=mask, rows=rows)
    assert blocked.shape == whole.shape
    assert mx.abs(blocked - whole).max().item() < 1e-5


def test_blocks_are_chosen_where_mlx_would_materialise_the_scores(monkeypatch) -> None:  # noqa: ANN001
    q, k, _ = _qkv(B=1, H=24, Hkv=4, T=2048, L=8192, D=256)
    q, k = q.astype(mx.bfloat16), k.astype(mx.bfloat16)
    monkeypatch.setattr(pa, "backend", lambda: None)
    assert pa.block_rows(q, k) is None  # the CPU: its own attention route
    monkeypatch.setattr(pa, "backend", lambda: "cuda")
    rows = pa.block_rows(q, k)
    assert rows is not None and rows * 24 * 8192 * 2 <= pa.SCORES_BLOCK_BYTES < (rows + 1) * 24 * 8192 * 2
    assert pa.block_rows(q[:, :, :8], k) is None  # the vector kernel's query lengths
    assert pa.block_rows(q[:, :, :, :128], k[..., :128]) is None  # a fused head size
    assert pa.block_rows(q, k[:, :, :64]) is None  # scores that fit one block
    monkeypatch.setattr(pa, "backend", lambda: "metal")
    assert pa.block_rows(q[:, :, :, :96], k[..., :96]) is not None  # Metal's sdpa_full has no 96


def test_a_blocked_call_holds_about_two_blocks_of_scores() -> None:
    q, k, v = _qkv(B=1, H=8, Hkv=2, T=512, L=1024, D=32)
    mx.eval(q, k, v)
    full_scores = 8 * 512 * 1024 * 4

    def peak(run) -> int:  # noqa: ANN001
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(run())
        return mx.get_peak_memory() - base

    whole = peak(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal"))
    rows = max(1, (full_scores // 16) // (8 * 1024 * 4))  # blocks of 1/16 of the scores
    blocked = peak(lambda: pa.attention_in_blocks(q, k, v, scale=0.2, mask="causal", rows=rows))
    assert whole >= full_scores
    assert blocked < whole / 3


def test_a_model_prefill_in_blocks_equals_one_call(monkeypatch) -> None:  # noqa: ANN001
    """Through a Qwen3.5 model's attention layers: a second chunk over a cached first one."""
    from tests.models.builders import build_ours

    model = build_ours("qwen3_5_dense")
    tokens = mx.array([[(i * 37) % 200 + 3 for i in range(48)]])

    def logits() -> mx.array:
        cache = model.make_cache(1)
        mx.eval(model(tokens[:, :20], cache))
        return model(tokens[:, 20:], cache)

    plain = logits()
    monkeypatch.setattr(pa, "backend", lambda: "cuda")
    monkeypatch.setattr(pa, "FUSED_PREFILL_HEAD_DIMS", {})
    calls = []
    original = pa.attention_in_blocks
    monkeypatch.setattr(
        pa, "attention_in_blocks", lambda *a, **kw: calls.append(kw["rows"]) or original(*a, **kw)
    )
    monkeypatch.setattr(
        pa, "block_rows", lambda q, k, _b=pa.block_rows: _b(q, k, block_bytes=q.shape[1] * k.shape[2] * 4 * 5)
    )
    blocked = logits()
    assert calls and all(r == 5 for r in calls)
    assert mx.abs(blocked - plain).max().item() < 1e-4
