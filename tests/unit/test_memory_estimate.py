"""The memory estimate against measured peak memory of real tiny runs (MLX on CPU), within 10%."""

from __future__ import annotations

import gc

import pytest

from kapitsa import memory_estimate as me
from kapitsa.catalog import load_catalog

mx = pytest.importorskip("mlx.core")


def _measured_decode_peak(kind: str, context: int, dtype) -> tuple[int, int, object, object]:
    from mlx.utils import tree_flatten

    from kapitsa.catalog import arch_from_config
    from kapitsa.engine.models import get_model_module
    from kapitsa.testing.tiny import tiny_config

    gc.collect()
    mx.clear_cache()
    held_by_others = mx.get_active_memory()  # arrays other tests keep alive in this process
    config = tiny_config(kind)
    module = get_model_module(config["model_type"])
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    cache = model.make_cache(1)
    tokens = mx.random.randint(3, 200, (1, context))
    for start in range(0, context, 256):  # as the runner prefills: the cache's states evaluated too,
        # so no lazy state keeps its chunk's intermediates alive into the decode steps
        mx.eval(model(tokens[:, start : start + 256], cache=cache), *cache.state_arrays())
    mx.clear_cache()
    mx.reset_peak_memory()
    token = mx.array([[5]])
    for _ in range(4):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(token)
    return mx.get_peak_memory() - held_by_others, weights, arch_from_config(config), cache


@pytest.mark.parametrize(("kind", "dtype_name"), [("qwen3_5", "bfloat16"), ("nemotron_h", "float32")])
def test_estimate_matches_measured_peak_of_a_tiny_run(kind: str, dtype_name: str) -> None:
    context = 1024
    peak, weights, arch, cache = _measured_decode_peak(kind, context, getattr(mx, dtype_name))
    dtype_bytes = 2 if dtype_name == "bfloat16" else 4
    allocated = -(-(context + 4) // 256) * 256  # KV buffers grow in steps of 256 positions
    # The per-sequence terms are exact: what the engine's cache really holds.
    assert cache.kv_nbytes == me.kv_bytes_per_token(arch, dtype_bytes) * allocated
    assert cache.recurrent_nbytes == me.recurrent_state_bytes(arch, dtype_bytes)
    estimate = me.decode_peak_bytes(
        arch, weight_bytes=weights, context_tokens=allocated, dtype_bytes=dtype_bytes
    )
    # A K/V update may copy one layer's K and V while the old buffers are alive (the estimate counts that),
    # copy them one at a time, or update in place when MLX donates the buffer; which one happens depends
    # on when the old arrays are released. The peak lies in that range, with 10% slack on both ends.
    without_copy = estimate - me.update_transient_bytes(arch, allocated, dtype_bytes)
    assert without_copy * 0.90 <= peak <= estimate * 1.10, (without_copy, peak, estimate)


def test_max_context_follows_memory_and_caps_at_the_window() -> None:
    arch = load_catalog().get("27b").arch
    assert arch is not None
    weights = me.weights_bytes(arch, 4.5)
    small = me.estimate(arch, usable_bytes=24 * 2**30, weight_bytes=weights)
    big = me.estimate(arch, usable_bytes=100 * 2**30, weight_bytes=weights)
    assert 0 < small.max_context < big.max_context == arch.context_length
    per_token = small.kv_bytes_per_token + me.update_transient_bytes(arch, 1)
    assert small.fixed_bytes + small.max_context * per_token <= small.usable_bytes
    assert small.fixed_bytes + (small.max_context + 1) * per_token > small.usable_bytes
    tiny_budget = me.estimate(arch, usable_bytes=weights // 2, weight_bytes=weights)
    assert (tiny_budget.max_context, tiny_budget.verdict) == (0, "too_big")


def test_checkpoints_cost_recurrent_state_each() -> None:
    arch = load_catalog().get("lightning").arch
    assert arch is not None
    none = me.estimate(arch, usable_bytes=64 * 2**30, weight_bytes=10**9, num_checkpoints=0)
    eight = me.estimate(arch, usable_bytes=64 * 2**30, weight_bytes=10**9, num_checkpoints=8)
    assert eight.checkpoint_bytes - none.checkpoint_bytes == 8 * me.recurrent_state_bytes(arch)


def test_resident_conversations_and_prefetch_buffers_are_budgeted() -> None:
    arch = load_catalog().get("lightning").arch
    assert arch is not None
    budget = {"usable_bytes": 4 * 2**30, "weight_bytes": 10**9}  # less than the whole window fits
    alone = me.estimate(arch, **budget, resident_conversations=0, prefetch_bytes=0)
    default = me.estimate(arch, **budget)
    state = me.recurrent_state_bytes(arch)
    assert default.checkpoint_bytes - alone.checkpoint_bytes == 4 * 2 * state  # newest two of each of 4
    assert default.prefetch_bytes == me.READ_AHEAD_BYTES and alone.prefetch_bytes == 0
    assert default.fixed_bytes - alone.fixed_bytes == 8 * state + me.READ_AHEAD_BYTES
    assert default.max_context < alone.max_context


def test_quantized_attention_scores_are_one_block() -> None:
    arch = load_catalog().get("27b").arch
    assert arch is not None
    options = {"usable_bytes": 24 * 2**30, "weight_bytes": me.weights_bytes(arch, 4.5)}
    bf16, eight = me.estimate(arch, **options), me.estimate(arch, **options, kv_bits=8)
    assert eight.scores_bytes == me.SCORES_BLOCK_BYTES * 5 // 4 and bf16.scores_bytes == 0
    assert eight.max_context > bf16.max_context  # the block is fixed; 8-bit K/V still saves per token
    # a short context: the whole 2048-token chunk in one block; a long one: rows capped by the block
    assert me.quantized_scores_bytes(24, 2048, 100) == 2048 * 100 * (24 * 4 + 1)
    rows = me.SCORES_BLOCK_BYTES // (24 * 131072 * 4)
    assert me.quantized_scores_bytes(24, 2048, 131072) == rows * 131072 * (24 * 4 + 1)
