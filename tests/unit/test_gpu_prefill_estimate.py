"""The estimate's GPU prefill terms: the layer shapes read from configs, the CUDA routes' thresholds
kept equal to the engine's, and how each term scales. The figures they are checked against on the
H200 are in docs/results.md (lab/memory_fit.py)."""

from __future__ import annotations

import dataclasses

import pytest

from kapitsa import memory_estimate as me
from kapitsa.catalog import arch_from_config, load_catalog
from kapitsa.testing.tiny import tiny_config

QWEN_27B = dict(  # Qwen3.6-27B's text config
    hidden_size=5120,
    num_hidden_layers=64,
    intermediate_size=17408,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    vocab_size=248320,
)


def _arch(kind: str = "qwen3_5", **dims):  # noqa: ANN202
    return arch_from_config(tiny_config(kind, **dims))


def test_the_cuda_route_thresholds_are_the_engines() -> None:
    from kapitsa.engine.ops import linear, moe

    assert me.DENSE_COPY_MIN_ROWS == linear.DEQUANT_MIN_ROWS
    assert me.DENSE_COPY_MAX_BYTES == linear.DEQUANT_MAX_BYTES
    assert me.EXPERT_COPY_MIN_ROWS == moe.MOE_DEQUANT_MIN_ROWS
    assert me.EXPERT_COPY_MAX_BYTES == moe.MOE_DEQUANT_MAX_BYTES
    from kapitsa.engine.ops import prefill_attention

    assert me.FUSED_PREFILL_HEAD_DIMS == prefill_attention.FUSED_PREFILL_HEAD_DIMS


def test_configs_give_the_layer_shapes() -> None:
    dense = _arch(**QWEN_27B)
    assert (dense.attention_heads, dense.mlp_width, dense.moe_layers) == (24, 17408, 0)
    moe = _arch("qwen3_5_moe", num_experts=16, shared_expert_intermediate_size=96)
    assert moe.mlp_width == 96 and moe.moe_layers == moe.attention_layers + moe.linear_layers
    nemotron = arch_from_config(tiny_config("nemotron_h"))
    assert nemotron.moe_layers > 0 and nemotron.attention_heads > 0
    for arch in (dense, moe, nemotron):
        assert me.knows_layer_shapes(arch)
    catalog = load_catalog()
    assert catalog.get("27b").arch.mlp_width == dense.mlp_width  # type: ignore[union-attr]
    assert catalog.get("27b").arch.attention_heads == dense.attention_heads  # type: ignore[union-attr]


def test_a_gpu_layer_counts_dense_weight_copies_on_cuda_only_and_from_their_row_count() -> None:
    arch = _arch(**QWEN_27B)
    metal = me.gpu_layer_bytes(arch, 2048, cuda=False)
    cuda = me.gpu_layer_bytes(arch, 2048, cuda=True)
    # the widest layer's weights (a Gated DeltaNet layer and its MLP: ~383 M parameters) in bf16
    assert cuda - metal == pytest.approx(2 * 383e6, rel=0.01)
    assert me.gpu_layer_bytes(arch, 256, cuda=True) == me.gpu_layer_bytes(arch, 256, cuda=False)
    assert me.gpu_layer_bytes(arch, 1024, cuda=False) * 2 == metal  # activations scale with the chunk


def test_the_prefill_workspace_follows_the_backend() -> None:
    arch = _arch(**QWEN_27B)
    cpu = me.prefill_peak_bytes(arch, context_tokens=8192, prefill_chunk=2048, dtype_bytes=2)
    assert cpu == me.prefill_peak_bytes(
        arch, context_tokens=8192, prefill_chunk=2048, dtype_bytes=2, backend=None
    )
    sizes = dict(context_tokens=8192, prefill_chunk=2048, dtype_bytes=2)
    metal = me.prefill_peak_bytes(arch, **sizes, backend="metal")
    cuda = me.prefill_peak_bytes(arch, **sizes, backend="cuda")
    layers = me.GPU_LAYERS_IN_FLIGHT * me.gpu_layer_bytes(arch, 2048, cuda=True)
    # head size 256: the scores (2048 x 8192 x 24 in bf16, 805 MB) run in blocks, two alive at once
    blocks = me.SCORE_BLOCKS_IN_FLIGHT * me.SCORES_BLOCK_BYTES * 49 // 48
    assert me.unfused_scores_bytes(arch, 2048, 8192, 2) == blocks
    assert me.unfused_scores_bytes(arch, 2048, 8192, 2, "metal") == blocks
    assert me.unfused_scores_bytes(arch, 16, 8192, 2) == 16 * 8192 * 49  # fits one call: all of them
    layers = me.GPU_LAYERS_IN_FLIGHT * me.gpu_layer_bytes(arch, 2048, cuda=True)
    assert cuda - metal == layers - me.GPU_LAYERS_IN_FLIGHT * me.gpu_layer_bytes(arch, 2048, cuda=False)
    narrow = dataclasses.replace(arch, head_dim=128)  # a fused attention: no scores
    assert me.unfused_scores_bytes(narrow, 2048, 8192, 2) == 0
    assert me.unfused_scores_bytes(dataclasses.replace(arch, head_dim=96), 2048, 8192, 2, "metal") > 0
    unknown = dataclasses.replace(arch, attention_heads=0)  # an entry without the shapes: the rule of thumb
    assert me.prefill_workspace_bytes(unknown, 2048, 8192, backend="cuda") == me.workspace_bytes(
        unknown, 2048
    )


def test_doctor_on_cuda_budgets_the_dense_copies() -> None:
    arch = load_catalog().get("27b").arch
    assert arch is not None
    fit = dict(usable_bytes=24 << 30, weight_bytes=me.weights_bytes(arch, 4.5))
    metal = me.estimate(arch, **fit, backend="metal")
    cuda = me.estimate(arch, **fit, backend="cuda")
    assert 0 < cuda.max_context < metal.max_context
    assert me.estimate(arch, **fit, backend="cuda", kv_bits=8).max_context > cuda.max_context
    assert me.gpu_backend("cpu") is None and me.gpu_backend("cuda") == "cuda"
